"""diffusers' ``UNet2DConditionModel`` in JAX (SD 1.x, SD 2.x, SDXL), from a diffusers ``unet/``
folder (``config.json`` and ``diffusion_pytorch_model.safetensors``).

The noise prediction of latents ``x_bhwc`` at ``timesteps_b`` given text ``context_bsd``: a
sinusoidal time embedding through ``TimestepEmbedding`` (plus SDXL's ``text_time`` embedding of the
pooled text and the size/crop ids), ``conv_in``, down blocks (resnets with the time embedding, a
:mod:`~hypertron.diffusion.transformer2d` after each resnet of a cross-attention block, a stride-2
downsampler), the mid block, up blocks taking the down path's outputs as skip connections
(concatenated on channels), ``conv_norm_out`` and ``conv_out``. Arrays are NHWC; conv kernels HWIO.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config.numbers import shown
from hypertron.diffusion import layers as L
from hypertron.diffusion.errors import DiffusionError
from hypertron.diffusion.hfconfig import booleans, check_class, finite_number, positive_int, positive_ints, read_keys
from hypertron.diffusion.transformer2d import declare_transformer, transformer
from hypertron.diffusion.weights import load_model
from hypertron.models.params import ParamSpec, matmul
from hypertron.quant import einsum_for

Params = dict[str, Any]
CROSS_DOWN, CROSS_UP = "CrossAttnDownBlock2D", "CrossAttnUpBlock2D"
DOWN_BLOCKS = (CROSS_DOWN, "DownBlock2D")
UP_BLOCKS = (CROSS_UP, "UpBlock2D")
MID_BLOCKS = ("UNetMidBlock2DCrossAttn",)


@dataclass(frozen=True, kw_only=True)
class UNetConfig:
    """The UNet's shape; per-block tuples are in down-block order (the up blocks take them reversed,
    as diffusers does). ``attention_heads`` is diffusers' ``num_attention_heads or
    attention_head_dim``: SD 2.x's ``attention_head_dim`` list counts heads, not their width."""

    in_channels: int = 4
    out_channels: int = 4
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    down_block_types: tuple[str, ...] = (CROSS_DOWN, CROSS_DOWN, CROSS_DOWN, "DownBlock2D")
    up_block_types: tuple[str, ...] = ("UpBlock2D", CROSS_UP, CROSS_UP, CROSS_UP)
    layers_per_block: tuple[int, ...] = (2, 2, 2, 2)
    transformer_layers_per_block: tuple[int, ...] = (1, 1, 1, 1)
    attention_heads: tuple[int, ...] = (8, 8, 8, 8)
    cross_attention_dim: tuple[int, ...] = (768, 768, 768, 768)
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    flip_sin_to_cos: bool = True
    freq_shift: float = 0.0
    downsample_padding: int = 1
    use_linear_projection: bool = False
    upcast_attention: bool = False
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3
    addition_embed_type: str | None = None  # None, or SDXL's "text_time"
    addition_time_embed_dim: int = 0
    projection_class_embeddings_input_dim: int = 0

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.block_out_channels[0]

    @property
    def size_multiple(self) -> int:
        """Latent height and width must be multiples of this (one halving per down block but the last)."""
        return 2 ** (len(self.block_out_channels) - 1)


# ---------------------------------------------------------------------------
# config.json

# Keys whose only supported value is diffusers' default (what SD 1.x/2.x and SDXL use).
_FIXED = {"act_fn": "silu", "center_input_sample": False, "only_cross_attention": False,
          "dual_cross_attention": False, "class_embed_type": None, "num_class_embeds": None,
          "encoder_hid_dim": None, "encoder_hid_dim_type": None, "time_embedding_type": "positional",
          "time_embedding_dim": None, "time_embedding_act_fn": None, "timestep_post_act": None,
          "time_cond_proj_dim": None, "resnet_time_scale_shift": "default", "resnet_skip_time_act": False,
          "resnet_out_scale_factor": 1.0, "mid_block_scale_factor": 1, "attention_type": "default",
          "class_embeddings_concat": False, "cross_attention_norm": None, "num_attention_heads": None,
          "reverse_transformer_layers_per_block": None}
