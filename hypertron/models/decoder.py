"""The decoder shared by every dense family (Llama 2/3, Mistral, Gemma).

Reads top to bottom like the paper: ``forward -> layer -> attention / mlp``.
Families differ only through :class:`~hypertron.config.ModelConfig` fields
(GQA ratio, RoPE scaling, sliding window, GeGLU, tied and scaled embeddings,
zero-centred RMSNorm). Layers are stacked along a leading ``layers`` axis and
run with ``jax.lax.scan``, so compile time does not grow with depth.

Naming: ``b`` batch, ``t`` query positions, ``s`` key positions, ``d`` embed,
``n`` query heads, ``k`` KV heads, ``g`` queries per KV head, ``h`` head dim,
``f`` MLP hidden, ``v`` vocabulary, ``l`` layers.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from hypertron.config import ModelConfig, dtype_on
from hypertron.models.attention import attention_impl, attention_mask, plain_attention, self_attention  # noqa: F401
from hypertron.models.kv_cache import KVCache
from hypertron.models.mlp import activation, declare_mlp, mlp
from hypertron.models.moe import declare_moe, moe_mlp
from hypertron.models.params import ParamSpec, matmul, stack
from hypertron.models.pipeline import run_stages, stage_axes
from hypertron.parallel.rules import constrain
from hypertron.quant import einsum_for, take_rows
from hypertron.quant.lora import ADAPTED

Params = dict[str, Any]


# ---------------------------------------------------------------------------
# Declarations


LAYER_HF = "model.layers.{layer}."  # a layer's tensors in Hugging Face checkpoints


def declare(cfg: ModelConfig) -> Params:
    """The parameter tree of ``cfg`` as :class:`ParamSpec` leaves (no arrays): each parameter's
    shape, axes and init, the einsum it feeds (as :func:`layer` and :func:`mlp` call it), and its
    Hugging Face name and layout."""
    d, n, k, h, f, v, L = (
        cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim,
        cfg.vocab_size, cfg.num_layers,
    )
    norm_init = "zeros" if cfg.norm_zero_centered else "ones"
    norm = lambda hf: ParamSpec((d,), ("norm",), norm_init, hf=hf)  # noqa: E731
    layer = {
        "attn_norm": norm(LAYER_HF + "input_layernorm.weight"),
        "wq": matmul((d, n, h), ("embed", "heads", "head_dim"), d, "btd,dnh->btnh",
                     hf=LAYER_HF + "self_attn.q_proj.weight", hf_layout="heads_in"),
        "wk": matmul((d, k, h), ("embed", "kv_heads", "head_dim"), d, "btd,dkh->btkh",
                     hf=LAYER_HF + "self_attn.k_proj.weight", hf_layout="heads_in"),
        "wv": matmul((d, k, h), ("embed", "kv_heads", "head_dim"), d, "btd,dkh->btkh",
                     hf=LAYER_HF + "self_attn.v_proj.weight", hf_layout="heads_in"),
        "wo": matmul((n, h, d), ("heads", "head_dim", "embed"), n * h, "btnh,nhd->btd",
                     hf=LAYER_HF + "self_attn.o_proj.weight", hf_layout="heads_out"),
        "mlp_norm": norm(LAYER_HF + "post_attention_layernorm.weight"),
    }
    if cfg.moe is None:
        layer |= declare_mlp(d, f, LAYER_HF + "mlp.")
    else:
        layer |= declare_moe(cfg)
    # Tied embeddings double as the output projection: keep their logits O(1). The table's einsum
    # is that of the tied unembedding (per-row int8 scales, which also serve the gather).
    embed_std = 1.0 / math.sqrt(d) if cfg.tie_embeddings else 1.0
    params: Params = {
        "embed": ParamSpec((v, d), ("vocab", "embed"), "normal", embed_std, einsum="btd,vd->btv", quantize=True,
                           fp8_history=cfg.tie_embeddings and cfg.quantize_unembed,
                           hf="model.embed_tokens.weight"),
        "layers": {name: stack(s, L) for name, s in layer.items()},
        "final_norm": norm("model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        params["unembed"] = matmul((d, v), ("embed", "vocab"), d, "btd,dv->btv", hf="lm_head.weight",
                                   fp8_history=cfg.quantize_unembed)
    return params


def resolve_dtype(name: str) -> jnp.dtype:
    """A dtype setting on the default backend (:func:`hypertron.config.dtype_on`)."""
    return jnp.dtype(dtype_on(name, jax.default_backend() != "cpu"))


# ---------------------------------------------------------------------------
# Building blocks


def rms_norm(x_btd: jax.Array, w_d: jax.Array, cfg: ModelConfig) -> jax.Array:
    """RMSNorm in float32; Gemma's variant scales by ``1 + w``."""
    x = x_btd.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + cfg.norm_eps)
    w = w_d.astype(jnp.float32)
    scale = 1.0 + w if cfg.norm_zero_centered else w
    return (x * scale).astype(x_btd.dtype)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies [h/2], with Llama 3.1 scaling when configured."""
    h = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, half-split ("rotate_half") layout as in Hugging Face checkpoints."""
    angles_bth = positions_bt[..., None].astype(jnp.float32) * inv_freq  # [b, t, h/2]
    cos = jnp.cos(angles_bth)[:, :, None, :]  # [b, t, 1, h/2]
    sin = jnp.sin(angles_bth)[:, :, None, :]
    x = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)


