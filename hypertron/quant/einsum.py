"""The einsum hook.

Model code never calls ``jnp.einsum`` on weights directly: it asks
:func:`einsum_for` for the einsum of its precision mode once, then calls that
for every projection, and gathers embedding rows with :func:`take_rows`. Quantised
training (fp8, int8) replaces the function returned here; weight-only
quantisation for serving travels with the weights instead (a
:class:`~hypertron.quant.int8.QArray` operand), so the model file does not
change for either.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from hypertron.quant import int8

Einsum = Callable[[str, jax.Array, jax.Array], jax.Array]


def einsum_for(mode: str, compute_dtype) -> Einsum:
    """The einsum for precision ``mode`` ("none" only, for now), computing in ``compute_dtype``.

    Both operands are cast to the compute dtype; accumulation is in float32
    where the backend allows, and the result is returned in the compute dtype
    or in ``out_dtype`` (the unembedding asks for float32 logits). The weight
    may be an int8 :class:`~hypertron.quant.int8.QArray`: the matmul then runs
    on its values in the compute dtype and the output is scaled per channel.
    """
    dtype = jnp.dtype(compute_dtype)
    if mode != "none":
        raise ValueError(f"quantization mode {mode!r} is not implemented")

    def einsum(subscripts: str, x: jax.Array, w: jax.Array | int8.QArray, out_dtype=None) -> jax.Array:
        out = dtype if out_dtype is None else jnp.dtype(out_dtype)
        if isinstance(w, int8.QArray):
            return int8.einsum(subscripts, x, w, dtype, out)
        return jnp.einsum(subscripts, x.astype(dtype), w.astype(dtype), preferred_element_type=out)

    return einsum


def take_rows(table_vd: jax.Array | int8.QArray, ids: jax.Array, dtype, layout=None) -> jax.Array:
    """Rows ``ids`` (int, any shape ``[...]``) of an embedding table [v, d], in ``dtype``: [..., d].

    ``layout`` (e.g. a sharding constraint) is applied to what is gathered from:
    the table cast to ``dtype``, or a quantised table's int8 values and scales,
    whose rows are gathered and scaled without dequantising the table.
    """
    if isinstance(table_vd, int8.QArray):
        return int8.take_rows(table_vd, ids, dtype, layout)
    table_vd = table_vd.astype(dtype)
    return jnp.take(table_vd if layout is None else layout(table_vd), ids, axis=0)
