"""Paged decode attention on a CPU as a C++ kernel (``cpu_decode.cc`` beside this file), the
``native`` backend of :func:`hypertron.kernels.ragged_attention.ragged_decode_attention` and of
the decode rows of :func:`hypertron.kernels.ragged_paged_attention.ragged_paged_attention`.

Why hand-written: XLA's CPU backend has no paged attention, and the JAX reference gathers each
chunk of a row's pages into a copy, then runs the scores, the softmax and the values as separate
one-threaded loops inside a ``while`` loop. The kernel reads each page once from the pool, keeps
the online softmax in registers and shares (row, KV head) items out over XLA's own intra-op thread
pool (``xla::ffi::ThreadPool``), as vLLM's CPU backend does its attention in C++. Pages that two
or more rows' tables start with alike (the prefix cache's) are read once for all of them first, a
KV head an item, their products vectorised over the rows' queries (cascade attention). Measured against
the reference in docs/benchmarks.md ("A C++ decode attention on the CPU").

It is built on first use with the machine's C++ compiler (``$CXX``, else ``c++`` or ``g++``;
``-O3 -march=native``) against the XLA FFI headers jaxlib ships (``jax.ffi.include_dir()``), into
``$HYPERTRON_KERNEL_CACHE`` (default ``~/.cache/hypertron/kernels``) under a name that digests the
source, the flags, the compiler, jaxlib's version and the CPU's flags, so a cache shared between
machines never loads a build for another CPU; a build is written to a temporary name and renamed,
so processes building at once do not clash. Without a compiler (or with
``HYPERTRON_NATIVE_KERNELS=0``) :func:`unavailable` says why, once in the log, and callers take the
reference. Float32 or int8 pages (scales float32 or bfloat16), queries cast to float32; ``head_dim``
at most 256, at most 16 query heads a KV head, pages of at most 64 tokens (:func:`fits`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

SOURCE = Path(__file__).with_name("cpu_decode.cc")
TARGET = "hypertron_cpu_paged_decode"
SYMBOL = "HypertronCpuPagedDecode"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-w")
# The kernel's limits (cpu_decode.cc's kMaxGroup, kMaxDim, kMaxPage).
MAX_GROUP, MAX_HEAD_DIM, MAX_PAGE_SIZE = 16, 256, 64
PAGE_DTYPES = (jnp.float32, jnp.int8)

_log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where builds go: ``$HYPERTRON_KERNEL_CACHE``, else ``$XDG_CACHE_HOME`` or ``~/.cache``,
    under ``hypertron/kernels``."""
    if os.environ.get("HYPERTRON_KERNEL_CACHE"):
        return Path(os.environ["HYPERTRON_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hypertron" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, jax.__version__,
                                       jaxlib.__version__, _cpu_flags()])
                            .encode()).hexdigest()[:16]
    out = cache_dir() / f"cpu_decode-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: built, loaded and registered; the first call builds)."""
    if os.environ.get("HYPERTRON_NATIVE_KERNELS", "1") == "0":
        return "HYPERTRON_NATIVE_KERNELS=0"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        why = "no C++ compiler (set CXX, or install g++)"
    else:
        try:
            lib = ctypes.cdll.LoadLibrary(str(_build(compiler)))
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, SYMBOL)), platform="cpu")
            return None
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
    _log.warning("the C++ decode attention is not available (%s): the CPU takes the JAX reference", why)
    return why


def fits(num_heads: int, head_dim: int, k_pages: jax.Array) -> bool:
    """Whether the kernel takes these shapes and page dtype (and is available)."""
    num_kv_heads, _, page_size, _ = k_pages.shape
    return (jnp.dtype(k_pages.dtype) in [jnp.dtype(d) for d in PAGE_DTYPES]
            and num_heads // num_kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM
            and page_size <= MAX_PAGE_SIZE and unavailable() is None)


def paged_decode(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                 page_indices: jax.Array, window: jax.Array, *, k_scales: jax.Array | None = None,
                 v_scales: jax.Array | None = None, sm_scale: float) -> jax.Array:
    """:func:`~hypertron.kernels.ragged_attention.ragged_decode_attention`'s contract (``window``
    an int32 scalar, the capacity for none) by the C++ kernel; ``[batch, num_heads, head_dim]`` in
    ``q.dtype``. Call only where :func:`fits`. Pages that two or more rows' tables start with
    alike (a shared prefix, no window cutting into it) are read once for all of them."""
    none = jnp.zeros((1,), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    out = call(q.astype(jnp.float32), k_pages, v_pages, none if k_scales is None else k_scales,
               none if v_scales is None else v_scales, lengths.astype(jnp.int32), page_indices.astype(jnp.int32),
               jnp.asarray(window, jnp.int32), sm_scale=np.float32(sm_scale))
    return out.astype(q.dtype)