_NOT_TRUE = ("mid_block_only_cross_attention",)  # null (follow only_cross_attention) or false


def _per_block(hf: dict, key: str, default: Any, n: int, where: str) -> tuple[int, ...]:
    """A key diffusers takes as one positive integer or a list of one per block."""
    v = hf.get(key, default)
    values = [v] * n if positive_int(v) else v
    if not isinstance(values, list) or len(values) != n or not all(map(positive_int, values)):
        raise DiffusionError(f"{where}: {key}={shown(v)} must be a positive integer or a list of {n} "
                             "(one per block_out_channels)")
    return tuple(values)


def _block_types(hf: dict, key: str, supported: tuple[str, ...], n: int, where: str) -> tuple[str, ...]:
    types = hf.get(key)
    if not isinstance(types, list) or len(types) != n:
        raise DiffusionError(f"{where}: {key}={shown(types)} must list one block per block_out_channels")
    for t in types:
        if t not in supported:
            raise DiffusionError(f"{where}: {key} has {shown(t)}, not supported "
                                 f"(supported: {', '.join(supported)})")
    return tuple(types)


def _check_fixed(hf: dict, where: str) -> None:
    check_class(hf, where, "UNet2DConditionModel", _FIXED)
    for key in _NOT_TRUE:
        if hf.get(key) not in (None, False):
            raise DiffusionError(f"{where}: {key}={shown(hf[key])} is not supported (supported: null, false)")
    mid = hf.get("mid_block_type", MID_BLOCKS[0])
    if mid not in MID_BLOCKS:
        raise DiffusionError(f"{where}: mid_block_type={shown(mid)} is not supported (supported: {MID_BLOCKS[0]})")


def _scalars(hf: dict, where: str) -> dict[str, Any]:
    """The single-valued keys, checked."""
    d = UNetConfig()
    out = positive_ints(hf, where, d, ("in_channels", "out_channels", "norm_num_groups"))
    out |= read_keys(hf, where, d, ("conv_in_kernel", "conv_out_kernel"), lambda v: positive_int(v) and v % 2 == 1,
                     "a positive odd integer")
    out |= booleans(hf, where, d, ("flip_sin_to_cos", "use_linear_projection", "upcast_attention"))
    for key in ("norm_eps", "freq_shift"):
        v = hf.get(key, getattr(d, key))
        if not finite_number(v) or (key == "norm_eps" and v <= 0):
            raise DiffusionError(f"{where}: {key}={shown(v)} must be a finite"
                                 + (" positive" if key == "norm_eps" else "") + " number")
        out[key] = float(v)
    v = out["downsample_padding"] = hf.get("downsample_padding", d.downsample_padding)
    if v not in (0, 1) or isinstance(v, bool):
        raise DiffusionError(f"{where}: downsample_padding={shown(v)} is not supported (supported: 0, 1)")
    return out


def _addition(hf: dict, where: str) -> dict[str, Any]:
    """SDXL's ``addition_embed_type="text_time"`` and its two widths, or nothing."""
    kind = hf.get("addition_embed_type")
    if kind is None:
        return {}
    if kind != "text_time":
        raise DiffusionError(f"{where}: addition_embed_type={shown(kind)} is not supported (supported: "
                             "null, text_time)")
    out = {"addition_embed_type": kind}
    for key in ("addition_time_embed_dim", "projection_class_embeddings_input_dim"):
        v = out[key] = hf.get(key)
        if not positive_int(v):
            raise DiffusionError(f"{where}: {key}={shown(v)} must be a positive integer with "
                                 "addition_embed_type=text_time")
    return out


