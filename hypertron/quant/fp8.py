"""fp8 matmuls for training: e4m3 operands forward, e5m2 gradients backward, per-tensor scales.

An fp8 einsum quantises each operand and the incoming gradient, and multiplies the fp8 values
themselves, the scales applied to the float32 product::

    y  = einsum(q(x, e4m3, s_x), q(w, e4m3, s_w)) * s_x s_w                      forward
    g' = q(g, e5m2, s_g);  dx = einsum^T(g', q(w)) s_g s_w,  dw = einsum^T(q(x), g') s_x s_g   backward

with ``q(a, fmt, s) = fmt(clip(a / s))`` and straight-through gradients (one custom VJP over the
whole einsum; its residuals are the fp8 operands, a byte an element). On Hopper GPUs XLA runs
each of the three as a GEMM of the fp8 operands: cuBLAS Lt's (``__cublas$lt$matmul$f8``, the
scales as its alpha) at 8192^3 on an H200, a Triton GEMM fusion at the tests' small shapes on an
H100 (2026-11-26, JAX 0.11.2); elsewhere the same program computes on the fp8 values upcast, so CPU runs reproduce fp8
numerics, not its speed.

Why fp8 operands and not quantise-dequantise ("qdq", ``fmt(a / s) * s`` fed to a bf16 einsum,
which XLA's GEMM rewriter is documented to fold): on an H200 (2026-11-26, JAX 0.11.2,
``bench/fp8_probe.py``, docs/benchmarks.md) XLA folded the qdq's round trip through fp8 away
altogether under its default ``--xla_allow_excess_precision`` (the "fp8" step computed in bf16,
unquantised, at 0.89x the bf16 step's speed), and with that flag off kept the fp8 converts but
still ran a bf16 GEMM. An einsum of fp8 operands compiled to the cuBLAS Lt fp8 GEMM at once:
1.11 ms against 1.44 ms in bf16 at 8192^3, quantisation of both operands included.
:func:`qdq` stays as the numerics' reference.

Scales are per tensor, ``s = amax / fmt_max`` (``fmt_max`` = 448 for e4m3, 57344 for e5m2):

``current``
    ``amax = max|a|`` of the tensor being quantised (one extra read of it).
``delayed`` (Transformer Engine's default recipe)
    ``amax`` = the largest of the last ``amax_history`` steps' maxima, kept per tensor in an
    :class:`AmaxHistory` that lives in the train state and is checkpointed with it; this step's
    ``max|a|`` is pushed in front after use. While a history is still all zeros (the first
    step), the current amax is used instead, so the first step's gradients are not flushed
    to zero by a scale of 1.

The histories are updated the way Flax's fp8 ops and Haliax do it: they are inputs of the
loss, and the custom VJPs here return the *new* history as their "gradient". The train step
takes that gradient as the next state instead of applying it (``hypertron.train.step``), and
combines micro-batches by an element-wise maximum (every micro-batch pushes onto the same
history, so the maximum keeps the largest new amax).

Why by hand: ``flax.linen.fp8_ops`` (Flax 0.12.8) has delayed scaling only, imports
``jax._src`` internals and a custom dtype to max-accumulate its histories, and comes with
Flax; qwix 0.1.8 (``qwix.dot_general_qt``) quantises with per-call absmax (current scaling
only, no amax history) and needs Flax too. Neither fits models that are plain functions over
pytrees on public JAX APIs. What is here is small: a qdq and two custom VJPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # forward: activations and weights
E5M2 = jnp.float8_e5m2  # backward: gradients


def fmt_max(fmt) -> float:
    return float(jnp.finfo(fmt).max)


@partial(jax.tree_util.register_dataclass, data_fields=["x", "w", "g"], meta_fields=[])
@dataclass(frozen=True, eq=False)
class AmaxHistory:
    """Delayed-scaling state of one weight's einsum: the last ``H`` amaxes of its activation
    operand ``x``, its weight ``w`` and its output gradient ``g``, newest first, float32
    ``[..., H]`` (``[layers, H]`` for a stacked layer weight)."""

    x: jax.Array
    w: jax.Array
    g: jax.Array

    @staticmethod
    def zeros(lead: tuple[int, ...], length: int) -> AmaxHistory:
        z = lambda: jnp.zeros((*lead, length), jnp.float32)
        return AmaxHistory(z(), z(), z())


def scale_for(amax: jax.Array, history: jax.Array | None, fmt) -> jax.Array:
    """The per-tensor scale (float32 scalar): from ``history`` (its max) when given and not all
    zero, else from ``amax``; 1 for an all-zero tensor."""
    used = amax if history is None else jnp.where(jnp.max(history) > 0, jnp.max(history), amax)
    return jnp.where(used > 0, used / fmt_max(fmt), 1.0).astype(jnp.float32)


def push(history: jax.Array, amax: jax.Array) -> jax.Array:
    """``history`` rolled one step back with ``amax`` in front."""
    return jnp.roll(history, 1, axis=-1).at[..., 0].set(amax)


def qdq(a: jax.Array, fmt, scale: jax.Array) -> jax.Array:
    """``a`` rounded to ``fmt`` at ``scale`` and back, in ``a``'s dtype (values past the format's
    range are clipped to it). The scale is rounded to ``a``'s dtype first and that one value
    divides and multiplies, so a bfloat16 scale biases nothing."""
    m = fmt_max(fmt)
    s = scale.astype(a.dtype)
    q = jnp.clip(a.astype(jnp.float32) / s.astype(jnp.float32), -m, m).astype(fmt)
    return q.astype(a.dtype) * s


def _amax(a: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(a)).astype(jnp.float32)


def quantize(a: jax.Array, fmt, scale: jax.Array) -> jax.Array:
    """``a / scale`` clipped to ``fmt``'s range, in ``fmt`` (the division in float32)."""
    m = fmt_max(fmt)
    return jnp.clip(a.astype(jnp.float32) / scale, -m, m).astype(fmt)


