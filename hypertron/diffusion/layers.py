"""The convolutional blocks diffusers' VAE and UNet share, in NHWC with HWIO kernels: GroupNorm,
Conv2d, ResnetBlock2D, the spatial self-attention of a mid block, Upsample2D and Downsample2D.

Each block has a ``declare_*`` giving its parameters as :class:`ParamSpec` (``hf`` the diffusers
state-dict name under a prefix, conv kernels in the ``conv`` layout) and a pure function applying
them. Activations are ``x_bhwc``; norms compute in float32.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from hypertron.models.attention import full_attention
from hypertron.models.params import ParamSpec, matmul

Params = dict[str, Any]


# ---------------------------------------------------------------------------
# Declarations


def declare_conv(cin: int, cout: int, k: int, hf: str) -> Params:
    """A torch ``Conv2d(cin, cout, k)`` with bias named ``hf``."""
    return {"w": ParamSpec((k, k, cin, cout), (None, None, "conv_in", "conv_out"), "normal",
                           1.0 / math.sqrt(k * k * cin), hf=f"{hf}.weight", hf_layout="conv"),
            "b": ParamSpec((cout,), ("conv_out",), "zeros", hf=f"{hf}.bias")}


def declare_norm(c: int, hf: str) -> Params:
    """A torch ``GroupNorm`` (affine) over ``c`` channels named ``hf``."""
    return {"scale": ParamSpec((c,), ("norm",), "ones", hf=f"{hf}.weight"),
            "bias": ParamSpec((c,), ("norm",), "zeros", hf=f"{hf}.bias")}


def declare_resnet(cin: int, cout: int, hf: str, temb: int = 0) -> Params:
    """diffusers' ``ResnetBlock2D``: with a ``temb``-wide time embedding projection (the UNet's) or
    without (``temb=0``, the VAE's); a 1x1 shortcut conv where the channel count changes."""
    p = {"norm1": declare_norm(cin, f"{hf}.norm1"), "conv1": declare_conv(cin, cout, 3, f"{hf}.conv1"),
         "norm2": declare_norm(cout, f"{hf}.norm2"), "conv2": declare_conv(cout, cout, 3, f"{hf}.conv2")}
    if temb:
        p["time_w"] = matmul((temb, cout), (None, "conv_out"), temb, "be,ec->bc", hf=f"{hf}.time_emb_proj.weight")
        p["time_b"] = ParamSpec((cout,), ("conv_out",), "zeros", hf=f"{hf}.time_emb_proj.bias")
    if cin != cout:
        p["shortcut"] = declare_conv(cin, cout, 1, f"{hf}.conv_shortcut")
    return p


def declare_attention(c: int, heads: int, hf: str) -> Params:
    """diffusers' ``Attention`` over a feature map with its own GroupNorm (a VAE mid block's)."""
    h = c // heads
    proj = lambda name: matmul((c, heads, h), ("embed", "heads", "head_dim"), c,  # noqa: E731
                               "bsc,cnh->bsnh", hf=f"{hf}.{name}.weight", hf_layout="heads_in")
    bias = lambda name, n: ParamSpec((n,), ("norm",), "zeros", hf=f"{hf}.{name}.bias")  # noqa: E731
    return {"norm": declare_norm(c, f"{hf}.group_norm"),
            "wq": proj("to_q"), "bq": bias("to_q", c), "wk": proj("to_k"), "bk": bias("to_k", c),
            "wv": proj("to_v"), "bv": bias("to_v", c),
            "wo": matmul((heads, h, c), ("heads", "head_dim", "embed"), c, "bsnh,nhc->bsc",
                         hf=f"{hf}.to_out.0.weight", hf_layout="heads_out"),
            "bo": bias("to_out.0", c)}


# ---------------------------------------------------------------------------
# Blocks


def group_norm(x_bhwc: jax.Array, p: Params, groups: int, eps: float) -> jax.Array:
    b, hh, ww, c = x_bhwc.shape
    x = x_bhwc.astype(jnp.float32).reshape(b, hh, ww, groups, c // groups)
    mean = x.mean(axis=(1, 2, 4), keepdims=True)
    var = jnp.square(x - mean).mean(axis=(1, 2, 4), keepdims=True)
    y = ((x - mean) * lax.rsqrt(var + eps)).reshape(b, hh, ww, c)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x_bhwc.dtype)


def conv2d(x_bhwc: jax.Array, p: Params, *, stride: int = 1, padding: Any = "SAME") -> jax.Array:
    """``padding`` "SAME" is torch's ``padding=k//2`` for the odd kernels used here; or explicit
    ``((top, bottom), (left, right))``."""
    y = lax.conv_general_dilated(x_bhwc, p["w"].astype(x_bhwc.dtype), (stride, stride), padding,
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + p["b"].astype(y.dtype)


def resnet(x_bhwc: jax.Array, p: Params, groups: int, eps: float, temb_be: jax.Array | None = None,
           einsum=None) -> jax.Array:
    """The block on ``x_bhwc``; with a time embedding ``temb_be`` (blocks declared with ``temb``) its
    projection ``silu(temb) @ w`` is added per channel after the first conv."""
    with jax.named_scope("resnet"):
        h = conv2d(jax.nn.silu(group_norm(x_bhwc, p["norm1"], groups, eps)), p["conv1"])
        if "time_w" in p:
            t_bc = einsum("be,ec->bc", jax.nn.silu(temb_be), p["time_w"]) + p["time_b"].astype(h.dtype)
            h = h + t_bc[:, None, None, :].astype(h.dtype)
        h = conv2d(jax.nn.silu(group_norm(h, p["norm2"], groups, eps)), p["conv2"])
        return (conv2d(x_bhwc, p["shortcut"]) if "shortcut" in p else x_bhwc) + h


def attention(x_bhwc: jax.Array, p: Params, groups: int, eps: float, einsum) -> jax.Array:
    """Self-attention over the ``h*w`` positions, with the residual."""
    with jax.named_scope("attention"):
        b, hh, ww, c = x_bhwc.shape
        h_bsc = group_norm(x_bhwc, p["norm"], groups, eps).reshape(b, hh * ww, c)
        nh = p["wq"].shape[1:]

        def proj(w: str, bias: str) -> jax.Array:
            return einsum("bsc,cnh->bsnh", h_bsc, p[w]) + p[bias].reshape(nh).astype(h_bsc.dtype)

        q_bsnh, k_bsnh, v_bsnh = proj("wq", "bq"), proj("wk", "bk"), proj("wv", "bv")
        o_bsnh = full_attention(q_bsnh, k_bsnh, v_bsnh)
        o_bsc = einsum("bsnh,nhc->bsc", o_bsnh, p["wo"]) + p["bo"].astype(h_bsc.dtype)
        return x_bhwc + o_bsc.reshape(b, hh, ww, c)


def downsample(x_bhwc: jax.Array, p: Params, padding: int = 0) -> jax.Array:
    """diffusers' ``Downsample2D``, a 3x3 conv of stride 2: ``padding=0`` (the VAE's) pads one row
    and column at the end, ``padding=1`` (the UNet's) one on each side."""
    pad = ((0, 1), (0, 1)) if padding == 0 else ((padding, padding), (padding, padding))
    return conv2d(x_bhwc, p, stride=2, padding=pad)


def upsample(x_bhwc: jax.Array, p: Params) -> jax.Array:
    """diffusers' ``Upsample2D``: nearest 2x, then a 3x3 conv."""
    x = jnp.repeat(jnp.repeat(x_bhwc, 2, axis=1), 2, axis=2)
    return conv2d(x, p)


# ---------------------------------------------------------------------------
# Embeddings


def timestep_embedding(t_b: jax.Array, dim: int, *, flip_sin_to_cos: bool, freq_shift: float,
                       max_period: float = 10000.0) -> jax.Array:
    """diffusers' sinusoidal ``Timesteps`` projection [b, dim] (float32) of (fractional) timesteps [b]
    (the UNet's and Flux's): frequencies ``exp(-ln(max_period) * i / (dim/2 - freq_shift))``,
    ``[sin, cos]`` of ``t * freq``, or ``[cos, sin]`` with ``flip_sin_to_cos``; an odd ``dim`` gets
    a zero column at the end."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift))
    angles_bf = t_b.astype(jnp.float32)[:, None] * freqs[None, :]
    parts = [jnp.cos(angles_bf), jnp.sin(angles_bf)] if flip_sin_to_cos else [jnp.sin(angles_bf), jnp.cos(angles_bf)]
    return jnp.pad(jnp.concatenate(parts, axis=-1), ((0, 0), (0, dim % 2)))