def unet_config(hf: dict, where: str) -> UNetConfig:
    """The :class:`UNetConfig` of a diffusers ``UNet2DConditionModel`` ``config.json`` (``where``
    names it in errors); an unsupported or malformed value is a one-line :class:`DiffusionError`
    naming the key."""
    _check_fixed(hf, where)
    values = _scalars(hf, where) | _addition(hf, where)
    d = UNetConfig()
    channels = hf.get("block_out_channels", list(d.block_out_channels))
    if not isinstance(channels, list) or not channels or not all(map(positive_int, channels)):
        raise DiffusionError(f"{where}: block_out_channels={shown(channels)} must be a list of positive integers")
    n, groups = len(channels), values["norm_num_groups"]
    bad = [c for c in channels if c % groups]
    if bad:
        raise DiffusionError(f"{where}: block_out_channels={shown(channels)}: {bad[0]} is not divisible "
                             f"by norm_num_groups={groups}")
    per_block = {key: _per_block(hf, key, default, n, where) for key, default in (
        ("layers_per_block", 2), ("transformer_layers_per_block", 1), ("cross_attention_dim", 1280))}
    heads = _per_block(hf, "attention_head_dim", 8, n, where)
    if any(c % h for c, h in zip(channels, heads)):
        raise DiffusionError(f"{where}: attention_head_dim={shown(hf.get('attention_head_dim', 8))} (the number "
                             f"of heads) must divide block_out_channels={shown(channels)}")
    return UNetConfig(block_out_channels=tuple(channels), attention_heads=heads,
                      down_block_types=_block_types(hf, "down_block_types", DOWN_BLOCKS, n, where),
                      up_block_types=_block_types(hf, "up_block_types", UP_BLOCKS, n, where),
                      **per_block, **values)


# ---------------------------------------------------------------------------
# Parameters


def _declare_time_mlp(cin: int, cout: int, hf: str) -> Params:
    """``TimestepEmbedding``: linear, silu, linear."""
    def linear(a: int, b: int, name: str) -> Params:
        return {"w": matmul((a, b), (None, "embed"), a, "be,ef->bf", hf=f"{hf}.{name}.weight"),
                "b": ParamSpec((b,), ("embed",), "zeros", hf=f"{hf}.{name}.bias")}
    return {"linear_1": linear(cin, cout, "linear_1"), "linear_2": linear(cout, cout, "linear_2")}


def _declare_layers(cfg: UNetConfig, hf: str, cins: list[int], cout: int, cross: bool, depth: int,
                    heads: int, context_dim: int) -> Params:
    """A down or up block's resnets (input channels ``cins``) and, with ``cross``, a transformer
    after each."""
    block = {}
    for j, cin in enumerate(cins):
        block[f"resnet{j}"] = L.declare_resnet(cin, cout, f"{hf}.resnets.{j}", cfg.time_embed_dim)
        if cross:
            block[f"attention{j}"] = declare_transformer(cout, heads, depth, context_dim,
                                                         cfg.use_linear_projection, f"{hf}.attentions.{j}")
    return block


def _declare_down(cfg: UNetConfig) -> Params:
    ch, down = cfg.block_out_channels, {}
    for i, c in enumerate(ch):
        n, hf = cfg.layers_per_block[i], f"down_blocks.{i}"
        cins = [ch[max(i - 1, 0)]] + [c] * (n - 1)
        down[str(i)] = _declare_layers(cfg, hf, cins, c, cfg.down_block_types[i] == CROSS_DOWN,
                                       cfg.transformer_layers_per_block[i], cfg.attention_heads[i],
                                       cfg.cross_attention_dim[i])
        if i < len(ch) - 1:
            down[str(i)]["downsample"] = L.declare_conv(c, c, 3, f"{hf}.downsamplers.0.conv")
    return down


def _skip_channels(cfg: UNetConfig) -> list[int]:
    """Channels of the down path's outputs in the order they are pushed (conv_in's first)."""
    ch, out = cfg.block_out_channels, [cfg.block_out_channels[0]]
    for i, c in enumerate(ch):
        out += [c] * cfg.layers_per_block[i] + ([c] if i < len(ch) - 1 else [])
    return out


