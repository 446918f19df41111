"""diffusers' ``FluxTransformer2DModel`` in JAX, from a diffusers ``transformer/`` folder
(``config.json`` and ``diffusion_pytorch_model.safetensors``, or its index and shards).

The model reads top to bottom as :func:`apply`: the conditioning vector (sinusoidal timestep, and
guidance for a guidance-distilled model, each through a two-layer MLP, plus the pooled text
projection), the image tokens and text tokens embedded to the model width, the double-stream
blocks (each stream its own AdaLayerNormZero, projections, QK RMSNorm and feed-forward; one joint
attention over text then image tokens), the single-stream blocks over the concatenated tokens
(AdaLayerNormZeroSingle, attention and MLP in parallel, one output projection over both), then
AdaLayerNormContinuous and the output projection of the image tokens. Queries and keys rotate by a
3-axis RoPE of the position ids (each axis its own frequencies over its slice of the head, pairs
interleaved, theta 10000).

The pipeline's side: :func:`pack_latents` / :func:`unpack_latents` turn VAE latents [b, c, h, w]
into Flux's tokens of 2x2 patches and back, :func:`latent_image_ids` and :func:`text_ids` are the
position ids FluxPipeline gives the model.

Naming: ``b`` batch, ``t`` image tokens, ``s`` text tokens, ``k`` all tokens (text then image),
``c`` latent channels, ``j`` the text encoder's width, ``d`` the model width, ``n`` heads, ``h``
head dim, ``f`` feed-forward width, ``e`` a modulation's width (2, 3 or 6 times ``d``), ``l``
layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config.numbers import shown
from hypertron.diffusion.errors import DiffusionError
from hypertron.diffusion.hfconfig import booleans, check_class, positive_int, positive_ints
from hypertron.diffusion.layers import timestep_embedding
from hypertron.diffusion.weights import load_model
from hypertron.models.attention import full_attention
from hypertron.models.params import ParamSpec, matmul, stack
from hypertron.parallel.rules import constrain
from hypertron.quant import einsum_for

Params = dict[str, Any]

NORM_EPS = 1e-6  # every LayerNorm and QK RMSNorm of the model
ROPE_THETA = 10000.0
TIME_CHANNELS = 256  # the sinusoidal projection of timesteps and guidance
MLP_RATIO = 4


@dataclass(frozen=True, kw_only=True)
class FluxConfig:
    """A ``FluxTransformer2DModel`` (patch size 1, as every Flux checkpoint); diffusers' defaults are
    Flux.1's."""

    in_channels: int = 64
    out_channels: int = 64
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    @property
    def width(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_dim(self) -> int:
        return MLP_RATIO * self.width


_INTS = ("in_channels", "num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
         "joint_attention_dim", "pooled_projection_dim")


def flux_config(hf: dict, where: str) -> FluxConfig:
    """The :class:`FluxConfig` of a diffusers ``FluxTransformer2DModel`` ``config.json`` (``where``
    names it in errors); an unsupported or malformed value is a one-line :class:`DiffusionError`
    naming the key."""
    check_class(hf, where, "FluxTransformer2DModel", {"patch_size": 1})
    default = FluxConfig()
    values = positive_ints(hf, where, default, _INTS)
    # diffusers: out_channels null (or absent) is in_channels
    values |= positive_ints({"out_channels": hf.get("out_channels") or values["in_channels"]}, where, default,
                            ("out_channels",))
    values |= booleans(hf, where, default, ("guidance_embeds",))
    axes = hf.get("axes_dims_rope", list(default.axes_dims_rope))
    head = values["attention_head_dim"]
    if (not isinstance(axes, list) or len(axes) != 3 or not all(positive_int(a) and a % 2 == 0 for a in axes)
            or sum(axes) != head):
        raise DiffusionError(f"{where}: axes_dims_rope={shown(axes)} must be 3 positive even integers summing "
                             f"to attention_head_dim={head}")
    return FluxConfig(axes_dims_rope=tuple(axes), **values)


# ---------------------------------------------------------------------------
# Parameters


def _linear(din: int, dout: int, axes: tuple[str | None, str | None], einsum: str, hf: str) -> Params:
    """A torch ``Linear(din, dout)`` named ``hf``, applied as ``einsum``."""
    return {"w": matmul((din, dout), axes, din, einsum, hf=f"{hf}.weight"),
            "b": ParamSpec((dout,), (None,), "zeros", hf=f"{hf}.bias")}


def _heads(cfg: FluxConfig, hf: str) -> Params:
    """A q, k or v projection [d, n, h] with its bias, named ``hf``."""
    d, n, h = cfg.width, cfg.num_attention_heads, cfg.attention_head_dim
    return {"w": matmul((d, n, h), ("embed", "heads", "head_dim"), d, "btd,dnh->btnh", hf=f"{hf}.weight",
                        hf_layout="heads_in"),
            "b": ParamSpec((d,), (None,), "zeros", hf=f"{hf}.bias")}


def _rms_scale(cfg: FluxConfig, hf: str) -> ParamSpec:
    return ParamSpec((cfg.attention_head_dim,), ("norm",), "ones", hf=f"{hf}.weight")


def _mlp(cfg: FluxConfig, hf: str) -> Params:
    d, f = cfg.width, cfg.mlp_dim
    return {"up": _linear(d, f, ("embed", "mlp"), "btd,df->btf", f"{hf}.net.0.proj"),
            "down": _linear(f, d, ("mlp", "embed"), "btf,fd->btd", f"{hf}.net.2")}


# Where each stream of a double-stream block keeps its tensors: (modulation, q, k, v, q norm, k norm,
# output projection, feed-forward), under ``transformer_blocks.{layer}``.
_STREAMS = {
    "img": ("norm1", "attn.to_q", "attn.to_k", "attn.to_v", "attn.norm_q", "attn.norm_k", "attn.to_out.0", "ff"),
    "txt": ("norm1_context", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.norm_added_q",
            "attn.norm_added_k", "attn.to_add_out", "ff_context"),
}


def _declare_stream(cfg: FluxConfig, names: tuple[str, ...], hf: str) -> Params:
    d, n, h = cfg.width, cfg.num_attention_heads, cfg.attention_head_dim
    mod, q, k, v, norm_q, norm_k, out, ff = (f"{hf}.{name}" for name in names)
    return {"mod": _linear(d, 6 * d, ("embed", "mlp"), "bd,de->be", f"{mod}.linear"),
            "q": _heads(cfg, q), "k": _heads(cfg, k), "v": _heads(cfg, v),
            "norm_q": _rms_scale(cfg, norm_q), "norm_k": _rms_scale(cfg, norm_k),
            "out": {"w": matmul((n, h, d), ("heads", "head_dim", "embed"), d, "btnh,nhd->btd", hf=f"{out}.weight",
                                hf_layout="heads_out"),
                    "b": ParamSpec((d,), (None,), "zeros", hf=f"{out}.bias")},
            "mlp": _mlp(cfg, ff)}


def _declare_single(cfg: FluxConfig, hf: str) -> Params:
    d, f = cfg.width, cfg.mlp_dim
    return {"mod": _linear(d, 3 * d, ("embed", "mlp"), "bd,de->be", f"{hf}.norm.linear"),
            "q": _heads(cfg, f"{hf}.attn.to_q"), "k": _heads(cfg, f"{hf}.attn.to_k"),
            "v": _heads(cfg, f"{hf}.attn.to_v"),
            "norm_q": _rms_scale(cfg, f"{hf}.attn.norm_q"), "norm_k": _rms_scale(cfg, f"{hf}.attn.norm_k"),
            "mlp": _linear(d, f, ("embed", "mlp"), "btd,df->btf", f"{hf}.proj_mlp"),
            # over [attention output (d) | MLP activation (f)], as diffusers concatenates them
            "out": _linear(d + f, d, ("mlp", "embed"), "btf,fd->btd", f"{hf}.proj_out")}


def _declare_embedder(din: int, d: int, hf: str) -> Params:
    """diffusers' ``TimestepEmbedding`` / ``PixArtAlphaTextProjection``: linear, SiLU, linear."""
    return {"in": _linear(din, d, (None, "embed"), "bf,fd->bd", f"{hf}.linear_1"),
            "out": _linear(d, d, ("embed", "mlp"), "bd,de->be", f"{hf}.linear_2")}


def declare_flux(cfg: FluxConfig) -> Params:
    """Every parameter of the model, ``hf`` its diffusers state-dict name; the blocks stacked over a
    leading ``layers`` axis."""
    d = cfg.width
    double = {name: _declare_stream(cfg, names, "transformer_blocks.{layer}") for name, names in _STREAMS.items()}
    single = _declare_single(cfg, "single_transformer_blocks.{layer}")
    time = {"time": _declare_embedder(TIME_CHANNELS, d, "time_text_embed.timestep_embedder"),
            "text": _declare_embedder(cfg.pooled_projection_dim, d, "time_text_embed.text_embedder")}
    if cfg.guidance_embeds:
        time["guidance"] = _declare_embedder(TIME_CHANNELS, d, "time_text_embed.guidance_embedder")
    is_spec = lambda x: isinstance(x, ParamSpec)  # noqa: E731
    return {
        "time_text_embed": time,
        "x_embedder": _linear(cfg.in_channels, d, (None, "embed"), "btc,cd->btd", "x_embedder"),
        "context_embedder": _linear(cfg.joint_attention_dim, d, (None, "embed"), "bsj,jd->bsd", "context_embedder"),
        "double": jax.tree.map(lambda s: stack(s, cfg.num_layers), double, is_leaf=is_spec),
        "single": jax.tree.map(lambda s: stack(s, cfg.num_single_layers), single, is_leaf=is_spec),
        "norm_out": _linear(d, 2 * d, ("embed", "mlp"), "bd,de->be", "norm_out.linear"),
        "proj_out": _linear(d, cfg.out_channels, ("embed", None), "btd,dc->btc", "proj_out"),
    }


def load_flux(folder: str | Path, dtype: Any = np.float32) -> tuple[FluxConfig, Params]:
    """``(cfg, params)`` of the diffusers Flux transformer folder (:func:`weights.load_model`)."""
    return load_model(folder, flux_config, declare_flux, dtype)


# ---------------------------------------------------------------------------
# Forward: pieces


def _dense(einsum, subscripts: str, x: jax.Array, p: Params) -> jax.Array:
    y = einsum(subscripts, x, p["w"])
    return y + p["b"].astype(y.dtype)


def _embedder(einsum, x_bf: jax.Array, p: Params) -> jax.Array:
    return _dense(einsum, "bd,de->be", jax.nn.silu(_dense(einsum, "bf,fd->bd", x_bf, p["in"])), p["out"])


def _modulation(einsum, act_bd: jax.Array, p: Params, parts: int) -> list[jax.Array]:
    """An AdaLN's ``parts`` vectors [b, d] (shifts, scales, gates) of the conditioning's SiLU. Pinned
    whole on each row: XLA's CPU partitioner (jax 0.10.2) left on its own computes wrong values
    on (data=2, fsdp=2, tensor=2), where the weight's ``mlp`` axis shards them over ``tensor``."""
    mod_be = constrain(_dense(einsum, "bd,de->be", act_bd, p), ("batch", None))
    return jnp.split(mod_be, parts, axis=-1)


def _layer_norm(x: jax.Array) -> jax.Array:
    """LayerNorm over the last axis without scale or bias, in float32, returned in ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(axis=-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + NORM_EPS)).astype(x.dtype)


def _rms_norm(x: jax.Array, w: jax.Array) -> jax.Array:
    """torch's ``RMSNorm`` over the last axis, in float32, returned in ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + NORM_EPS)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def _modulate(x_btd: jax.Array, shift_bd: jax.Array, scale_bd: jax.Array) -> jax.Array:
    """AdaLN: the unscaled LayerNorm of ``x``, then ``* (1 + scale) + shift`` per row."""
    return _layer_norm(x_btd) * (1 + scale_bd[:, None]) + shift_bd[:, None]


def rope(ids_k3: Any, axes_dims: tuple[int, ...]) -> tuple[Any, Any]:
    """``(cos, sin)`` [k, h] of Flux's rotary embedding of position ids [k, 3]: axis ``i`` of the ids
    turns its slice of ``axes_dims[i]`` head channels at frequencies ``theta^(-2j/dim)``, each
    frequency repeated for its interleaved pair. numpy ids are computed in float64 on the host (as
    diffusers does), traced ones in float32."""
    xp = np if isinstance(ids_k3, np.ndarray) else jnp
    ftype = np.float64 if xp is np else jnp.float32
    angles = []
    for i, dim in enumerate(axes_dims):
        inv_freq = 1.0 / ROPE_THETA ** (xp.arange(0, dim, 2, dtype=ftype) / dim)
        angles.append(xp.repeat(ids_k3[:, i].astype(ftype)[:, None] * inv_freq[None, :], 2, axis=1))
    angles_kh = xp.concatenate(angles, axis=1)
    return xp.cos(angles_kh).astype(np.float32), xp.sin(angles_kh).astype(np.float32)


def _rotate(x_bknh: jax.Array, cos_kh: jax.Array, sin_kh: jax.Array) -> jax.Array:
    """Each interleaved pair ``(x0, x1)`` of a head turned by its angle: ``x * cos + (-x1, x0) * sin``."""
    x = x_bknh.astype(jnp.float32)
    pairs = x.reshape(*x.shape[:-1], -1, 2)  # [b, k, n, h/2, 2]
    turned = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    out = x * cos_kh[None, :, None, :] + turned * sin_kh[None, :, None, :]
    return out.astype(x_bknh.dtype)


def _qkv(h_btd: jax.Array, p: Params, einsum) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries and keys (RMS-normed per head) and values [b, t, n, h] of one stream."""
    def proj(name: str) -> jax.Array:
        w = p[name]
        out = einsum("btd,dnh->btnh", h_btd, w["w"])  # the weight may be wrapped (LoRA, int8): the bias by the output
        return out + w["b"].reshape(out.shape[2:]).astype(h_btd.dtype)

    return _rms_norm(proj("q"), p["norm_q"]), _rms_norm(proj("k"), p["norm_k"]), proj("v")


def _attend(q_bknh, k_bknh, v_bknh, rope_kh: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Full attention of the rotated queries over the rotated keys: [b, k, n, h]."""
    cos_kh, sin_kh = rope_kh
    o_bknh = full_attention(_rotate(q_bknh, cos_kh, sin_kh), _rotate(k_bknh, cos_kh, sin_kh), v_bknh)
    return constrain(o_bknh, ("batch", "seq", "act_heads", None))


# ---------------------------------------------------------------------------
# Forward: blocks


def double_block(x_btd: jax.Array, c_bsd: jax.Array, p: Params, act_bd: jax.Array, rope_kh, einsum
                 ) -> tuple[jax.Array, jax.Array]:
    """One ``FluxTransformerBlock``: image tokens ``x`` and text tokens ``c``, each with its own
    AdaLayerNormZero (of ``act_bd``, the SiLU of the conditioning), projections and feed-forward,
    attending jointly over text then image tokens."""
    streams = {"txt": c_bsd, "img": x_btd}  # the joint sequence's order
    mods = {name: _modulation(einsum, act_bd, p[name]["mod"], 6) for name in streams}
    with jax.named_scope("attention"):
        qkv = [_qkv(_modulate(x, *mods[name][:2]), p[name], einsum) for name, x in streams.items()]
        o_bknh = _attend(*(jnp.concatenate(parts, axis=1) for parts in zip(*qkv)), rope_kh)
    s = c_bsd.shape[1]
    outs = {"txt": o_bknh[:, :s], "img": o_bknh[:, s:]}
    for name, x in streams.items():
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods[name]
        with jax.named_scope(f"{name}_out"):
            x = x + gate_msa[:, None] * _dense(einsum, "btnh,nhd->btd", outs[name], p[name]["out"])
            h_btd = _modulate(x, shift_mlp, scale_mlp)
            h_btf = jax.nn.gelu(_dense(einsum, "btd,df->btf", h_btd, p[name]["mlp"]["up"]), approximate=True)
            h_btf = constrain(h_btf, ("batch", "seq", "act_mlp"))
            x = x + gate_mlp[:, None] * _dense(einsum, "btf,fd->btd", h_btf, p[name]["mlp"]["down"])
        streams[name] = constrain(x, ("batch", "seq", "act_embed"))
    return streams["img"], streams["txt"]


def single_block(x_bkd: jax.Array, p: Params, act_bd: jax.Array, rope_kh, einsum) -> jax.Array:
    """One ``FluxSingleTransformerBlock`` over the joint tokens [b, k, d]: AdaLayerNormZeroSingle,
    then attention and a GELU MLP side by side, one projection of both, gated, added back."""
    shift_bd, scale_bd, gate_bd = _modulation(einsum, act_bd, p["mod"], 3)
    h_bkd = _modulate(x_bkd, shift_bd, scale_bd)
    with jax.named_scope("attention"):
        o_bknh = _attend(*_qkv(h_bkd, p, einsum), rope_kh)
    with jax.named_scope("mlp"):
        m_bkf = jax.nn.gelu(_dense(einsum, "btd,df->btf", h_bkd, p["mlp"]), approximate=True)
    both = jnp.concatenate([o_bknh.reshape(*o_bknh.shape[:2], -1), m_bkf], axis=-1)  # [b, k, d + f]
    x_bkd = x_bkd + gate_bd[:, None] * _dense(einsum, "btf,fd->btd", both, p["out"])
    return constrain(x_bkd, ("batch", "seq", "act_embed"))


def conditioning(params: Params, cfg: FluxConfig, timesteps_b: jax.Array, pooled_bd: jax.Array,
                 guidance_b: jax.Array | None, einsum) -> jax.Array:
    """The conditioning vector [b, d]: diffusers' ``CombinedTimestep(Guidance)TextProjEmbeddings`` of
    ``1000 * timesteps`` (and ``1000 * guidance``) and the pooled text embeddings."""
    p = params["time_text_embed"]
    embed = lambda t_b, q: _embedder(  # noqa: E731
        einsum, timestep_embedding(t_b * 1000, TIME_CHANNELS, flip_sin_to_cos=True, freq_shift=0), q)
    if cfg.guidance_embeds != (guidance_b is not None):
        raise ValueError(f"guidance_embeds={cfg.guidance_embeds}: guidance_b must be "
                         + ("given" if cfg.guidance_embeds else "None"))
    temb_bd = embed(timesteps_b, p["time"])
    if guidance_b is not None:
        temb_bd = temb_bd + embed(guidance_b, p["guidance"])
    return temb_bd + _embedder(einsum, pooled_bd, p["text"])


def apply(params: Params, cfg: FluxConfig, latents_btc: jax.Array, timesteps_b: jax.Array,
          context_bsd: jax.Array, pooled_bd: jax.Array, guidance_b: jax.Array | None, img_ids: Any,
          txt_ids: Any, einsum=None, *, dtype: Any = jnp.float32) -> jax.Array:
    """The model's prediction [b, t, out_channels] (float32) for packed latents [b, t, in_channels]:
    ``FluxTransformer2DModel.forward(hidden_states=latents_btc, encoder_hidden_states=context_bsd,
    pooled_projections=pooled_bd, timestep=timesteps_b, img_ids=img_ids, txt_ids=txt_ids,
    guidance=guidance_b)``. The inputs are what FluxPipeline passes: timesteps [b] divided by 1000,
    guidance [b] the guidance scale itself (None for a model without ``guidance_embeds``), the
    T5 states [b, s, joint_attention_dim], CLIP's pooled output [b, pooled_projection_dim], the ids
    [t, 3] and [s, 3] (:func:`latent_image_ids`, :func:`text_ids`). Matmuls through ``einsum`` (the
    plain einsum hook in ``dtype`` by default), activations in ``dtype``, norms in float32."""
    einsum = einsum or einsum_for("none", dtype)
    act_bd = jax.nn.silu(conditioning(params, cfg, timesteps_b, pooled_bd, guidance_b, einsum)).astype(dtype)
    x_btd = _dense(einsum, "btc,cd->btd", latents_btc.astype(dtype), params["x_embedder"])
    c_bsd = _dense(einsum, "bsj,jd->bsd", context_bsd.astype(dtype), params["context_embedder"])
    x_btd = constrain(x_btd, ("batch", "seq", "act_embed"))
    c_bsd = constrain(c_bsd, ("batch", "seq", "act_embed"))
    ids_k3 = (np.concatenate([np.asarray(txt_ids), np.asarray(img_ids)])
              if isinstance(txt_ids, np.ndarray) and isinstance(img_ids, np.ndarray)
              else jnp.concatenate([jnp.asarray(txt_ids), jnp.asarray(img_ids)]))
    rope_kh = tuple(jnp.asarray(a) for a in rope(ids_k3, cfg.axes_dims_rope))

    def double(carry, p):
        with jax.named_scope("double_block"):
            return double_block(*carry, p, act_bd, rope_kh, einsum), None

    def single(x_bkd, p):
        with jax.named_scope("single_block"):
            return single_block(x_bkd, p, act_bd, rope_kh, einsum), None

    (x_btd, c_bsd), _ = jax.lax.scan(double, (x_btd, c_bsd), params["double"])
    x_bkd, _ = jax.lax.scan(single, jnp.concatenate([c_bsd, x_btd], axis=1), params["single"])
    x_btd = x_bkd[:, c_bsd.shape[1]:]
    scale_bd, shift_bd = _modulation(einsum, act_bd, params["norm_out"], 2)
    x_btd = _modulate(x_btd, shift_bd, scale_bd)
    return _dense(einsum, "btd,dc->btc", x_btd, params["proj_out"]).astype(jnp.float32)


# ---------------------------------------------------------------------------
# The pipeline's side: 2x2 packing and position ids (FluxPipeline's static methods)


def pack_latents(latents_bchw: Any) -> Any:
    """Latents [b, c, h, w] (numpy or JAX; h, w even) as Flux's tokens [b, (h/2)(w/2), 4c]: each 2x2
    patch row-major, its channels ``c`` outer and the patch's 2x2 inner (``_pack_latents``)."""
    b, c, h, w = latents_bchw.shape
    x = latents_bchw.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)  # [b, h/2, w/2, c, 2, 2]
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed_btc: Any, h: int, w: int) -> Any:
    """:func:`pack_latents` undone: tokens [b, (h/2)(w/2), 4c] as latents [b, c, h, w], ``h`` and
    ``w`` the latents' (even) height and width (``_unpack_latents`` at the image size ``8h x 8w``)."""
    b, _, c4 = packed_btc.shape
    x = packed_btc.reshape(b, h // 2, w // 2, c4 // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)  # [b, c, h/2, 2, w/2, 2]
    return x.reshape(b, c4 // 4, h, w)


def latent_image_ids(h2: int, w2: int) -> np.ndarray:
    """Position ids [h2 * w2, 3] (float32) of the packed tokens of an ``h2 x w2`` patch grid: ``(0,
    row, column)`` row-major (``_prepare_latent_image_ids``)."""
    ids = np.zeros((h2, w2, 3), np.float32)
    ids[..., 1] = np.arange(h2)[:, None]
    ids[..., 2] = np.arange(w2)[None, :]
    return ids.reshape(h2 * w2, 3)


def text_ids(length: int) -> np.ndarray:
    """Position ids [length, 3] of the text tokens: all zeros, as FluxPipeline's ``encode_prompt``."""
    return np.zeros((length, 3), np.float32)
