"""The einsum hook.

Model code never calls ``jnp.einsum`` on weights directly: it asks
:func:`einsum_for` for the einsum of its precision mode once, then calls that
for every projection, and gathers embedding rows with :func:`take_rows`. The
model file does not change with the precision:

* ``model.quantization=none``: operands in the compute dtype.
* ``fp8`` (:mod:`hypertron.quant.fp8`): e4m3 operands, e5m2 gradients, per-tensor scales;
  current scaling for a plain weight, delayed scaling for a weight that arrives as an
  :class:`~hypertron.quant.fp8.Fp8Weight` (the train step attaches the histories).
* ``int8`` (:func:`hypertron.quant.int8.train_einsum`): per-channel int8 operands, int32
  accumulation, straight-through gradients.
* A serving weight quantised to int8 (:class:`~hypertron.quant.int8.QArray`) runs its
  weight-only int8 einsum whatever the mode.
* A weight with a LoRA adapter (:class:`~hypertron.quant.lora.LoraWeight`) adds its low-rank
  product to its base's einsum, whatever form the base has; one with many
  (:class:`~hypertron.quant.lora.StackedLoraWeight`) adds each token's adapter's. Under
  remat the sum is what a layer keeps for the backward pass, named :data:`~hypertron.quant.lora.ADAPTED`
  (the ``dots`` policy saves it), and the hook's own products are recomputed: saved, the base's
  (float32 for an int8 base), ``x A`` and ``(x A) B`` made each projection keep three tensors where
  full training keeps one.

A call with ``quantize=False`` (the unembedding, unless ``model.quantize_unembed``) stays in
the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hypertron.config.schema import Quantization, choices
from hypertron.quant import fp8, int8, lora

Einsum = Callable[..., jax.Array]
MODES = choices(Quantization)  # model.quantization


def einsum_for(mode: str, compute_dtype) -> Einsum:
    """The einsum for quantisation ``mode`` (one of :data:`MODES`), computing in ``compute_dtype``.

    Both operands are cast to the compute dtype; accumulation is in float32
    where the backend allows, and the result is returned in the compute dtype
    or in ``out_dtype`` (the unembedding asks for float32 logits).
    """
    dtype = jnp.dtype(compute_dtype)
    if mode not in MODES:
        raise ValueError(f"quantization mode {mode!r}: expected one of {', '.join(MODES)}")

    def einsum(subscripts: str, x: jax.Array, w, out_dtype=None, *, quantize: bool = True) -> jax.Array:
        out = dtype if out_dtype is None else jnp.dtype(out_dtype)
        if isinstance(w, lora.StackedLoraWeight):  # many adapters, one per token (or none)
            base = einsum(subscripts, x, w.base, out_dtype, quantize=quantize)
            ids = lora.active_adapter_tokens()
            if ids is None:
                return base
            return (base + lora.stacked_delta(subscripts, x, w, ids, dtype, out)).astype(out)
        # remat keeps the sum alone (lora.ADAPTED), as it would a plain product. The backward recomputes
        # x A (rank r: about r / width of the projection) with any remat; under none as well.
        if isinstance(w, lora.LoraWeight):

            def adapted(x, w):
                base = einsum(subscripts, x, w.base, out_dtype, quantize=quantize)
                return (base + w.scale * lora.delta(subscripts, x, w.a, w.b, dtype, out)).astype(out)

            return checkpoint_name(jax.checkpoint(adapted, policy=jax.checkpoint_policies.nothing_saveable)(x, w),
                                   lora.ADAPTED)
        if isinstance(w, int8.QArray):
            return int8.einsum(subscripts, x, w, dtype, out)
        if isinstance(w, fp8.Fp8Weight):
            return fp8.einsum(subscripts, x, w.w, w.history, dtype, out)
        if quantize and mode == "fp8":
            return fp8.einsum(subscripts, x, w, None, dtype, out)
        if quantize and mode == "int8":
            return int8.train_einsum(subscripts, x, w, dtype, out)
        return jnp.einsum(subscripts, x.astype(dtype), w.astype(dtype), preferred_element_type=out)

    return einsum


def take_rows(table_vd, ids: jax.Array, dtype, layout=None) -> jax.Array:
    """Rows ``ids`` (int, any shape ``[...]``) of an embedding table [v, d], in ``dtype``: [..., d].

    ``layout`` (e.g. a sharding constraint) is applied to what is gathered from:
    the table cast to ``dtype``, or a quantised table's int8 values and scales,
    whose rows are gathered and scaled without dequantising the table.
    """
    if isinstance(table_vd, fp8.Fp8Weight):  # a tied table with an unembedding history
        table_vd = table_vd.w
    if isinstance(table_vd, int8.QArray):
        return int8.take_rows(table_vd, ids, dtype, layout)
    table_vd = table_vd.astype(dtype)
    return jnp.take(table_vd if layout is None else layout(table_vd), ids, axis=0)
