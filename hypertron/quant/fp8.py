"""fp8 matmuls for training: e4m3 operands forward, e5m2 gradients backward, per-tensor scales.

An fp8 einsum quantises and at once dequantises ("qdq") each operand and the incoming gradient::

    y  = einsum(qdq(x, e4m3, s_x), qdq(w, e4m3, s_w))                  forward
    g' = qdq(g, e5m2, s_g);  dx, dw = the einsum's own transposes on g'  backward

with ``qdq(a, fmt, s) = fmt(clip(a / s)) * s`` (the cast to ``fmt`` is where the precision goes)
and straight-through gradients through each qdq. Written this way, XLA on Hopper GPUs rewrites
``convert(fp8) * scale -> dot`` into a cuBLAS Lt fp8 matmul with the scales folded in: the
forward matmul always, and both backward ones where the operands' qdq is recomputed in the
backward pass (``model.remat`` full or dots, the default; with ``remat=none`` the scanned
layers keep the dequantised operands as residuals, and the backward matmuls run in the compute
dtype; the same holds for a quantised unembedding, whose float32 gradient meets bf16 operands).
Elsewhere the same program computes in the compute dtype on values rounded to fp8, so CPU runs
reproduce fp8 numerics, not its speed. On a GPU (2026-11-25, one H100, JAX 0.11.2) the rewrite
did not happen: the compiled step held no cuBLAS Lt f8 GEMM and ran at 0.89x the bf16 step
(docs/benchmarks.md). TODO(gpu): read the HLO that T1 now leaves and make XLA take the pattern.

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


# Forward operands: qdq in e4m3; the gradient passes straight through; the history's
# "gradient" is its update.
@partial(jax.custom_vjp, nondiff_argnums=(2,))
def qdq_in(a: jax.Array, history: jax.Array | None, fmt=E4M3) -> jax.Array:
    return qdq(a, fmt, scale_for(_amax(a), history, fmt))


def _qdq_in_fwd(a, history, fmt):
    amax = _amax(a)
    new = None if history is None else push(history, amax)
    return qdq(a, fmt, scale_for(amax, history, fmt)), new


def _qdq_in_bwd(fmt, new_history, g):
    return g, new_history


qdq_in.defvjp(_qdq_in_fwd, _qdq_in_bwd)


# Output: the identity forward; backward, the incoming gradient is qdq'd in e5m2 before the
# einsum's transposes use it.
@partial(jax.custom_vjp, nondiff_argnums=(2,))
def qdq_grad(y: jax.Array, history: jax.Array | None, fmt=E5M2) -> jax.Array:
    return y


def _qdq_grad_fwd(y, history, fmt):
    return y, history


def _qdq_grad_bwd(fmt, history, g):
    amax = _amax(g)
    new = None if history is None else push(history, amax)
    return qdq(g, fmt, scale_for(amax, history, fmt)), new


qdq_grad.defvjp(_qdq_grad_fwd, _qdq_grad_bwd)


def einsum(subscripts: str, x: jax.Array, w: jax.Array, history: AmaxHistory | None, dtype,
           out_dtype) -> jax.Array:
    """``einsum(subscripts, x, w)`` in fp8 (see the module docstring): operands cast to the
    compute ``dtype`` and qdq'd in e4m3, accumulated as the hook's plain einsum is, the result in
    ``out_dtype`` with its gradient qdq'd in e5m2. ``history``: delayed scaling state, or None for current scaling."""
    h = history or AmaxHistory(None, None, None)
    xq = qdq_in(x.astype(dtype), h.x, E4M3)
    wq = qdq_in(w.astype(dtype), h.w, E4M3)
    y = jnp.einsum(subscripts, xq, wq, preferred_element_type=out_dtype)
    return qdq_grad(y, h.g, E5M2)


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
