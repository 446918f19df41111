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
# XLA's CPU compiler made cheaper (support.processes.SUITE_CPU_FLAGS: its LLVM IR emitters, not its
# MLIR fusion emitters; no split for parallel codegen) for every program of the suite, in process and
# in the processes it starts: compiling is most of the suite's CPU. 2026-11-26, 2 cores: the tiny
# train step 6.0 -> 1.2 s at least effort, 12.6 -> 7.9 s optimised; test_train.py with
# test_kv_cache.py 152 -> 76 s of CPU (emitters), test_kv_cache.py 23 -> 19 s (no split). Steps at
# least effort run up to 2x slower; optimised ones as fast, the tiny model's losses to the bit.
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    from support.processes import SUITE_CPU_FLAGS  # tests/support

    os.environ["XLA_FLAGS"] += " " + SUITE_CPU_FLAGS
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if os.environ.get("HYPERTRON_TEST_JAX_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="hypertron-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Every compile of at least a tenth of a second (JAX's default is 1 s: most of the tiny
    # model's compiles take less here when the machine is idle, and more when it is loaded).
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"


@pytest.fixture(scope="session", autouse=True)
def _least_compile_effort():
    """In-process programs compile with XLA's CPU backend at its least effort
    (``jax_disable_most_optimizations``: no LLVM optimisation nor its expensive passes), as the
    processes of ``processes.FAST_COMPILE`` do: most of the suite's time in process goes to compiling
    tiny programs that then run a few times. Results move in the last bits, within every parity
    test's tolerance. ``HYPERTRON_TEST_FAST_COMPILE=0`` compiles as users do. (Session-scoped, so it
    holds before any module's fixtures compile; JAX is imported here, after the settings above.)
    Only on the CPU: ``pytest -m gpu`` with ``JAX_PLATFORMS=cuda`` compiles as users do (XLA's
    cuBLASLt fp8 rewrite, which the fp8 tests look for, is one of the passes it would skip)."""
    if os.environ.get("HYPERTRON_TEST_FAST_COMPILE", "1") != "0" and os.environ.get("JAX_PLATFORMS") == "cpu":
        import jax

        jax.config.update("jax_disable_most_optimizations", True)
    yield


@pytest.fixture(autouse=True)
def _optimized(request, _least_compile_effort):
    """A test marked ``optimized`` compiles with XLA's optimisations on, as users do (with the suite's
    CPU emitters, above): one whose steps are the work (hundreds of them), or one that compares its
    results bit for bit with a ``hypertron`` process's. The flag is
    not part of jit's key, so JAX's in-memory caches are cleared on the way in and out (the
    persistent cache's key holds the compile options: each kind is read back as it was compiled)."""
    if request.node.get_closest_marker("optimized") is None:
        yield
        return
    import jax

    before = jax.config.read("jax_disable_most_optimizations")
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture
def float32_matmuls():
    """float32 matmuls in exact float32: on a GPU, XLA and Triton multiply float32 in TF32 unless
    told otherwise (2026-11-25, H100: kernel tests off by up to 3.5e-4 of the largest value against
    exact oracles); on a CPU this changes nothing. JAX is imported here, after the settings above."""
    import jax

    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture
def one_device(monkeypatch):
    """``train`` on the first device alone, for tests whose numerics do not depend on the mesh
    (``test_sharding.py`` and ``test_expert_parallel.py`` show meshes give the one-device step): on 2
    cores a tiny model's step on 8 simulated devices takes about 4x one device's (50-90 ms against 12-20 ms)."""
    import jax

    first = jax.devices()[:1]
    monkeypatch.setattr(jax, "devices", lambda *args: first)


def _unit(item) -> tuple:
    """Tests that share a module- or class-scoped fixture stay on one worker (each worker would
    otherwise build the fixture again: a 4-process job, a trained model); any other test is a unit
    of its own."""
    info = getattr(item, "_fixtureinfo", None)
    shared = sorted(name for name, defs in (info.name2fixturedefs.items() if info else ())
                    if defs and defs[-1].scope in ("module", "class", "package"))
    return (item.module.__name__, tuple(shared)) if shared else (item.nodeid,)


def pytest_collection_modifyitems(config, items):
    """Slow tests (marked ``slow``: over 20 s on CI's 2 cores) start first, spread over the workers.

    ``make test`` runs ``--dist worksteal``: each of the N workers is first handed a contiguous share
    of the collection (the k-th of N, sized as xdist sizes it), and an idle worker later steals the
    tail of a busy one's queue. So each share is built to begin with slow tests, dealt to the share
    with the fewest so far, largest group first, where tests sharing a module-scoped fixture form one
    group (:func:`_unit`) that goes whole to one share, its fast tests too; then the fast tests in
    collection order. Each worker computes the same order, as xdist requires."""
    units: dict[tuple, list] = {}
    for item in items:
        units.setdefault(_unit(item), []).append(item)
    slow_units = [u for u in units.values() if any(i.get_closest_marker("slow") for i in u)]
    in_slow = {id(i) for u in slow_units for i in u}
    fast = [i for i in items if id(i) not in in_slow]
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    heads: list[list] = [[] for _ in range(workers)]
    weight = [0] * workers
    for unit in sorted(slow_units, key=lambda u: -sum(bool(i.get_closest_marker("slow")) for i in u)):
        k = weight.index(min(weight))
        heads[k] += unit
        weight[k] += sum(bool(i.get_closest_marker("slow")) for i in unit)
    ordered, remaining = [], len(items)
    for k in range(workers):
        size = remaining // (workers - k)  # xdist's share for the k-th worker
        remaining -= size
        take = max(0, size - len(heads[k]))
        ordered += heads[k] + fast[:take]
        fast = fast[take:]
    items[:] = ordered + fast
