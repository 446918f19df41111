"""What the Pallas kernels share: the Triton lowering they are written for, the whole-array
block they index with ``pl.ds``, and how ``auto`` and ``interpret`` resolve on the default
backend. Each kernel keeps its own ``AUTO_BACKEND`` table (its measurements differ)."""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

# Triton, named: JAX 0.10.2 lowers an unmarked pallas_call on GPU with Mosaic GPU, which would
# try to stage the whole-array operands in shared memory. Warps and stages are Triton's defaults
# until measured.
TRITON = pl_triton.CompilerParams()


def whole(x: jax.Array) -> pl.BlockSpec:
    """A block that is the whole array, indexed inside the kernel with ``pl.ds``."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def auto_backend(table: dict[str, str], fallback: str) -> str:
    """``table``'s backend for the default platform (``cpu``, ``gpu``, ...), else ``fallback``."""
    return table.get(jax.default_backend(), fallback)


def interpret_default(interpret: bool | None) -> bool:
    """Pallas runs in interpret mode on a CPU (no compiler there) unless told otherwise."""
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)