def _declare_up(cfg: UNetConfig) -> Params:
    rev = lambda t: t[::-1]  # noqa: E731
    ch, skips, up = rev(cfg.block_out_channels), _skip_channels(cfg), {}
    for i, c in enumerate(ch):
        n, hf = rev(cfg.layers_per_block)[i] + 1, f"up_blocks.{i}"
        cins = []
        for j in range(n):
            cins.append((ch[max(i - 1, 0)] if j == 0 else c) + skips.pop())
        up[str(i)] = _declare_layers(cfg, hf, cins, c, cfg.up_block_types[i] == CROSS_UP,
                                     rev(cfg.transformer_layers_per_block)[i], rev(cfg.attention_heads)[i],
                                     rev(cfg.cross_attention_dim)[i])
        if i < len(ch) - 1:
            up[str(i)]["upsample"] = L.declare_conv(c, c, 3, f"{hf}.upsamplers.0.conv")
    return up


def declare_unet(cfg: UNetConfig) -> Params:
    """Every parameter of the UNet, ``hf`` its diffusers state-dict name."""
    ch, temb = cfg.block_out_channels, cfg.time_embed_dim
    c = ch[-1]
    p = {"conv_in": L.declare_conv(cfg.in_channels, ch[0], cfg.conv_in_kernel, "conv_in"),
         "time_embedding": _declare_time_mlp(ch[0], temb, "time_embedding"),
         "down": _declare_down(cfg),
         "mid": {"resnet0": L.declare_resnet(c, c, "mid_block.resnets.0", temb),
                 "attention": declare_transformer(c, cfg.attention_heads[-1], cfg.transformer_layers_per_block[-1],
                                                  cfg.cross_attention_dim[-1], cfg.use_linear_projection,
                                                  "mid_block.attentions.0"),
                 "resnet1": L.declare_resnet(c, c, "mid_block.resnets.1", temb)},
         "up": _declare_up(cfg),
         "norm_out": L.declare_norm(ch[0], "conv_norm_out"),
         "conv_out": L.declare_conv(ch[0], cfg.out_channels, cfg.conv_out_kernel, "conv_out")}
    if cfg.addition_embed_type == "text_time":
        p["add_embedding"] = _declare_time_mlp(cfg.projection_class_embeddings_input_dim, temb, "add_embedding")
    return p


def load_unet(folder: str | Path, dtype: Any = np.float32) -> tuple[UNetConfig, Params]:
    """``(cfg, params)`` of the diffusers UNet folder (:func:`weights.load_model`)."""
    return load_model(folder, unet_config, declare_unet, dtype)


# ---------------------------------------------------------------------------
# Forward


def _time_mlp(x_be: jax.Array, p: Params, einsum) -> jax.Array:
    h = einsum("be,ef->bf", x_be, p["linear_1"]["w"]) + p["linear_1"]["b"].astype(x_be.dtype)
    return einsum("be,ef->bf", jax.nn.silu(h), p["linear_2"]["w"]) + p["linear_2"]["b"].astype(x_be.dtype)


def _embedding(params: Params, cfg: UNetConfig, timesteps_b: jax.Array, added: dict | None, dtype: Any,
               einsum) -> jax.Array:
    """The time embedding every resnet takes, ``[b, 4 * block_out_channels[0]]``; with ``text_time``
    plus the embedding of ``[text_embeds, sinusoids of each time id]``."""
    t = L.timestep_embedding(timesteps_b, cfg.block_out_channels[0], flip_sin_to_cos=cfg.flip_sin_to_cos,
                             freq_shift=cfg.freq_shift)
    emb_be = _time_mlp(t.astype(dtype), params["time_embedding"], einsum)
    if cfg.addition_embed_type == "text_time":
        if not added or "text_embeds" not in added or "time_ids" not in added:
            raise ValueError('addition_embed_type="text_time" needs added={"text_embeds", "time_ids"}')
        ids_bk = jnp.asarray(added["time_ids"])
        b = ids_bk.shape[0]
        ids_emb = L.timestep_embedding(ids_bk.reshape(-1), cfg.addition_time_embed_dim,
                                       flip_sin_to_cos=cfg.flip_sin_to_cos, freq_shift=cfg.freq_shift).reshape(b, -1)
        extra = jnp.concatenate([jnp.asarray(added["text_embeds"]).astype(jnp.float32), ids_emb], axis=-1)
        emb_be = emb_be + _time_mlp(extra.astype(dtype), params["add_embedding"], einsum)
    return emb_be


