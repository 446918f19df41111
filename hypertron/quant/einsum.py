"""The einsum hook.

Model code never calls ``jnp.einsum`` on weights directly: it asks
:func:`einsum_for` for the einsum of its precision mode once, then calls that
for every projection. Quantised training (fp8, int8) replaces the function
returned here; the model file does not change.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

Einsum = Callable[[str, jax.Array, jax.Array], jax.Array]


def einsum_for(mode: str, compute_dtype) -> Einsum:
    """The einsum for precision ``mode`` ("none" only, for now), computing in ``compute_dtype``.

    Both operands are cast to the compute dtype; accumulation is in float32
    where the backend allows, and the result is returned in the compute dtype
    or in ``out_dtype`` (the unembedding asks for float32 logits).
    """
    dtype = jnp.dtype(compute_dtype)
    if mode != "none":
        raise ValueError(f"quantization mode {mode!r} is not implemented")

    def einsum(subscripts: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
        out = dtype if out_dtype is None else jnp.dtype(out_dtype)
        return jnp.einsum(subscripts, x.astype(dtype), w.astype(dtype), preferred_element_type=out)

    return einsum
