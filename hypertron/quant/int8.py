"""int8 matmuls: weight-only quantisation for serving, and int8 mixed precision for training.

Serving: int8 values and per-output-channel float32 scales.

A weight ``w`` becomes ``QArray(values, scales)`` with ``w ~= values * scales``.
Quantisation is symmetric: ``scale = max|w| / 127`` over the axes the weight
contracts in its einsum, so a scale is constant along every contracted axis
and the einsum can multiply the int8 weight first and scale its output after
(an exact rearrangement). Scales keep the weight's rank with size-1 contracted
axes, so they broadcast against the values and slice with them: a stack of
layers ``[l, ...]`` quantised here has values ``[l, ...]`` and scales
``[l, ...]``, and ``jax.lax.scan`` over the layers hands each layer its own.

Which weights are quantised, and along which axes, is each parameter's
declaration (``quantize`` and ``einsum`` of :class:`hypertron.models.params.ParamSpec`;
:func:`hypertron.models.quantize_params` applies them): the matmul weights of
the decoder and the MoE block, not the norms nor the MoE router (a small
float32 routing decision). Written here rather
than taken from a library because it has to go through the model's own einsum
hook and parameter tree (AQT and qwix quantise Flax modules).

Training (:func:`train_einsum`, ``model.quantization=int8``): both operands of every
quantised einsum are quantised per channel on the fly, multiplied as int8 with int32
accumulation and rescaled; gradients are straight-through. ``qwix.dot_general_qt`` does the
same, but it comes with Flax and its own quantised-array type, for ~40 lines here (see
:mod:`hypertron.quant.fp8` for the fuller comparison).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

QMAX = 127  # symmetric: -127..127, so the grid is the same on both sides of zero


@partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=[])
@dataclass(frozen=True, eq=False)  # holds arrays: identity, not elementwise, equality
class QArray:
    """A quantised weight: ``values`` int8 (or float8_e4m3fn: a frozen LoRA base held in fp8) of
    the weight's shape, ``scales`` float32 of the same rank, size 1 along the contracted axes
    (``w ~= values * scales``)."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)


def quantize(w: jax.Array, contracting: tuple[int, ...], dtype=jnp.int8) -> QArray:
    """Symmetric int8 quantisation of ``w`` with one scale per channel of the axes not in
    ``contracting``: ``scales = max|w| / 127`` over ``contracting`` (kept as size-1 axes), and
    ``values = round(w / scales)``, so ``|w - values * scales| <= scales / 2``. ``dtype``
    float8_e4m3fn: ``scales = max|w| / 448`` and the values rounded to e4m3 (3 mantissa bits)."""
    w32 = jnp.asarray(w).astype(jnp.float32)
    top = QMAX if jnp.dtype(dtype) == jnp.int8 else float(jnp.finfo(dtype).max)
    scales = jnp.max(jnp.abs(w32), axis=contracting, keepdims=True) / top
    safe = jnp.where(scales == 0, 1.0, scales)  # an all-zero channel stays zero
    scaled = w32 / safe
    values = jnp.round(scaled) if jnp.dtype(dtype) == jnp.int8 else scaled
    return QArray(jnp.clip(values, -top, top).astype(dtype), scales)


def dense(w: QArray | jax.Array, dtype) -> jax.Array:
    """``w`` as a plain array in ``dtype``: dequantised (``values * scales``, in float32 first)
    if quantised, else cast. For code that cannot go through the einsum (the MoE grouped matmul)."""
    if isinstance(w, QArray):
        return (w.values.astype(jnp.float32) * w.scales).astype(dtype)
    return w.astype(dtype)


def einsum(subscripts: str, x: jax.Array, w: QArray, dtype, out_dtype) -> jax.Array:
    """``einsum(subscripts, x, w)`` with a quantised ``w``: the int8 (or e4m3) values cast to ``dtype``
    (exact: both fit bf16 and wider), accumulated in float32, then the output times the
    scales, which ``w``'s contracted axes (its letters missing from the output) must not vary along.
    Returns ``out_dtype``."""
    _, w_sub, out_sub = split_subscripts(subscripts)
    if len(w_sub) != w.ndim:
        raise ValueError(f"{subscripts}: weight has rank {w.ndim}")
    for i, c in enumerate(w_sub):
        if c not in out_sub and w.scales.shape[i] != 1:
            raise ValueError(
                f"{subscripts}: the weight's scales vary along contracted axis {c!r}; quantise it with "
                "one scale per output channel of this einsum"
            )
    y = jnp.einsum(subscripts, x.astype(dtype), w.values.astype(dtype), preferred_element_type=jnp.float32)
    # Scales to the output's layout: drop the contracted (size-1) axes, order the rest as in the
    # output, and give the output's other axes (from x only) size 1.
    kept = "".join(c for c in w_sub if c in out_sub)
    s = w.scales.reshape([w.scales.shape[i] for i, c in enumerate(w_sub) if c in out_sub])
    in_out_order = [c for c in out_sub if c in kept]
    s = jnp.transpose(s, [kept.index(c) for c in in_out_order])
    s = s.reshape([s.shape[in_out_order.index(c)] if c in kept else 1 for c in out_sub])
    return (y * s).astype(out_dtype)


