"""Mixture-of-Experts MLP: a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token.

Two ways to run the experts, one config switch (``model.moe.mode``):

* ``dropless``: the token copies are sorted by expert and multiplied with a
  grouped matmul (:mod:`hypertron.kernels.gmm`), so every routed token is
  computed whatever the skew; the work follows the real expert load.
* ``capped``: each expert takes at most ``capacity = ceil(capacity_factor *
  tokens * top_k / num_experts)`` token copies, in priority order (every
  token's first choice before any second choice, then token order); the rest
  are dropped (the residual stream carries those tokens unchanged) and their
  fraction is reported. The experts run as one dense batched matmul over
  ``[experts, capacity]``: a fixed, predictable cost.

With a capacity large enough for every copy, both give the same output.

Router losses (weights in config): the Switch load-balancing loss
``E * sum_e f_e * P_e`` (``f_e`` the fraction of token copies routed to
expert ``e``, ``P_e`` its mean router probability; 1 when balanced, for any
``top_k``) and the router z-loss ``mean(logsumexp(logits)^2)``, both over
real tokens only and averaged over layers (Switch sums over layers: its
weight 0.01 corresponds to ``0.01 * num_layers`` here). Both are computed per
micro-batch, so with ``grad_accum > 1`` they, and capped capacity, are those
of the micro-batches, as in Megatron.

Naming as in :mod:`hypertron.models.decoder`, plus ``e`` experts, ``c``
capacity slots, ``r`` routed copies (tokens x top_k), ``T`` tokens.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from hypertron.config import ModelConfig
from hypertron.models.params import ParamSpec, fan_in_normal
from hypertron.parallel.rules import constrain


def declare_moe(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """One layer's MoE parameters (the decoder stacks them over layers)."""
    d, f, e = cfg.embed_dim, cfg.mlp_dim, cfg.moe.num_experts
    params = {
        "router": fan_in_normal((d, e), ("embed", None), d),
        "we_gate": fan_in_normal((e, d, f), ("expert", "embed", "mlp"), d),
        "we_up": fan_in_normal((e, d, f), ("expert", "embed", "mlp"), d),
        "we_down": fan_in_normal((e, f, d), ("expert", "mlp", "embed"), f),
    }
    if cfg.moe.shared_experts:
        fs = f * cfg.moe.shared_experts
        params |= {
            "w_gate": fan_in_normal((d, fs), ("embed", "mlp"), d),
            "w_up": fan_in_normal((d, fs), ("embed", "mlp"), d),
            "w_down": fan_in_normal((fs, d), ("mlp", "embed"), fs),
        }
    return params


def route(x_td: jax.Array, router_de: jax.Array, cfg: ModelConfig, mask_t: jax.Array | None = None):
    """``(weights [T, k] float32, experts [T, k] int32, losses)`` for tokens ``x_td``.

    ``mask_t`` (bool [T]) marks real tokens: padding is left out of the load
    statistics and both losses.
    """
    moe = cfg.moe
    m_t = jnp.ones(x_td.shape[0], jnp.float32) if mask_t is None else mask_t.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m_t), 1.0)
    logits_te = jnp.einsum("td,de->te", x_td.astype(jnp.float32), router_de.astype(jnp.float32))
    probs_te = jax.nn.softmax(logits_te, axis=-1)
    if moe.gating == "topk_softmax":  # Mixtral: softmax over the chosen logits
        top_logits, experts_tk = jax.lax.top_k(logits_te, moe.top_k)
        weights_tk = jax.nn.softmax(top_logits, axis=-1)
    else:  # softmax_topk: the chosen experts' probabilities, not renormalised
        weights_tk, experts_tk = jax.lax.top_k(probs_te, moe.top_k)
    copies_tk = jnp.broadcast_to(m_t[:, None], experts_tk.shape)
    counts_e = jnp.zeros(moe.num_experts, jnp.float32).at[experts_tk.reshape(-1)].add(copies_tk.reshape(-1))
    fraction_e = counts_e / (n * moe.top_k)
    mean_probs_e = jnp.sum(probs_te * m_t[:, None], axis=0) / n
    losses = {
        "load_balance": moe.num_experts * jnp.sum(fraction_e * mean_probs_e),
        "router_z": jnp.sum(jnp.square(jax.nn.logsumexp(logits_te, axis=-1)) * m_t) / n,
        "load": counts_e,
    }
    return weights_tk, experts_tk.astype(jnp.int32), losses