def _layers(x: jax.Array, block: Params, cfg: UNetConfig, emb_be: jax.Array, context_bsd: jax.Array, einsum,
            skips: list | None = None, pushed: list | None = None) -> jax.Array:
    """A block's resnets (and transformers): each first concatenates a skip from ``skips`` (up
    blocks); each output is appended to ``pushed`` (down blocks)."""
    g, eps = cfg.norm_num_groups, cfg.norm_eps
    j = 0
    while f"resnet{j}" in block:
        if skips is not None:
            x = jnp.concatenate([x, skips.pop()], axis=-1)
        x = L.resnet(x, block[f"resnet{j}"], g, eps, emb_be, einsum)
        if f"attention{j}" in block:
            x = transformer(x, context_bsd, block[f"attention{j}"], groups=g, linear=cfg.use_linear_projection,
                            upcast=cfg.upcast_attention, einsum=einsum)
        if pushed is not None:
            pushed.append(x)
        j += 1
    return x


def apply(params: Params, cfg: UNetConfig, x_bhwc: jax.Array, timesteps_b: jax.Array, context_bsd: jax.Array,
          added: dict | None = None, einsum=None) -> jax.Array:
    """The UNet's output ``[b, h, w, out_channels]`` for latents ``x_bhwc`` ``[b, h, w,
    in_channels]`` (h, w multiples of ``cfg.size_multiple``) at ``timesteps_b`` ``[b]`` given the
    text ``context_bsd`` ``[b, s, cross_attention_dim]``. ``added``: SDXL's ``{"text_embeds": [b, d],
    "time_ids": [b, k]}`` with ``addition_embed_type="text_time"``. ``einsum``: the hook for the
    matmuls (plain, in ``x_bhwc``'s dtype, by default)."""
    dtype = x_bhwc.dtype
    einsum = einsum or einsum_for("none", dtype)
    if x_bhwc.shape[1] % cfg.size_multiple or x_bhwc.shape[2] % cfg.size_multiple:
        raise ValueError(f"latents {x_bhwc.shape[1]}x{x_bhwc.shape[2]}: height and width must be multiples "
                         f"of {cfg.size_multiple}")
    with jax.named_scope("unet"):
        emb_be = _embedding(params, cfg, jnp.broadcast_to(timesteps_b, x_bhwc.shape[:1]), added, dtype, einsum)
        x = L.conv2d(x_bhwc, params["conv_in"])
        skips = [x]
        for i in range(len(cfg.block_out_channels)):
            with jax.named_scope(f"down_{i}"):
                block = params["down"][str(i)]
                x = _layers(x, block, cfg, emb_be, context_bsd, einsum, pushed=skips)
                if "downsample" in block:
                    x = L.downsample(x, block["downsample"], cfg.downsample_padding)
                    skips.append(x)
        with jax.named_scope("mid_block"):
            mid, g, eps = params["mid"], cfg.norm_num_groups, cfg.norm_eps
            x = L.resnet(x, mid["resnet0"], g, eps, emb_be, einsum)
            x = transformer(x, context_bsd, mid["attention"], groups=g, linear=cfg.use_linear_projection,
                            upcast=cfg.upcast_attention, einsum=einsum)
            x = L.resnet(x, mid["resnet1"], g, eps, emb_be, einsum)
        for i in range(len(cfg.block_out_channels)):
            with jax.named_scope(f"up_{i}"):
                block = params["up"][str(i)]
                x = _layers(x, block, cfg, emb_be, context_bsd, einsum, skips=skips)
                if "upsample" in block:
                    x = L.upsample(x, block["upsample"])
        x = jax.nn.silu(L.group_norm(x, params["norm_out"], cfg.norm_num_groups, cfg.norm_eps))
        return L.conv2d(x, params["conv_out"])
