"""LoRA in the einsum hook: a weight that arrives as :class:`LoraWeight` computes
``base(x) + scale * (x A) B``, whatever form its base has (float, an int8
:class:`~hypertron.quant.int8.QArray`, an :class:`~hypertron.quant.fp8.Fp8Weight`): the base goes
through the hook as it would alone, the low-rank path in the compute dtype.

``A`` and ``B`` are laid out in the letters of the weight's einsum: for ``"btd,dnh->btnh"`` (a
weight ``[d, n, h]``), ``A`` is ``[d, r]`` and ``B`` ``[r, n, h]``; a weight's letters are its
input (contracted) letters, then its output letters. The adapters are declared, loaded and saved
by :mod:`hypertron.models.lora`.

Serving many adapters in one batch: a weight arrives as :class:`StackedLoraWeight`, every
adapter's ``A`` and ``B`` side by side (``[N, *in, R]`` and ``[N, R, *out]``, ranks padded to
``R`` with zeros) with their scales, and the step names each token's adapter
(:func:`adapter_tokens`; -1 none). The delta is the one-hot stacked product: ``x`` times every
adapter's ``A`` at once (``N R`` columns), each token's columns but its adapter's zeroed (and the
rest scaled), times every ``B`` stacked (:func:`stacked_delta`), never a per-token gather of
the adapters' weights.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp

ADAPTED = "lora_adapted"
"""The ``checkpoint_name`` of an adapted projection's output (base plus delta), which a remat
policy saves in place of the dot products inside it."""


@partial(jax.tree_util.register_dataclass, data_fields=["base", "a", "b"], meta_fields=["scale"])
@dataclass(frozen=True, eq=False)
class LoraWeight:
    """A weight with its adapter, on its way into the einsum hook (:func:`hypertron.models.lora.attach`)."""

    base: object
    a: jax.Array
    b: jax.Array
    scale: float = field(default=1.0)


def split_letters(subscripts: str) -> tuple[str, str, str, str]:
    """``(x letters, weight input letters, weight output letters, output letters)`` of a hook
    einsum ``"x,w->out"``; a :class:`ValueError` where the weight's letters are not its input
    letters then its output letters (no letter is shared by all three operands)."""
    lhs, out = subscripts.replace(" ", "").split("->")
    x, w = lhs.split(",")
    inputs = "".join(c for c in w if c in x)
    outputs = "".join(c for c in w if c in out and c not in x)
    if w != inputs + outputs:
        raise ValueError(f"einsum {subscripts!r}: LoRA needs a weight of input letters, then output letters")
    return x, inputs, outputs, out


def delta(subscripts: str, x: jax.Array, a: jax.Array, b: jax.Array, dtype, out_dtype) -> jax.Array:
    """``(x A) B`` in the output's letters, computed in ``dtype`` (``r`` must not be a letter of
    ``subscripts``: a rank axis is spelled ``R`` here, which the hook's einsums do not use)."""
    xs, inputs, outputs, out = split_letters(subscripts)
    xa_sub = "".join(c for c in xs if c not in inputs) + "R"
    xa = jnp.einsum(f"{xs},{inputs}R->{xa_sub}", x.astype(dtype), a.astype(dtype), preferred_element_type=dtype)
    return jnp.einsum(f"{xa_sub},R{outputs}->{out}", xa, b.astype(dtype), preferred_element_type=out_dtype)


@partial(jax.tree_util.register_dataclass, data_fields=["base", "a", "b", "scales"], meta_fields=[])
@dataclass(frozen=True, eq=False)
class StackedLoraWeight:
    """A weight with ``N`` adapters stacked (``a [N, *in, R]``, ``b [N, R, *out]``, ``scales
    [N]``: 0 for an empty one), for a step whose tokens each use one or none
    (:func:`adapter_tokens`)."""

    base: object
    a: jax.Array
    b: jax.Array
    scales: jax.Array


_TOKENS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("hypertron_lora_tokens", default=None)


@contextlib.contextmanager
def adapter_tokens(ids: jax.Array) -> Iterator[None]:
    """Within this block (while tracing), a :class:`StackedLoraWeight` adds to each token's product
    its adapter's: ``ids`` int32, the shape of the activations' leading (non-contracted) axes, -1
    for none."""
    token = _TOKENS.set(ids)
    try:
        yield
    finally:
        _TOKENS.reset(token)


def active_adapter_tokens() -> jax.Array | None:
    return _TOKENS.get()


def stacked_delta(subscripts: str, x: jax.Array, w: StackedLoraWeight, ids: jax.Array, dtype,
                  out_dtype) -> jax.Array:
    """Each token's ``scale (x A) B`` of its adapter (0 for ``ids`` -1), for all tokens at once:
    ``x A`` against every adapter (``[..., N, R]``), masked to the token's adapter and scaled, then
    contracted with every ``B``. ``N`` and ``R`` are spelled ``Q`` and ``R``, letters the hook's
    einsums do not use."""
    xs, inputs, outputs, out = split_letters(subscripts)
    rest = "".join(c for c in xs if c not in inputs)
    if ids.ndim != len(rest):
        raise ValueError(f"einsum {subscripts!r}: adapter ids of shape {ids.shape} for activations {rest!r}")
    mask = jax.nn.one_hot(ids, w.scales.shape[0], dtype=jnp.float32) * w.scales.astype(jnp.float32)
    xa = jnp.einsum(f"{xs},Q{inputs}R->{rest}QR", x.astype(dtype), w.a.astype(dtype), preferred_element_type=dtype)
    xa = xa * mask.astype(dtype)[..., None]
    return jnp.einsum(f"{rest}QR,QR{outputs}->{out}", xa, w.b.astype(dtype), preferred_element_type=out_dtype)
