"""diffusers' ``AutoencoderKL`` in JAX: encode images to the latent distribution's mean and log
variance, decode latents to images, from a diffusers ``vae/`` folder (``config.json`` and
``diffusion_pytorch_model.safetensors``).

Arrays are NHWC inside (``images_bhwc`` in [-1, 1], ``z_bhwc`` the VAE's latents); diffusers' NCHW
is converted at the boundary (:func:`from_nchw`, :func:`to_nchw`). The denoiser's latents are the
VAE's scaled and shifted (:func:`vae_to_latents`, :func:`latents_to_vae`), as the diffusers pipelines
do; :func:`to_uint8` is their image processor's conversion to pixels.
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
from hypertron.diffusion.hfconfig import booleans, check_class, finite_number, positive_int, positive_ints
from hypertron.diffusion.weights import load_model
from hypertron.quant import einsum_for

Params = dict[str, Any]
EPS = 1e-6  # diffusers' VAE norms (resnets, mid-block attention, the output norms)


@dataclass(frozen=True, kw_only=True)
class VaeConfig:
    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    latent_channels: int = 4
    norm_num_groups: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float = 0.0
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True


# config.json keys read with their types; values outside these (an act_fn, block type) are refused.
_FIXED = {"act_fn": "silu", "latents_mean": None, "latents_std": None}
_BLOCKS = {"down_block_types": "DownEncoderBlock2D", "up_block_types": "UpDecoderBlock2D"}


def vae_config(hf: dict, where: str) -> VaeConfig:
    """The :class:`VaeConfig` of a diffusers ``AutoencoderKL`` ``config.json`` (``where`` names it in
    errors); an unsupported or malformed value is a one-line :class:`DiffusionError` naming the key."""
    check_class(hf, where, "AutoencoderKL", _FIXED)
    default = VaeConfig()
    values = positive_ints(hf, where, default,
                           ("in_channels", "out_channels", "layers_per_block", "latent_channels", "norm_num_groups"))
    channels = hf.get("block_out_channels", list(default.block_out_channels))
    if not isinstance(channels, list) or not channels or not all(map(positive_int, channels)):
        raise DiffusionError(f"{where}: block_out_channels={shown(channels)} must be a list of positive integers")
    bad = [c for c in channels if c % values["norm_num_groups"]]
    if bad:
        raise DiffusionError(f"{where}: block_out_channels={shown(channels)}: {bad[0]} is not divisible "
                             f"by norm_num_groups={values['norm_num_groups']}")
    for key, block in _BLOCKS.items():
        types = hf.get(key, [block] * len(channels))
        if not isinstance(types, list) or len(types) != len(channels):
            raise DiffusionError(f"{where}: {key}={shown(types)} must list one block per block_out_channels")
        for t in types:
            if t != block:
                raise DiffusionError(f"{where}: {key} has {shown(t)}, not supported (supported: {block})")
    for key in ("scaling_factor", "shift_factor"):
        v = hf.get(key) if hf.get(key) is not None else getattr(default, key)
        if not finite_number(v) or (key == "scaling_factor" and v == 0):
            raise DiffusionError(f"{where}: {key}={shown(v)} must be a finite number"
                                 + (", not 0" if key == "scaling_factor" else ""))
        values[key] = float(v)
    values |= booleans(hf, where, default, ("use_quant_conv", "use_post_quant_conv", "mid_block_add_attention"))
    return VaeConfig(block_out_channels=tuple(channels), **values)


# ---------------------------------------------------------------------------
# Parameters


def _declare_mid(c: int, hf: str, attention: bool) -> Params:
    p = {"resnet0": L.declare_resnet(c, c, f"{hf}.resnets.0"), "resnet1": L.declare_resnet(c, c, f"{hf}.resnets.1")}
    if attention:
        p["attention"] = L.declare_attention(c, 1, f"{hf}.attentions.0")  # head dim = channels: one head
    return p


def declare(cfg: VaeConfig) -> Params:
    """Every parameter of the VAE, ``hf`` its diffusers state-dict name."""
    ch, n, lc = cfg.block_out_channels, cfg.layers_per_block, cfg.latent_channels
    down = {}
    for i, c in enumerate(ch):
        hf = f"encoder.down_blocks.{i}"
        block = {f"resnet{j}": L.declare_resnet(ch[max(i - 1, 0)] if j == 0 else c, c, f"{hf}.resnets.{j}")
                 for j in range(n)}
        if i < len(ch) - 1:
            block["downsample"] = L.declare_conv(c, c, 3, f"{hf}.downsamplers.0.conv")
        down[str(i)] = block
    up, rev = {}, ch[::-1]
    for i, c in enumerate(rev):
        hf = f"decoder.up_blocks.{i}"
        block = {f"resnet{j}": L.declare_resnet(rev[max(i - 1, 0)] if j == 0 else c, c, f"{hf}.resnets.{j}")
                 for j in range(n + 1)}
        if i < len(ch) - 1:
            block["upsample"] = L.declare_conv(c, c, 3, f"{hf}.upsamplers.0.conv")
        up[str(i)] = block
    encoder = {"conv_in": L.declare_conv(cfg.in_channels, ch[0], 3, "encoder.conv_in"), "down": down,
               "mid": _declare_mid(ch[-1], "encoder.mid_block", cfg.mid_block_add_attention),
               "norm_out": L.declare_norm(ch[-1], "encoder.conv_norm_out"),
               "conv_out": L.declare_conv(ch[-1], 2 * lc, 3, "encoder.conv_out")}
    decoder = {"conv_in": L.declare_conv(lc, ch[-1], 3, "decoder.conv_in"),
               "mid": _declare_mid(ch[-1], "decoder.mid_block", cfg.mid_block_add_attention), "up": up,
               "norm_out": L.declare_norm(ch[0], "decoder.conv_norm_out"),
               "conv_out": L.declare_conv(ch[0], cfg.out_channels, 3, "decoder.conv_out")}
    if cfg.use_quant_conv:
        encoder["quant_conv"] = L.declare_conv(2 * lc, 2 * lc, 1, "quant_conv")
    if cfg.use_post_quant_conv:
        decoder["post_quant_conv"] = L.declare_conv(lc, lc, 1, "post_quant_conv")
    return {"encoder": encoder, "decoder": decoder}


def load_vae(folder: str | Path, dtype: Any = np.float32) -> tuple[VaeConfig, Params]:
    """``(cfg, params)`` of the diffusers VAE folder (:func:`weights.load_model`)."""
    return load_model(folder, vae_config, declare, dtype)


# ---------------------------------------------------------------------------
# Forward


def _mid(x_bhwc: jax.Array, p: Params, cfg: VaeConfig, einsum) -> jax.Array:
    with jax.named_scope("mid_block"):
        x_bhwc = L.resnet(x_bhwc, p["resnet0"], cfg.norm_num_groups, EPS)
        if "attention" in p:
            x_bhwc = L.attention(x_bhwc, p["attention"], cfg.norm_num_groups, EPS, einsum)
        return L.resnet(x_bhwc, p["resnet1"], cfg.norm_num_groups, EPS)


def _out(x_bhwc: jax.Array, p: Params, cfg: VaeConfig) -> jax.Array:
    return L.conv2d(jax.nn.silu(L.group_norm(x_bhwc, p["norm_out"], cfg.norm_num_groups, EPS)), p["conv_out"])


def encode(params: Params, cfg: VaeConfig, images_bhwc: jax.Array, *, dtype: Any = jnp.float32,
           quantization: str = "none") -> tuple[jax.Array, jax.Array]:
    """``(mean, logvar)`` of the latent distribution of ``images_bhwc`` (in [-1, 1]), each
    ``[b, h/f, w/f, latent_channels]`` in float32, ``f`` 2 per down block but the last; logvar
    clipped to [-30, 20] as diffusers does."""
    p, g = params["encoder"], cfg.norm_num_groups
    with jax.named_scope("vae_encode"):
        x = L.conv2d(images_bhwc.astype(dtype), p["conv_in"])
        for i in range(len(cfg.block_out_channels)):
            block = p["down"][str(i)]
            for j in range(cfg.layers_per_block):
                x = L.resnet(x, block[f"resnet{j}"], g, EPS)
            if "downsample" in block:
                x = L.downsample(x, block["downsample"])
        x = _out(_mid(x, p["mid"], cfg, einsum_for(quantization, dtype)), p, cfg)
        if "quant_conv" in p:
            x = L.conv2d(x, p["quant_conv"])
        mean, logvar = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)


def decode(params: Params, cfg: VaeConfig, z_bhwc: jax.Array, *, dtype: Any = jnp.float32,
           quantization: str = "none") -> jax.Array:
    """Images ``[b, h*f, w*f, out_channels]`` (float32, about [-1, 1]) of the VAE latents ``z_bhwc``
    (unscaled: see :func:`latents_to_vae`)."""
    p, g = params["decoder"], cfg.norm_num_groups
    with jax.named_scope("vae_decode"):
        x = z_bhwc.astype(dtype)
        if "post_quant_conv" in p:
            x = L.conv2d(x, p["post_quant_conv"])
        x = _mid(L.conv2d(x, p["conv_in"]), p["mid"], cfg, einsum_for(quantization, dtype))
        for i in range(len(cfg.block_out_channels)):
            block = p["up"][str(i)]
            for j in range(cfg.layers_per_block + 1):
                x = L.resnet(x, block[f"resnet{j}"], g, EPS)
            if "upsample" in block:
                x = L.upsample(x, block["upsample"])
        return _out(x, p, cfg).astype(jnp.float32)


# ---------------------------------------------------------------------------
# The pipeline's boundary


def vae_to_latents(cfg: VaeConfig, z: jax.Array) -> jax.Array:
    """The denoiser's latents of VAE latents (an encoded image's): ``(z - shift) * scale``."""
    return (z - cfg.shift_factor) * cfg.scaling_factor


def latents_to_vae(cfg: VaeConfig, latents: jax.Array) -> jax.Array:
    """What :func:`decode` takes of the denoiser's latents: ``latents / scale + shift``."""
    return latents / cfg.scaling_factor + cfg.shift_factor


def to_uint8(images: jax.Array) -> jax.Array:
    """Pixels of images in [-1, 1], as diffusers' ``VaeImageProcessor.postprocess``:
    ``round(clip(x / 2 + 0.5, 0, 1) * 255)``."""
    return jnp.round(jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0.0, 1.0) * 255).astype(jnp.uint8)


def from_nchw(x_bchw: Any) -> Any:
    """diffusers' NCHW (a latents file, torch images) as our NHWC."""
    return x_bchw.transpose(0, 2, 3, 1)


def to_nchw(x_bhwc: Any) -> Any:
    """Our NHWC as diffusers' NCHW."""
    return x_bhwc.transpose(0, 3, 1, 2)
