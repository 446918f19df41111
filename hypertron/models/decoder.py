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

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from hypertron.config import ModelConfig
from hypertron.models.kv_pages import decode_attention, layer_page_table, pages_per_layer
from hypertron.models.mlp import activation, declare_mlp, mlp
from hypertron.models.moe import declare_moe, moe_mlp
from hypertron.models.params import ParamSpec, matmul, stack
from hypertron.parallel.rules import constrain
from hypertron.quant import einsum_for, take_rows

Params = dict[str, Any]
Cache = dict[str, jax.Array]


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
    """``auto`` is float32 on CPU and bfloat16 on accelerators."""
    if name == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    return jnp.dtype(name)


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


def attention_mask(
    q_pos_bt: jax.Array,
    kv_pos_bs: jax.Array,
    cfg: ModelConfig,
    q_seg_bt: jax.Array | None = None,
    kv_seg_bs: jax.Array | None = None,
    kv_valid_bs: jax.Array | None = None,
) -> jax.Array:
    """Boolean mask [b, 1, t, s]: causal, same document, inside the sliding window."""
    q = q_pos_bt[:, None, :, None]
    kv = kv_pos_bs[:, None, None, :]
    mask = kv <= q
    if cfg.sliding_window is not None:
        mask &= q - kv < cfg.sliding_window
    if q_seg_bt is not None:
        mask &= q_seg_bt[:, None, :, None] == kv_seg_bs[:, None, None, :]
    if kv_valid_bs is not None:
        mask &= kv_valid_bs[:, None, None, :]
    return mask


def plain_attention(q_btnh, k_bskh, v_bskh, mask_b1ts) -> jax.Array:
    """Reference attention in plain XLA ops (float32 softmax); GQA by grouping query heads."""
    b, t, n, h = q_btnh.shape
    kv_heads = k_bskh.shape[2]
    q = q_btnh.reshape(b, t, kv_heads, n // kv_heads, h)  # [b, t, k, g, h]
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k_bskh, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(h)
    mask = mask_b1ts[:, :, None]  # [b, 1, 1, t, s]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh)
    return out.reshape(b, t, n, h)


def _attention_impl(cfg: ModelConfig, dtype, seq_len: int) -> str:
    """``auto``: cuDNN flash attention on NVIDIA GPUs where cuDNN takes the shape, else XLA.

    cuDNN's flash kernel needs bf16/fp16, a head dim that is a multiple of 8 and
    at most 128 (256 on Hopper only, which we cannot tell apart here), and an
    even sequence length; anything else would fail at compile time.
    """
    if cfg.attention != "auto":
        return cfg.attention
    if (
        jax.default_backend() == "gpu"
        and "nvidia" in getattr(jax.local_devices()[0], "device_kind", "").lower()
        and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        and cfg.head_dim % 8 == 0
        and cfg.head_dim <= 128
        and seq_len % 2 == 0
    ):
        return "cudnn"
    return "xla"


def self_attention(q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, cfg: ModelConfig):
    """Causal self-attention over one packed sequence, never across documents.

    ``xla`` and ``cudnn`` go through ``jax.nn.dot_product_attention`` (cuDNN
    flash attention on GPU); ``plain`` is the explicit-mask reference.
    """
    impl = _attention_impl(cfg, q_btnh.dtype, q_btnh.shape[1])
    if impl == "plain":
        mask = attention_mask(positions_bt, positions_bt, cfg, segment_ids_bt, segment_ids_bt)
        return plain_attention(q_btnh, k_btkh, v_btkh, mask)
    mask = None
    if segment_ids_bt is not None:
        mask = segment_ids_bt[:, None, :, None] == segment_ids_bt[:, None, None, :]
    window = None if cfg.sliding_window is None else (cfg.sliding_window - 1, 0)
    return jax.nn.dot_product_attention(
        q_btnh, k_btkh, v_btkh, mask=mask, is_causal=True, local_window_size=window,
        implementation=impl,
    )


# ---------------------------------------------------------------------------
# The layer and the model


def layer(x_btd, p: Params, ctx: dict, cfg: ModelConfig, einsum, cache: Cache | None):
    """One decoder block. With a cache, new K/V are written at ``positions`` and attention
    reads the whole cache (generation); without one, attention is over ``x`` itself."""
    with jax.named_scope("attention"):
        h_btd = rms_norm(x_btd, p["attn_norm"], cfg)
        q = einsum("btd,dnh->btnh", h_btd, p["wq"])
        k = einsum("btd,dkh->btkh", h_btd, p["wk"])
        v = einsum("btd,dkh->btkh", h_btd, p["wv"])
        q = constrain(apply_rope(q, ctx["positions"], ctx["inv_freq"]), ("batch", "seq", "act_heads", "head_dim"))
        k = constrain(apply_rope(k, ctx["positions"], ctx["inv_freq"]), ("batch", "seq", "act_kv_heads", "head_dim"))
        if cache is None:
            attn = self_attention(q, k, v, ctx["positions"], ctx["segment_ids"], cfg)
        elif "k_pages" in cache:  # the serving engine's paged cache, one token per sequence
            attn, cache = decode_attention(q, k, v, cache, ctx, cfg)
        else:
            cache = {
                "k": _write_cache(cache["k"], k, ctx["positions"]),
                "v": _write_cache(cache["v"], v, ctx["positions"]),
            }
            s = cache["k"].shape[1]
            kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (x_btd.shape[0], s))
            mask = attention_mask(ctx["positions"], kv_pos, cfg)
            attn = plain_attention(q, cache["k"].astype(q.dtype), cache["v"].astype(q.dtype), mask)
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


