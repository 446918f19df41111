"""diffusers' ``Transformer2DModel`` as the UNet's cross-attention blocks use it, in NHWC: GroupNorm,
``proj_in`` (a 1x1 conv, or a linear layer with ``use_linear_projection``), ``BasicTransformerBlock``s
(LayerNorm, self-attention, LayerNorm, cross-attention to the text context, LayerNorm, GEGLU
feed-forward, each with its residual), ``proj_out`` and the block's residual.

Matmuls go through the einsum hook; attention is :func:`hypertron.models.attention.full_attention`
(cuDNN's flash attention for self-attention on NVIDIA GPUs, XLA's otherwise), in float32 where
``upcast_attention`` asks for it (SD 2.x). Norms compute in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hypertron.diffusion import layers as L
from hypertron.diffusion.layers import Params
from hypertron.models.attention import full_attention
from hypertron.models.params import ParamSpec, matmul

GROUP_NORM_EPS = 1e-6  # the block's GroupNorm (diffusers fixes it, whatever the UNet's norm_eps)
LAYER_NORM_EPS = 1e-5  # BasicTransformerBlock's LayerNorms
FF_MULT = 4  # GEGLU's inner width per channel


# ---------------------------------------------------------------------------
# Declarations


def _bias(n: int, hf: str) -> ParamSpec:
    return ParamSpec((n,), ("norm",), "zeros", hf=f"{hf}.bias")


def _declare_attention(c: int, c_kv: int, heads: int, hf: str) -> Params:
    """diffusers' ``Attention``: q from ``c`` channels, k and v from ``c_kv`` (the context's for
    cross-attention), no q/k/v bias, an output projection with bias."""
    h = c // heads
    proj = lambda cin, name: matmul((cin, heads, h), ("embed", "heads", "head_dim"), cin,  # noqa: E731
                                    "bsc,cnh->bsnh", hf=f"{hf}.{name}.weight", hf_layout="heads_in")
    return {"wq": proj(c, "to_q"), "wk": proj(c_kv, "to_k"), "wv": proj(c_kv, "to_v"),
            "wo": matmul((heads, h, c), ("heads", "head_dim", "embed"), c, "bsnh,nhc->bsc",
                         hf=f"{hf}.to_out.0.weight", hf_layout="heads_out"),
            "bo": _bias(c, f"{hf}.to_out.0")}


def _declare_geglu(c: int, hf: str) -> Params:
    """``FeedForward`` with GEGLU: ``net.0.proj`` maps to ``[value, gate]`` (each ``4c``; torch's
    ``[8c, c]`` weight read as ``[c, 2, 4c]``), ``net.2`` back to ``c``."""
    f = FF_MULT * c
    return {"w_in": matmul((c, 2, f), ("embed", None, "mlp"), c, "bsc,cgf->bsgf",
                           hf=f"{hf}.net.0.proj.weight", hf_layout="heads_in"),
            "b_in": _bias(2 * f, f"{hf}.net.0.proj"),
            "w_out": matmul((f, c), ("mlp", "embed"), f, "bsf,fc->bsc", hf=f"{hf}.net.2.weight"),
            "b_out": _bias(c, f"{hf}.net.2")}


def _declare_block(c: int, heads: int, context_dim: int, hf: str) -> Params:
    return {"norm1": L.declare_norm(c, f"{hf}.norm1"), "attn1": _declare_attention(c, c, heads, f"{hf}.attn1"),
            "norm2": L.declare_norm(c, f"{hf}.norm2"),
            "attn2": _declare_attention(c, context_dim, heads, f"{hf}.attn2"),
            "norm3": L.declare_norm(c, f"{hf}.norm3"), "ff": _declare_geglu(c, f"{hf}.ff")}


def _declare_projection(c: int, linear: bool, hf: str) -> Params:
    if not linear:
        return L.declare_conv(c, c, 1, hf)
    return {"w": matmul((c, c), ("conv_in", "conv_out"), c, "bsc,cd->bsd", hf=f"{hf}.weight"),
            "b": ParamSpec((c,), ("conv_out",), "zeros", hf=f"{hf}.bias")}


def declare_transformer(c: int, heads: int, depth: int, context_dim: int, linear: bool, hf: str) -> Params:
    """A ``Transformer2DModel`` named ``hf`` over ``c`` channels: ``heads`` heads of ``c // heads``,
    ``depth`` transformer blocks attending to a ``context_dim``-wide context; ``linear`` projections
    (``use_linear_projection``) or 1x1 convs."""
    return {"norm": L.declare_norm(c, f"{hf}.norm"), "proj_in": _declare_projection(c, linear, f"{hf}.proj_in"),
            "blocks": {str(k): _declare_block(c, heads, context_dim, f"{hf}.transformer_blocks.{k}")
                       for k in range(depth)},
            "proj_out": _declare_projection(c, linear, f"{hf}.proj_out")}


# ---------------------------------------------------------------------------
# Forward


def layer_norm(x: jax.Array, p: Params, eps: float = LAYER_NORM_EPS) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * lax.rsqrt(var + eps) * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)
    return y.astype(x.dtype)


def _attention(x_bsc: jax.Array, kv_btd: jax.Array, p: Params, upcast: bool, einsum) -> jax.Array:
    """Multi-head attention of ``x_bsc``'s positions over ``kv_btd`` (itself, or the text context)."""
    q_bsnh = einsum("bsc,cnh->bsnh", x_bsc, p["wq"])
    k_btnh = einsum("bsc,cnh->bsnh", kv_btd, p["wk"])
    v_btnh = einsum("bsc,cnh->bsnh", kv_btd, p["wv"])
    if upcast:
        q_bsnh, k_btnh, v_btnh = (a.astype(jnp.float32) for a in (q_bsnh, k_btnh, v_btnh))
    o_bsnh = full_attention(q_bsnh, k_btnh, v_btnh).astype(x_bsc.dtype)
    return einsum("bsnh,nhc->bsc", o_bsnh, p["wo"]) + p["bo"].astype(x_bsc.dtype)


