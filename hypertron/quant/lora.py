"""LoRA in the einsum hook: a weight that arrives as :class:`LoraWeight` computes
``base(x) + scale * (x A) B``, whatever form its base has (float, an int8
:class:`~hypertron.quant.int8.QArray`, an :class:`~hypertron.quant.fp8.Fp8Weight`): the base goes
through the hook as it would alone, the low-rank path in the compute dtype.

``A`` and ``B`` are laid out in the letters of the weight's einsum: for ``"btd,dnh->btnh"`` (a
weight ``[d, n, h]``), ``A`` is ``[d, r]`` and ``B`` ``[r, n, h]``; a weight's letters are its
input (contracted) letters, then its output letters. The adapters are declared, loaded and saved
by :mod:`hypertron.models.lora`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp


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