def _write_cache(cache_bskh: jax.Array, new_btkh: jax.Array, positions_bt: jax.Array) -> jax.Array:
    """Write each row's new K or V at its own start position (rows may differ in length)."""
    def one(c_skh, n_tkh, pos_t):
        return jax.lax.dynamic_update_slice(c_skh, n_tkh.astype(c_skh.dtype), (pos_t[0], 0, 0))

    return jax.vmap(one)(cache_bskh, new_btkh, positions_bt)


_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _paged_layers(layers: Params, x_btd, cache: Cache, ctx: dict, cfg: ModelConfig, einsum):
    """The layers over a paged pool (:mod:`hypertron.models.kv_pages`), the cache in the carry."""
    per_layer = pages_per_layer(cache, cfg.num_layers)

    def body(carry, layer_in):
        x, c = carry
        p, i = layer_in
        x, c, stats = layer(x, p, ctx | {"page_table": layer_page_table(ctx["page_table"], i, per_layer)},
                            cfg, einsum, c)
        return (x, c), stats

    if cfg.scan_layers:
        (x_btd, cache), stats = jax.lax.scan(body, (x_btd, cache), (layers, jnp.arange(cfg.num_layers)))
        return x_btd, cache, stats
    outs = []
    for i in range(cfg.num_layers):
        (x_btd, cache), out = body((x_btd, cache), (jax.tree.map(lambda a, i=i: a[i], layers), i))
        outs.append(out)
    return x_btd, cache, jax.tree.map(lambda *a: jnp.stack(a), *outs)