def _geglu(x_bsc: jax.Array, p: Params, einsum) -> jax.Array:
    vg_bsgf = einsum("bsc,cgf->bsgf", x_bsc, p["w_in"]) + p["b_in"].reshape(2, -1).astype(x_bsc.dtype)
    h_bsf = vg_bsgf[:, :, 0] * jax.nn.gelu(vg_bsgf[:, :, 1], approximate=False)
    return einsum("bsf,fc->bsc", h_bsf, p["w_out"]) + p["b_out"].astype(x_bsc.dtype)


def _block(x_bsc: jax.Array, context_btd: jax.Array, p: Params, upcast: bool, einsum) -> jax.Array:
    with jax.named_scope("transformer_block"):
        h = layer_norm(x_bsc, p["norm1"])
        x_bsc = x_bsc + _attention(h, h, p["attn1"], upcast, einsum)
        x_bsc = x_bsc + _attention(layer_norm(x_bsc, p["norm2"]), context_btd, p["attn2"], upcast, einsum)
        return x_bsc + _geglu(layer_norm(x_bsc, p["norm3"]), p["ff"], einsum)


def transformer(x_bhwc: jax.Array, context_btd: jax.Array, p: Params, *, groups: int, linear: bool,
                upcast: bool, einsum) -> jax.Array:
    """The block on ``x_bhwc`` ``[b, h, w, c]`` attending to ``context_btd`` ``[b, t, d]``; same shape
    out, with the residual. ``linear``: as declared (``use_linear_projection``)."""
    with jax.named_scope("transformer2d"):
        b, hh, ww, c = x_bhwc.shape
        h = L.group_norm(x_bhwc, p["norm"], groups, GROUP_NORM_EPS)
        if linear:
            h_bsc = einsum("bsc,cd->bsd", h.reshape(b, hh * ww, c), p["proj_in"]["w"])
            h_bsc = h_bsc + p["proj_in"]["b"].astype(h.dtype)
        else:
            h_bsc = L.conv2d(h, p["proj_in"]).reshape(b, hh * ww, c)
        context_btd = context_btd.astype(h_bsc.dtype)
        for k in range(len(p["blocks"])):
            h_bsc = _block(h_bsc, context_btd, p["blocks"][str(k)], upcast, einsum)
        if linear:
            out_bsc = einsum("bsc,cd->bsd", h_bsc, p["proj_out"]["w"]) + p["proj_out"]["b"].astype(h.dtype)
            out_bhwc = out_bsc.reshape(b, hh, ww, c)
        else:
            out_bhwc = L.conv2d(h_bsc.reshape(b, hh, ww, c), p["proj_out"])
        return x_bhwc + out_bhwc