# ---------------------------------------------------------------------------
# The layer and the model


def layer(x_btd, p: Params, ctx: dict, cfg: ModelConfig, einsum, cache: KVCache | None):
    """One decoder block. Without a cache, attention is over ``x`` itself (training); with one
    (:mod:`hypertron.models.kv_cache`), the cache takes the new keys and values and attends."""
    with jax.named_scope("attention"):
        h_btd = rms_norm(x_btd, p["attn_norm"], cfg)
        q = einsum("btd,dnh->btnh", h_btd, p["wq"])
        k = einsum("btd,dkh->btkh", h_btd, p["wk"])
        v = einsum("btd,dkh->btkh", h_btd, p["wv"])
        q = constrain(apply_rope(q, ctx["positions"], ctx["inv_freq"]), ("batch", "seq", "act_heads", "head_dim"))
        k = constrain(apply_rope(k, ctx["positions"], ctx["inv_freq"]), ("batch", "seq", "act_kv_heads", "head_dim"))
        if cache is None:
            attn = self_attention(q, k, v, ctx["positions"], ctx["segment_ids"], cfg)
        else:
            attn, cache = cache.attend(ctx["layer"], q, k, v, ctx["positions"], ctx["segment_ids"], cfg)
        x_btd = x_btd + einsum("btnh,nhd->btd", attn, p["wo"])
    stats = {}
    with jax.named_scope("mlp"):
        h_btd = rms_norm(x_btd, p["mlp_norm"], cfg)
        if cfg.moe is None:
            x_btd = x_btd + mlp(h_btd, p, cfg, einsum)
        else:
            mask = None if ctx["segment_ids"] is None else ctx["segment_ids"] > 0
            y_btd, stats = moe_mlp(h_btd, p, cfg, einsum, activation, mask, dropless=cache is not None)
            x_btd = x_btd + y_btd
    return constrain(x_btd, ("batch", "seq", "act_embed")), cache, stats


def _dots_batched_by_stages(prim, *_, **params) -> bool:
    """``checkpoint_dots_with_no_batch_dims`` for a body the pipeline maps over its stages: its
    projections' dots gain the stage as a batch dimension (weights and activations are both the
    stage's), so they are those with at most that one; attention's keep theirs (rows, heads)."""
    if prim is not jax.lax.dot_general_p:
        return False
    _, (lhs_batch, rhs_batch) = params["dimension_numbers"]
    return len(lhs_batch) <= 1 and len(rhs_batch) <= 1


_NAMED = jax.checkpoint_policies.save_only_these_names(ADAPTED)
_REMAT_POLICIES = {
    "full": None,
    # the matmuls' outputs, an adapted projection's among them (its sum, named by the einsum hook)
    "dots": jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
                                                            _NAMED),
    "dots_staged": jax.checkpoint_policies.save_from_both_policies(_dots_batched_by_stages, _NAMED),
}