def transposes(subscripts: str) -> tuple[str, str]:
    """The subscripts of an einsum ``"A,B->C"``'s two gradients: ``"C,B->A"`` and ``"A,C->B"``.

    Valid when no index repeats within an operand and each operand's every index is in the other
    operand or the output (no index summed over one operand alone), which every einsum of the
    models is; anything else is refused."""
    spec = subscripts.replace(" ", "")
    if "->" not in spec or "." in spec or spec.count(",") != 1:
        raise ValueError(f"fp8 einsum: {subscripts!r} must be two explicit operands and an output (no ...)")
    ins, out = spec.split("->")
    a, b = ins.split(",")
    for op, other in ((a, b), (b, a)):
        if len(set(op)) != len(op) or any(c not in other and c not in out for c in op):
            raise ValueError(f"fp8 einsum: {subscripts!r} has an index that its gradients cannot carry")
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


def _dot(subscripts: str, a: jax.Array, b: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    return (jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32) * scale).astype(dtype)


# The einsum of fp8 operands with its own backward. The histories' "gradients" are their updates
# (this step's amax pushed in front); ``hg`` enters only to scale the backward.
@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_einsum(subscripts: str, dtype, out_dtype, x, w, hx, hw, hg):
    return _fp8_einsum_fwd(subscripts, dtype, out_dtype, x, w, hx, hw, hg)[0]


def _fp8_einsum_fwd(subscripts, dtype, out_dtype, x, w, hx, hw, hg):
    ax, aw = _amax(x), _amax(w)
    sx, sw = scale_for(ax, hx, E4M3), scale_for(aw, hw, E4M3)
    qx, qw = quantize(x, E4M3, sx), quantize(w, E4M3, sw)
    new_hx = None if hx is None else push(hx, ax)
    new_hw = None if hw is None else push(hw, aw)
    return _dot(subscripts, qx, qw, sx * sw, out_dtype), (qx, qw, sx, sw, new_hx, new_hw, hg)


def _fp8_einsum_bwd(subscripts, dtype, out_dtype, res, g):
    qx, qw, sx, sw, new_hx, new_hw, hg = res
    ag = _amax(g)
    sg = scale_for(ag, hg, E5M2)
    qg = quantize(g, E5M2, sg)
    to_x, to_w = transposes(subscripts)
    dx = _dot(to_x, qg, qw, sg * sw, dtype)
    dw = _dot(to_w, qx, qg, sx * sg, dtype)
    return dx, dw, new_hx, new_hw, None if hg is None else push(hg, ag)


_fp8_einsum.defvjp(_fp8_einsum_fwd, _fp8_einsum_bwd)


def einsum(subscripts: str, x: jax.Array, w: jax.Array, history: AmaxHistory | None, dtype,
           out_dtype) -> jax.Array:
    """``einsum(subscripts, x, w)`` in fp8 (see the module docstring): operands cast to the
    compute ``dtype``, then e4m3 at their scales; the result in ``out_dtype``; the gradients from
    the e5m2 gradient and the fp8 operands, in the compute dtype. ``history``: delayed scaling
    state, or None for current scaling."""
    h = history or AmaxHistory(None, None, None)
    return _fp8_einsum(subscripts, jnp.dtype(dtype), jnp.dtype(out_dtype), x.astype(dtype), w.astype(dtype),
                       h.x, h.w, h.g)


# ---------------------------------------------------------------------------
# Delayed scaling state in the train state


@partial(jax.tree_util.register_dataclass, data_fields=["w", "history"], meta_fields=[])
@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """A weight on its way into the einsum hook with its delayed-scaling history
    (:func:`attach`); the hook runs its einsum in fp8 with those scales."""

    w: jax.Array
    history: AmaxHistory


def attach(params: dict, histories: dict) -> dict:
    """``params`` with each weight that has a history wrapped as :class:`Fp8Weight`.

    Each history must feed exactly one einsum per forward pass (a stacked layer's slice per
    layer, through the scan's inputs): its "gradient" is its update, and two uses would add
    two updates.
    """
    out = dict(params)
    layers = histories["layers"]
    out["layers"] = {n: Fp8Weight(w, AmaxHistory(**layers[n])) if n in layers else w
                     for n, w in params["layers"].items()}
    for name, h in histories.items():
        if name != "layers":
            out[name] = Fp8Weight(params[name], AmaxHistory(**h))
    return out


def combine(a: dict, b: dict) -> dict:
    """Two micro-batches' updated histories as one: the element-wise maximum."""
    return jax.tree.map(jnp.maximum, a, b)