def split_subscripts(subscripts: str) -> tuple[str, str, str]:
    """``(x letters, weight letters, output letters)`` of an explicit ``"x,w->out"`` einsum."""
    if "->" not in subscripts or "." in subscripts:
        raise ValueError(f"quantised einsum needs explicit subscripts without '...', got {subscripts!r}")
    inputs, out_sub = subscripts.replace(" ", "").split("->")
    x_sub, w_sub = inputs.split(",")
    return x_sub, w_sub, out_sub


def _channel_quantize(a: jax.Array, sub: str, out_sub: str) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 of ``a`` with one scale per channel of its letters kept in ``out_sub``:
    ``(values int8, scales float32 [kept letters only])``."""
    a32 = a.astype(jnp.float32)
    contracted = tuple(i for i, c in enumerate(sub) if c not in out_sub)
    scales = jnp.max(jnp.abs(a32), axis=contracted, keepdims=True) / QMAX
    safe = jnp.where(scales == 0, 1.0, scales)
    values = jnp.clip(jnp.round(a32 / safe), -QMAX, QMAX).astype(jnp.int8)
    return values, jnp.squeeze(scales, contracted)


@partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def train_einsum(subscripts: str, x: jax.Array, w: jax.Array, dtype, out_dtype) -> jax.Array:
    """int8 mixed precision for training: both operands quantised per channel
    (``x`` per row of its kept letters, e.g. per token; ``w`` per output channel), an int8 x int8
    einsum accumulated in int32, rescaled by the outer product of the two scales; the gradients
    are straight-through, i.e. those of ``einsum(x, w)`` in the compute ``dtype`` (the backward
    matmuls are not quantised; AQT can quantise them too)."""
    x_sub, w_sub, out_sub = split_subscripts(subscripts)
    qx, sx = _channel_quantize(x, x_sub, out_sub)
    qw, sw = _channel_quantize(w, w_sub, out_sub)
    acc = jnp.einsum(subscripts, qx, qw, preferred_element_type=jnp.int32)
    xk, wk = (''.join(c for c in sub if c in out_sub) for sub in (x_sub, w_sub))
    scale = jnp.einsum(f"{xk},{wk}->{out_sub}", sx, sw)
    return (acc.astype(jnp.float32) * scale).astype(out_dtype)


def _train_fwd(subscripts, x, w, dtype, out_dtype):
    return train_einsum(subscripts, x, w, dtype, out_dtype), (x, w)


def _train_bwd(subscripts, dtype, out_dtype, res, g):
    x, w = res
    plain = lambda a, b: jnp.einsum(subscripts, a.astype(dtype), b.astype(dtype), preferred_element_type=out_dtype)
    dx, dw = jax.vjp(plain, x, w)[1](g.astype(out_dtype))
    return dx, dw


train_einsum.defvjp(_train_fwd, _train_bwd)


def take_rows(table_vd: QArray, ids: jax.Array, dtype, layout=None) -> jax.Array:
    """Rows ``ids`` of a quantised table [v, d] in ``dtype``: the int8 rows and their scales are
    gathered, then multiplied (nothing else is dequantised). ``layout`` is applied to the values
    and the scales before the gather."""
    layout = layout or (lambda a: a)
    rows = jnp.take(layout(table_vd.values), ids, axis=0).astype(jnp.float32)
    return (rows * jnp.take(layout(table_vd.scales), ids, axis=0)).astype(dtype)


def param_bytes(params: Any) -> int:
    """Bytes the parameters occupy: every array leaf, so a :class:`QArray` counts its int8 values
    and its float32 scales. Works on arrays and on ``jax.ShapeDtypeStruct`` trees."""
    return int(sum(int(np.prod(a.shape, dtype=np.int64)) * jnp.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(params)))