def _decoder(params: Params, tokens_bt, cfg: ModelConfig, positions_bt, segment_ids_bt, cache: KVCache | None,
             logits_at=None):
    dtype = resolve_dtype(cfg.dtype)
    einsum = einsum_for(cfg.quantization, dtype)
    b, t = tokens_bt.shape
    if positions_bt is None:
        positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ctx = {"positions": positions_bt, "segment_ids": segment_ids_bt, "inv_freq": rope_frequencies(cfg)}

    with jax.named_scope("embed"):
        # Gather from a replicated table: a gather from an fsdp/tensor-sharded table
        # makes the partitioner replicate its output anyway, less efficiently.
        x_btd = take_rows(params["embed"], tokens_bt, dtype, partial(constrain, axes=(None, None)))
        if cfg.embed_scale:
            x_btd = x_btd * jnp.asarray(math.sqrt(cfg.embed_dim), dtype)
        x_btd = constrain(x_btd, ("batch", "seq", "act_embed"))

    # The cache rides in the carry with the activations, so each layer's writes update it in
    # place (as scan input and output XLA would copy all of it every call).
    def body(carry, layer_in, ctx):
        x, c = carry
        p, i = layer_in
        x, c, stats = layer(x, p, ctx | {"layer": i}, cfg, einsum, c)
        return (x, c), stats

    staged = cache is None and cfg.moe is None and stage_axes()  # the layers split into pipeline stages
    if cfg.remat != "none" and cache is None:
        policy = _REMAT_POLICIES["dots_staged" if staged and cfg.remat == "dots" else cfg.remat]
        body = jax.checkpoint(body, policy=policy, prevent_cse=not cfg.scan_layers)

    layers = params["layers"]
    if staged:
        x_btd, stats = run_stages(body, x_btd, layers, ctx, cfg.num_layers), {}
    elif cfg.scan_layers and not isinstance(layers, (list, tuple)):
        (x_btd, cache), stats = jax.lax.scan(lambda carry, li: body(carry, li, ctx), (x_btd, cache),
                                             (layers, jnp.arange(cfg.num_layers)))
    else:  # unrolled: per-layer weights as given (unstack_layers), else sliced from the stack here
        outs = []
        for i, p in enumerate(unstack_layers(params)["layers"]):
            (x_btd, cache), out = body((x_btd, cache), (p, i), ctx)
            outs.append(out)
        stats = jax.tree.map(lambda *a: jnp.stack(a), *outs)

    with jax.named_scope("unembed"):
        if logits_at is not None:  # only the positions that are read: a step samples a few of many tokens
            x_btd = jnp.take_along_axis(x_btd, logits_at[..., None], axis=1)
        x_btd = rms_norm(x_btd, params["final_norm"], cfg)
        # Logits leave the matmul in float32: the loss's logsumexp needs the precision.
        if cfg.tie_embeddings:
            logits = einsum("btd,vd->btv", x_btd, params["embed"], jnp.float32, quantize=cfg.quantize_unembed)
        else:
            logits = einsum("btd,dv->btv", x_btd, params["unembed"], jnp.float32, quantize=cfg.quantize_unembed)
        logits = constrain(logits, ("batch", "seq", "act_vocab"))
    return logits, cache, stats


def unstack_layers(params: Params) -> Params:
    """``params`` with the stacked layers as a list of per-layer trees, which :func:`forward` runs
    unrolled. For serving: scanning stacked layers copies each layer's weights out of the stack
    every step (XLA slices them into a new buffer before the matmul), which at decode, where the
    weights are most of what a step reads, costs up to a third more (on CPU: 2.2 against 2.7 to
    2.9 ms for a 1-row decode of the 4-layer bench model, fastest of 60; 1.25 to 2.9x at width
    1,024). On narrow, deep models the scan is the faster (width 256, 22 layers: 0.7x the time),
    and unrolled compiles take about 4x as long at 22 layers (``bench/serve_layers.py``). Training
    keeps the scan: its compile time does not grow with depth."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    leaves = jax.tree.leaves(layers)
    n = leaves[0].shape[0]
    if all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) for a in leaves):
        return {**params, "layers": _unstack(layers, n)}  # one compile, not one per leaf's shape and op
    return {**params, "layers": _slice_layers(layers, n)}


def _slice_layers(layers, n: int) -> list:
    return [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n)]


_unstack = jax.jit(_slice_layers, static_argnums=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Forward:
    """What :func:`forward` returns: ``logits`` [b, t, vocab] (float32; [b, k, vocab] with
    ``logits_at``); ``cache`` as the tokens left it (None without one); ``stats`` the per-layer
    MoE statistics stacked over layers when asked for (``{}`` for a dense model; None when not
    asked): ``load_balance`` and ``router_z`` losses [l], ``load`` (copies per expert) [l, e] and
    ``dropped`` (fraction of copies over capacity) [l]. A pytree, so jitted functions return it."""

    logits: jax.Array
    cache: KVCache | None = None
    stats: dict[str, jax.Array] | None = None


def forward(
    params: Params,
    tokens_bt: jax.Array,
    cfg: ModelConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    cache: KVCache | None = None,
    logits_at: jax.Array | None = None,
    stats: bool = False,
) -> Forward:
    """The model on token ids [b, t]: their logits [b, t, vocab] (float32), the cache they were
    written into (with ``cache``) and the MoE statistics (with ``stats=True``), as one
    :class:`Forward`.

    ``positions`` [b, t] default to 0..t-1; ``segment_ids`` [b, t] keep packed documents from
    attending to each other. With a cache (:mod:`hypertron.models.kv_cache`), the tokens' keys
    and values are written into it at their positions and they attend to what it holds;
    generation's prefill (t = the prompt) and decode (t = 1) both come here. ``logits_at``
    [b, k]: the logits of those token indices only ([b, k, vocab]), the others' never computed.
    """
    logits, new_cache, layer_stats = _decoder(params, tokens_bt, cfg, positions, segment_ids, cache, logits_at)
    return Forward(logits, None if cache is None else new_cache, layer_stats if stats else None)