def moe_mlp(x_btd: jax.Array, p: dict[str, Any], cfg: ModelConfig, einsum, activation,
            mask_bt: jax.Array | None = None, dropless: bool = False):
    """The MoE block's output [b, t, d] and its statistics (losses, per-expert load, dropped fraction).

    ``mask_bt`` (bool) marks real tokens: padding never takes an expert's
    capacity and is left out of the statistics. ``dropless=True`` overrides
    a capped config (generation: a prompt's output must not depend on what
    else is in the batch).
    """
    b, t, d = x_btd.shape
    x_td = x_btd.reshape(b * t, d)
    mask_t = None if mask_bt is None else mask_bt.reshape(b * t)
    weights_tk, experts_tk, stats = route(x_td, p["router"], cfg, mask_t)
    if dropless or cfg.moe.mode == "dropless":
        y_td = _dropless(x_td, weights_tk, experts_tk, p, cfg, activation)
        stats["dropped"] = jnp.zeros((), jnp.float32)
    else:
        y_td, stats["dropped"] = _capped(x_td, weights_tk, experts_tk, p, cfg, einsum, activation, mask_t)
    y_btd = y_td.reshape(b, t, d).astype(x_btd.dtype)
    if cfg.moe.shared_experts:
        gate = einsum("btd,df->btf", x_btd, p["w_gate"])
        up = einsum("btd,df->btf", x_btd, p["w_up"])
        h = constrain(activation(gate, cfg) * up, ("batch", "seq", "act_mlp"))
        y_btd = y_btd + einsum("btf,fd->btd", h, p["w_down"])
    return y_btd, stats


def _dropless(x_td, weights_tk, experts_tk, p, cfg: ModelConfig, activation):
    """Every routed copy computed: copies sorted by expert, three grouped matmuls, weighted sum back."""
    from hypertron.kernels.gmm import gmm

    T, k = experts_tk.shape
    e = cfg.moe.num_experts
    flat_experts_r = experts_tk.reshape(-1)
    order_r = jnp.argsort(flat_experts_r, stable=True)  # copy r of the sorted list is flat copy order[r]
    tokens_r = order_r // k
    x_rd = jnp.take(x_td, tokens_r, axis=0)
    group_sizes = jnp.bincount(flat_experts_r, length=e).astype(jnp.int32)
    dtype = x_td.dtype
    backend = cfg.moe.gmm_backend

    def grouped(lhs, rhs):
        return gmm(lhs, rhs.astype(dtype), group_sizes, backend=backend)

    h_rf = activation(grouped(x_rd, p["we_gate"]), cfg) * grouped(x_rd, p["we_up"])
    out_rd = grouped(h_rf, p["we_down"])
    # Back to [T, k] order, then the router-weighted sum over each token's k experts.
    unsorted_rd = jnp.zeros_like(out_rd).at[order_r].set(out_rd)
    out_tkd = unsorted_rd.reshape(T, k, -1).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", out_tkd, weights_tk)


def capacity(cfg: ModelConfig, num_tokens: int) -> int:
    moe = cfg.moe
    return max(1, math.ceil(moe.capacity_factor * num_tokens * moe.top_k / moe.num_experts))


def _capped(x_td, weights_tk, experts_tk, p, cfg: ModelConfig, einsum, activation, mask_t=None):
    """At most ``capacity`` copies per expert; returns (output [T, d], fraction of real copies dropped).

    Capacity is computed from the tokens of this call (a micro-batch under grad_accum)."""
    T, k = experts_tk.shape
    e, c = cfg.moe.num_experts, capacity(cfg, T)
    real_t = jnp.ones(T, bool) if mask_t is None else mask_t
    # Priority: every token's 1st choice, then every 2nd choice...; within a choice, token order.
    # Padding copies are routed nowhere (all-zero one-hot), so they take no slot.
    experts_kt = experts_tk.T
    onehot_kte = jax.nn.one_hot(experts_kt, e, dtype=jnp.int32) * real_t[None, :, None]
    position_kt = jnp.sum((jnp.cumsum(onehot_kte.reshape(k * T, e), axis=0).reshape(k, T, e) - 1) * onehot_kte,
                          axis=-1)
    kept_kt = (position_kt < c) & real_t[None, :]
    # Slot e * c + position in the [e * c] buffer; dropped copies go to one extra slot that stays out.
    slot_kt = jnp.where(kept_kt, experts_kt * c + position_kt, e * c)
    tokens_kt = jnp.broadcast_to(jnp.arange(T), (k, T))
    buffer = jnp.zeros((e * c + 1, x_td.shape[1]), x_td.dtype).at[slot_kt.reshape(-1)].set(
        x_td[tokens_kt.reshape(-1)])
    x_ecd = buffer[:-1].reshape(e, c, -1)
    gate = einsum("ecd,edf->ecf", x_ecd, p["we_gate"])
    up = einsum("ecd,edf->ecf", x_ecd, p["we_up"])
    out_ecd = einsum("ecf,efd->ecd", activation(gate, cfg) * up, p["we_down"])
    out_sd = jnp.concatenate([out_ecd.reshape(e * c, -1), jnp.zeros((1, out_ecd.shape[-1]), out_ecd.dtype)])
    out_ktd = out_sd[slot_kt].astype(jnp.float32)
    weights_kt = jnp.where(kept_kt, weights_tk.T, 0.0)
    y_td = jnp.einsum("ktd,kt->td", out_ktd, weights_kt)
    real_copies = jnp.maximum(jnp.sum(real_t.astype(jnp.float32)) * k, 1.0)
    dropped = 1.0 - jnp.sum(kept_kt.astype(jnp.float32)) / real_copies
    return y_td, dropped
