"""Test session setup: 8 simulated CPU devices, before JAX is imported anywhere, and one JAX
compilation cache for the whole session.

The cache: the suite's processes (pytest's workers and the ``hypertron train`` / ``serve`` /
``launch`` subprocesses the tests start, which inherit the environment) compile many of the same
programs (the tiny model's train step above all: each resume test compiles it in two or three
processes). JAX's persistent cache lets a later process load what an earlier one compiled. It
is a fresh folder per session, made by the process that loads this file first (pytest's
controller, before it starts the workers) and removed when that process exits, so nothing
carries over between runs of the suite. ``HYPERTRON_TEST_JAX_CACHE=0`` turns it off.
"""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if os.environ.get("HYPERTRON_TEST_JAX_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="hypertron-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Every compile of at least a tenth of a second (JAX's default is 1 s: most of the tiny
    # model's compiles take less here when the machine is idle, and more when it is loaded).
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"


@pytest.fixture
def float32_matmuls():
    """float32 matmuls in exact float32: on a GPU, XLA and Triton multiply float32 in TF32 unless
    told otherwise (2026-11-25, H100: kernel tests off by up to 3.5e-4 of the largest value against
    exact oracles); on a CPU this changes nothing. JAX is imported here, after the settings above."""
    import jax

    with jax.default_matmul_precision("float32"):
        yield


def pytest_collection_modifyitems(config, items):
    """Slow tests (marked ``slow``: over 20 s on CI's 2 cores) start first, spread over the workers.

    ``make test`` runs ``--dist worksteal``: each of the N workers is first handed a contiguous share
    of the collection (the k-th of N, sized as xdist sizes it), and an idle worker later steals the
    tail of a busy one's queue. So each share is built to begin with every N-th slow test: a long
    test never waits behind short ones, nor two long ones behind each other on one worker while
    another worker is idle. Each worker computes the same order, as xdist requires."""
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = [item for item in items if not item.get_closest_marker("slow")]
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    ordered, remaining = [], len(items)
    for k in range(workers):
        size = remaining // (workers - k)  # xdist's share for the k-th worker
        remaining -= size
        mine = slow[k::workers]
        take = max(0, size - len(mine))
        ordered += mine + fast[:take]
        fast = fast[take:]
    items[:] = ordered + fast
