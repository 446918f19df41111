"""The gated MLP (SwiGLU or GeGLU): its declaration and its computation, shared by the dense decoder
and the MoE block's shared experts."""

from __future__ import annotations

from typing import Any

import jax

from hypertron.config import ModelConfig
from hypertron.models.params import matmul
from hypertron.parallel.rules import constrain


def declare_mlp(d: int, f: int, hf_prefix: str | None) -> dict[str, Any]:
    """A gated MLP's weights (:func:`mlp`): ``d -> f -> d``; in HF checkpoints ``{hf_prefix}gate_proj.weight``
    and so on (None: no HF counterpart)."""
    name = lambda part: None if hf_prefix is None else f"{hf_prefix}{part}_proj.weight"  # noqa: E731
    return {
        "w_gate": matmul((d, f), ("embed", "mlp"), d, "btd,df->btf", hf=name("gate")),
        "w_up": matmul((d, f), ("embed", "mlp"), d, "btd,df->btf", hf=name("up")),
        "w_down": matmul((f, d), ("mlp", "embed"), f, "btf,fd->btd", hf=name("down")),
    }


def activation(x: jax.Array, cfg: ModelConfig) -> jax.Array:
    if cfg.activation == "gelu":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def mlp(x_btd: jax.Array, p: dict[str, Any], cfg: ModelConfig, einsum) -> jax.Array:
    """Gated MLP: SwiGLU (silu) or GeGLU (gelu)."""
    gate_btf = einsum("btd,df->btf", x_btd, p["w_gate"])
    up_btf = einsum("btd,df->btf", x_btd, p["w_up"])
    h_btf = constrain(activation(gate_btf, cfg) * up_btf, ("batch", "seq", "act_mlp"))
    return einsum("btf,fd->btd", h_btf, p["w_down"])