def _decoder(params: Params, tokens_bt, cfg: ModelConfig, positions_bt, segment_ids_bt, cache, paging=None):
    dtype = resolve_dtype(cfg.dtype)
    einsum = einsum_for(cfg.quantization, dtype)
    b, t = tokens_bt.shape
    if positions_bt is None:
        positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ctx = {"positions": positions_bt, "segment_ids": segment_ids_bt, "inv_freq": rope_frequencies(cfg)}
    if paging is not None:
        ctx["page_table"], ctx["lengths"] = paging

    with jax.named_scope("embed"):
        # Gather from a replicated table: a gather from an fsdp/tensor-sharded table
        # makes the partitioner replicate its output anyway, less efficiently.
        x_btd = take_rows(params["embed"], tokens_bt, dtype, partial(constrain, axes=(None, None)))
        if cfg.embed_scale:
            x_btd = x_btd * jnp.asarray(math.sqrt(cfg.embed_dim), dtype)
        x_btd = constrain(x_btd, ("batch", "seq", "act_embed"))

    def body(x, layer_in):
        p, c = layer_in
        x, c, stats = layer(x, p, ctx, cfg, einsum, c)
        return x, (c, stats)

    if cfg.remat != "none" and cache is None:
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)

    if paging is not None:  # the cache is one pool of every layer's pages, updated in place
        x_btd, cache, stats = _paged_layers(params["layers"], x_btd, cache, ctx, cfg, einsum)
    elif cfg.scan_layers:
        x_btd, (cache, stats) = jax.lax.scan(body, x_btd, (params["layers"], cache))
    else:
        outs = []
        for i in range(cfg.num_layers):
            x_btd, out = body(x_btd, jax.tree.map(lambda a, i=i: a[i], (params["layers"], cache)))
            outs.append(out)
        cache, stats = jax.tree.map(lambda *a: jnp.stack(a), *outs)

    with jax.named_scope("unembed"):
        x_btd = rms_norm(x_btd, params["final_norm"], cfg)
        # Logits leave the matmul in float32: the loss's logsumexp needs the precision.
        if cfg.tie_embeddings:
            logits = einsum("btd,vd->btv", x_btd, params["embed"], jnp.float32, quantize=cfg.quantize_unembed)
        else:
            logits = einsum("btd,dv->btv", x_btd, params["unembed"], jnp.float32, quantize=cfg.quantize_unembed)
        logits = constrain(logits, ("batch", "seq", "act_vocab"))
    return logits, cache, stats


def forward(
    params: Params,
    tokens_bt: jax.Array,
    cfg: ModelConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Logits [b, t, vocab] (float32) for token ids [b, t].

    ``positions`` [b, t] default to 0..t-1; ``segment_ids`` [b, t] keep packed
    documents from attending to each other.
    """
    logits, _, _ = _decoder(params, tokens_bt, cfg, positions, segment_ids, None)
    return logits


def forward_with_stats(
    params: Params,
    tokens_bt: jax.Array,
    cfg: ModelConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Like :func:`forward`, plus per-layer MoE statistics stacked over layers (``{}`` for dense
    models): ``load_balance`` and ``router_z`` losses [l], ``load`` (copies per expert) [l, e] and
    ``dropped`` (fraction of copies over capacity) [l]."""
    logits, _, stats = _decoder(params, tokens_bt, cfg, positions, segment_ids, None)
    return logits, stats


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> Cache:
    """Empty KV cache: ``k`` and ``v`` of shape [layers, batch, max_len, kv_heads, head_dim]."""
    dtype = resolve_dtype(cfg.dtype) if dtype is None else dtype
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def forward_cached(
    params: Params, tokens_bt: jax.Array, positions_bt: jax.Array, cache: Cache, cfg: ModelConfig
) -> tuple[jax.Array, Cache]:
    """Logits for new tokens at ``positions_bt``, attending to everything cached before them.

    Writes the new keys and values into ``cache`` and returns it. Used for
    prefill (t = prompt length) and for each decode step (t = 1).
    """
    logits, cache, _ = _decoder(params, tokens_bt, cfg, positions_bt, None, cache)
    return logits, cache


def forward_paged(params: Params, tokens_b: jax.Array, cache: Cache, page_table_bp: jax.Array,
                  lengths_b: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, Cache]:
    """One decode step over a paged cache (:mod:`hypertron.models.kv_pages`): logits ``[b, vocab]``.

    Token ``tokens_b[i]`` sits at position ``lengths_b[i]`` (the tokens already cached); its
    K/V are written there and it attends to the ``lengths_b[i] + 1`` tokens of its pages. Rows
    with ``lengths_b < 0`` are empty slots (nothing read, their write goes to page 0).
    """
    positions = jnp.maximum(lengths_b, 0)[:, None]
    paging = (page_table_bp, jnp.where(lengths_b >= 0, lengths_b + 1, 0))
    logits, cache, _ = _decoder(params, tokens_b[:, None], cfg, positions, None, cache, paging)
    return logits[:, 0], cache
