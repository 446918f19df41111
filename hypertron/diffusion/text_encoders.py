"""The text encoders of diffusion pipelines, in JAX: CLIP's text transformer and T5 v1.1's encoder.

* ``CLIPTextModel``: SD 1.x (CLIP-L), SD 2.x (OpenCLIP-H, 23 layers), SDXL's first encoder and
  Flux's pooled one. Causal self-attention, pre-LayerNorm blocks, ``quick_gelu`` or ``gelu``, a
  final LayerNorm; the pooled output is the final state at the eos token.
* ``CLIPTextModelWithProjection``: the same plus ``text_projection`` of the pooled output (SDXL's
  second encoder).
* ``T5EncoderModel`` (v1.1, Flux's): RMSNorm, relative position buckets shared by all layers,
  unscaled attention, a gated-GELU feed-forward, no biases.

Each weight is a :class:`~hypertron.models.params.ParamSpec` whose ``hf`` name is its transformers
state-dict name, read from the folder's safetensors by
:func:`hypertron.models.hf.params_from_hf`; matmuls go through the einsum hook, so int8 weights
(:func:`~hypertron.models.params.quantize_params`) and :func:`~hypertron.models.params.cast_params`
apply. How prompts become ids (bos, truncation, eos, padding) is :func:`prompt_ids`; what SD and
SDXL take of the outputs (``clip_skip``, SDXL's concatenated penultimate states) is
:func:`sd_prompt_embeds` and :func:`sdxl_prompt_embeds`, as diffusers' ``encode_prompt`` does.

Naming: ``b`` batch, ``t`` / ``s`` query / key positions, ``d`` width, ``n`` heads, ``h`` head dim,
``f`` feed-forward width, ``v`` vocabulary, ``p`` projection, ``l`` layers (+ the embeddings).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config.loading import read_json
from hypertron.diffusion.errors import DiffusionError
from hypertron.models.hf import INDEX_FILE, SINGLE_FILE, HFError, checkpoint_tensors, params_from_hf
from hypertron.models.params import ParamSpec, matmul, stack
from hypertron.parallel.rules import constrain
from hypertron.quant import einsum_for, take_rows
from hypertron.tokenizer import Tokenizer

Params = dict[str, Any]

# transformers' ``hidden_act`` / ``dense_act_fn`` names of the activations these encoders use.
ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


@dataclass(frozen=True, kw_only=True)
class ClipTextConfig:
    """A ``CLIPTextModel`` (``projection_dim`` None) or ``CLIPTextModelWithProjection``."""

    vocab_size: int
    width: int
    mlp_dim: int
    num_layers: int
    num_heads: int
    max_positions: int  # 77: prompts are padded to this
    activation: str
    norm_eps: float
    eos_token_id: int  # 2 in old configs: then the pooled position is the largest id's (as transformers)
    projection_dim: int | None


@dataclass(frozen=True, kw_only=True)
class T5EncoderConfig:
    """A ``T5EncoderModel`` with a gated feed-forward (T5 v1.1, Flux's ``text_encoder_2``)."""

    vocab_size: int
    width: int
    head_dim: int
    mlp_dim: int
    num_layers: int
    num_heads: int
    num_buckets: int
    max_distance: int
    activation: str
    norm_eps: float


TextConfig = ClipTextConfig | T5EncoderConfig


class TextEncoder(NamedTuple):
    """A loaded text encoder: its config, its parameters (as declared) and how its matmuls run
    (``quantize``: ``none``, or ``int8`` with :class:`~hypertron.quant.QArray` weights)."""

    cfg: TextConfig
    params: Params
    quantize: str = "none"


class ClipOutput(NamedTuple):
    """What a CLIP text model computes for ids [b, t]."""

    hidden_lbtd: jax.Array  # transformers' hidden_states: the embeddings, then each layer's output
    last_btd: jax.Array  # last_hidden_state: the final LayerNorm of the last layer's output
    pooled_bd: jax.Array  # last_btd at each row's eos token (pooler_output)
    projected_bp: jax.Array | None  # text_projection of pooled_bd (text_embeds), with a projection


# ---------------------------------------------------------------------------
# Configs


def _clip_config(hf: dict, get) -> ClipTextConfig:
    projection = hf.get("architectures", [""])[0] == "CLIPTextModelWithProjection"
    return ClipTextConfig(
        vocab_size=int(get("vocab_size")), width=int(get("hidden_size")), mlp_dim=int(get("intermediate_size")),
        num_layers=int(get("num_hidden_layers")), num_heads=int(get("num_attention_heads")),
        max_positions=int(get("max_position_embeddings")), activation=_activation(hf, "hidden_act", "quick_gelu"),
        norm_eps=float(hf.get("layer_norm_eps", 1e-5)), eos_token_id=int(hf.get("eos_token_id", 2)),
        projection_dim=int(get("projection_dim")) if projection else None,
    )


def _t5_config(hf: dict, get) -> T5EncoderConfig:
    proj = hf.get("feed_forward_proj", "relu")
    if not proj.startswith("gated-"):
        raise DiffusionError(f"feed_forward_proj {proj!r}: only T5 v1.1's gated feed-forward (gated-gelu) is supported")
    # transformers' T5Config maps gated-gelu to gelu_new (the tanh approximation).
    default = "gelu_new" if proj == "gated-gelu" else proj.removeprefix("gated-")
    return T5EncoderConfig(
        vocab_size=int(get("vocab_size")), width=int(get("d_model")), head_dim=int(get("d_kv")),
        mlp_dim=int(get("d_ff")), num_layers=int(get("num_layers")), num_heads=int(get("num_heads")),
        num_buckets=int(hf.get("relative_attention_num_buckets", 32)),
        max_distance=int(hf.get("relative_attention_max_distance", 128)),
        activation=_activation(hf, "dense_act_fn", default), norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)),
    )


# The ``architectures`` entry of a config.json -> how its config is read.
ARCHITECTURES = {
    "CLIPTextModel": _clip_config,
    "CLIPTextModelWithProjection": _clip_config,
    "T5EncoderModel": _t5_config,
}


def _activation(hf: dict, key: str, default: str) -> str:
    act = hf.get(key, default)
    if act not in ACTIVATIONS:
        raise DiffusionError(f"{key} {act!r} is not supported (choose from {', '.join(ACTIVATIONS)})")
    return act


def text_config(hf: dict, where: str) -> TextConfig:
    """The config of a transformers ``config.json`` dict (``where``: its file, for errors)."""
    architecture = (hf.get("architectures") or [None])[0]
    if architecture not in ARCHITECTURES:
        raise DiffusionError(f"{where}: architecture {architecture!r} is not a supported text encoder "
                          f"(choose from {', '.join(ARCHITECTURES)})")

    def get(key: str) -> Any:
        if hf.get(key) is None:
            raise DiffusionError(f"{where}: missing {key!r}")
        return hf[key]

    try:
        return ARCHITECTURES[architecture](hf, get)
    except (TypeError, ValueError) as e:
        raise DiffusionError(f"{where}: {e}") from None


# ---------------------------------------------------------------------------
# Declarations

# Hub checkpoints (transformers 4) name CLIP's text tensors ``text_model.*``; transformers 5 saves a
# CLIPTextModel without the prefix (and reads both), so a checkpoint without it gets it added.
CLIP_PREFIX = "text_model."
CLIP_LAYER = CLIP_PREFIX + "encoder.layers.{layer}."
T5_LAYER = "encoder.block.{layer}.layer."


def _embedding(v: int, d: int, hf: str) -> ParamSpec:
    # Gathered only; the einsum names a row-wise int8 scale, which take_rows reads.
    return ParamSpec((v, d), ("vocab", "embed"), "normal", 1.0, einsum="btd,vd->btv", quantize=True, hf=hf)


def _vector(n: int, hf: str, init: str = "zeros", axis: str | None = None) -> ParamSpec:
    return ParamSpec((n,), (axis,), init, hf=hf)


def declare_clip(cfg: ClipTextConfig) -> Params:
    """CLIP's text transformer as :class:`ParamSpec` leaves, by transformers' names."""
    d, f, n = cfg.width, cfg.mlp_dim, cfg.num_heads
    h = d // n
    proj = lambda name: CLIP_LAYER + f"self_attn.{name}_proj."  # noqa: E731
    heads_in = lambda name: matmul((d, n, h), ("embed", "heads", "head_dim"), d, "btd,dnh->btnh",  # noqa: E731
                                   hf=proj(name) + "weight", hf_layout="heads_in", fp8_history=False)
    layer = {
        "norm1_w": _vector(d, CLIP_LAYER + "layer_norm1.weight", "ones", "norm"),
        "norm1_b": _vector(d, CLIP_LAYER + "layer_norm1.bias", axis="norm"),
        "wq": heads_in("q"), "bq": _vector(d, proj("q") + "bias"),
        "wk": heads_in("k"), "bk": _vector(d, proj("k") + "bias"),
        "wv": heads_in("v"), "bv": _vector(d, proj("v") + "bias"),
        "wo": matmul((n, h, d), ("heads", "head_dim", "embed"), d, "btnh,nhd->btd", hf=proj("out") + "weight",
                     hf_layout="heads_out", fp8_history=False),
        "bo": _vector(d, proj("out") + "bias"),
        "norm2_w": _vector(d, CLIP_LAYER + "layer_norm2.weight", "ones", "norm"),
        "norm2_b": _vector(d, CLIP_LAYER + "layer_norm2.bias", axis="norm"),
        "w1": matmul((d, f), ("embed", "mlp"), d, "btd,df->btf", hf=CLIP_LAYER + "mlp.fc1.weight", fp8_history=False),
        "b1": _vector(f, CLIP_LAYER + "mlp.fc1.bias"),
        "w2": matmul((f, d), ("mlp", "embed"), f, "btf,fd->btd", hf=CLIP_LAYER + "mlp.fc2.weight", fp8_history=False),
        "b2": _vector(d, CLIP_LAYER + "mlp.fc2.bias"),
    }
    params: Params = {
        "token_embed": _embedding(cfg.vocab_size, d, "text_model.embeddings.token_embedding.weight"),
        "position_embed": ParamSpec((cfg.max_positions, d), (None, "embed"), "normal", 0.02,
                                    hf="text_model.embeddings.position_embedding.weight"),
        "layers": {name: stack(spec, cfg.num_layers) for name, spec in layer.items()},
        "final_norm_w": _vector(d, "text_model.final_layer_norm.weight", "ones", "norm"),
        "final_norm_b": _vector(d, "text_model.final_layer_norm.bias", axis="norm"),
    }
    if cfg.projection_dim is not None:
        params["projection"] = matmul((d, cfg.projection_dim), ("embed", None), d, "bd,dp->bp",
                                      hf="text_projection.weight", fp8_history=False)
    return params


def declare_t5(cfg: T5EncoderConfig) -> Params:
    """T5 v1.1's encoder as :class:`ParamSpec` leaves, by transformers' names."""
    d, f, n, h = cfg.width, cfg.mlp_dim, cfg.num_heads, cfg.head_dim
    attn = T5_LAYER + "0.SelfAttention."
    ff = T5_LAYER + "1.DenseReluDense."
    heads_in = lambda name: matmul((d, n, h), ("embed", "heads", "head_dim"), d, "btd,dnh->btnh",  # noqa: E731
                                   hf=attn + f"{name}.weight", hf_layout="heads_in", fp8_history=False)
    layer = {
        "attn_norm": _vector(d, T5_LAYER + "0.layer_norm.weight", "ones", "norm"),
        "wq": heads_in("q"), "wk": heads_in("k"), "wv": heads_in("v"),
        "wo": matmul((n, h, d), ("heads", "head_dim", "embed"), n * h, "btnh,nhd->btd", hf=attn + "o.weight",
                     hf_layout="heads_out", fp8_history=False),
        "mlp_norm": _vector(d, T5_LAYER + "1.layer_norm.weight", "ones", "norm"),
        "w_gate": matmul((d, f), ("embed", "mlp"), d, "btd,df->btf", hf=ff + "wi_0.weight", fp8_history=False),
        "w_up": matmul((d, f), ("embed", "mlp"), d, "btd,df->btf", hf=ff + "wi_1.weight", fp8_history=False),
        "w_down": matmul((f, d), ("mlp", "embed"), f, "btf,fd->btd", hf=ff + "wo.weight", fp8_history=False),
    }
    return {
        "token_embed": _embedding(cfg.vocab_size, d, "shared.weight"),
        # Only the first block holds the bucket -> bias table; every layer adds the same bias.
        "position_bias": ParamSpec((cfg.num_buckets, n), (None, "heads"), "normal", 1.0,
                                   hf="encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
        "layers": {name: stack(spec, cfg.num_layers) for name, spec in layer.items()},
        "final_norm": _vector(d, "encoder.final_layer_norm.weight", "ones", "norm"),
    }


def declare(cfg: TextConfig) -> Params:
    """The parameter declarations of a text encoder's config."""
    return declare_clip(cfg) if isinstance(cfg, ClipTextConfig) else declare_t5(cfg)


class _Prefixed(Mapping):
    """``tensors`` with ``prefix`` before every name."""

    def __init__(self, tensors: Mapping[str, np.ndarray], prefix: str):
        self._tensors, self._prefix = tensors, prefix

    def __getitem__(self, name: str) -> np.ndarray:
        if not name.startswith(self._prefix):
            raise KeyError(name)
        return self._tensors[name.removeprefix(self._prefix)]

    def __iter__(self) -> Iterator[str]:
        return (self._prefix + name for name in self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


# T5 checkpoints may also store the encoder's tied copy of ``shared.weight``; it is not read.
_TIED_COPIES = ("encoder.embed_tokens.weight",)


def load_text_encoder(folder: str | Path, dtype: Any = np.float32) -> TextEncoder:
    """A text encoder from a transformers folder (``config.json`` and safetensors, single or
    sharded): its config and its parameters as numpy arrays in ``dtype``. A missing config, an
    unsupported architecture or value, or a missing, extra or misshapen tensor is a
    :class:`DiffusionError` naming the file and the key or tensor."""
    folder = Path(folder)
    config_file = folder / "config.json"
    hf = read_json(config_file, DiffusionError, f"{config_file}: not found",
                   lambda reason: f"{config_file}: invalid JSON ({reason})")
    if not isinstance(hf, dict):
        raise DiffusionError(f"{config_file}: not a JSON object")
    cfg = text_config(hf, str(config_file))
    where = str(folder / (SINGLE_FILE if (folder / SINGLE_FILE).is_file() else INDEX_FILE))
    if not (folder / SINGLE_FILE).is_file() and not (folder / INDEX_FILE).is_file() and any(folder.glob("*.bin")):
        raise DiffusionError(f"{folder}: only .bin weights, which need torch to read (hypertron runs without it): "
                          f"save the model as safetensors")
    try:
        with checkpoint_tensors(folder) as tensors:
            if isinstance(cfg, ClipTextConfig) and not any(k.startswith(CLIP_PREFIX) for k in tensors):
                tensors = _Prefixed(tensors, CLIP_PREFIX)
            params = params_from_hf(declare(cfg), tensors, dtype, where, ignored=_TIED_COPIES)
    except HFError as e:
        raise DiffusionError(str(e)) from None
    return TextEncoder(cfg, params)


# ---------------------------------------------------------------------------
# Prompts -> ids


def prompt_ids(tokenizer: Tokenizer, prompts: Sequence[str], length: int, *, bos: bool) -> np.ndarray:
    """Ids [b, length] (int32) of ``prompts`` as diffusers tokenizes them (``padding="max_length"``,
    ``truncation=True``): bos (CLIP) or not (T5), the text's ids cut to fit, eos, then the
    tokenizer's pad id."""
    head = [tokenizer.bos_id] if bos else []
    room = length - len(head) - 1
    out = np.full((len(prompts), length), tokenizer.pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        ids = head + tokenizer.encode(prompt)[:room] + [tokenizer.eos_id]
        out[row, :len(ids)] = ids
    return out


# ---------------------------------------------------------------------------
# CLIP


def embed(table_vd, ids_bt: jax.Array, dtype: Any) -> jax.Array:
    """Rows [b, t, d] of the token table, gathered from a replicated copy (as the decoder does: a
    gather from an fsdp/tensor-sharded table makes the partitioner replicate its output anyway)."""
    return take_rows(table_vd, ids_bt, dtype, partial(constrain, axes=(None, None)))


def layer_norm(x_btd: jax.Array, w_d: jax.Array, b_d: jax.Array, eps: float) -> jax.Array:
    """LayerNorm in float32, returned in ``x``'s dtype."""
    x = x_btd.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * w_d.astype(jnp.float32) + b_d.astype(jnp.float32)
    return y.astype(x_btd.dtype)


def clip_layer(x_btd: jax.Array, p: Params, cfg: ClipTextConfig, einsum) -> jax.Array:
    """One CLIP block: causal self-attention, then the MLP, each after a LayerNorm and added back."""
    n = cfg.num_heads
    bias = lambda b_d: b_d.astype(x_btd.dtype).reshape(n, -1)  # noqa: E731  # [n, h]
    with jax.named_scope("attention"):
        h_btd = layer_norm(x_btd, p["norm1_w"], p["norm1_b"], cfg.norm_eps)
        q_btnh = einsum("btd,dnh->btnh", h_btd, p["wq"]) + bias(p["bq"])
        k_btnh = einsum("btd,dnh->btnh", h_btd, p["wk"]) + bias(p["bk"])
        v_btnh = einsum("btd,dnh->btnh", h_btd, p["wv"]) + bias(p["bv"])
        o_btnh = jax.nn.dot_product_attention(q_btnh, k_btnh, v_btnh, is_causal=True)
        o_btnh = constrain(o_btnh, ("batch", "seq", "act_heads", None))
        x_btd = x_btd + einsum("btnh,nhd->btd", o_btnh, p["wo"]) + p["bo"].astype(x_btd.dtype)
    with jax.named_scope("mlp"):
        h_btd = layer_norm(x_btd, p["norm2_w"], p["norm2_b"], cfg.norm_eps)
        h_btf = ACTIVATIONS[cfg.activation](einsum("btd,df->btf", h_btd, p["w1"]) + p["b1"].astype(x_btd.dtype))
        h_btf = constrain(h_btf, ("batch", "seq", "act_mlp"))
        x_btd = x_btd + einsum("btf,fd->btd", h_btf, p["w2"]) + p["b2"].astype(x_btd.dtype)
    return constrain(x_btd, ("batch", "seq", "act_embed"))


def clip_encode(params: Params, cfg: ClipTextConfig, ids_bt: jax.Array, *, dtype: Any = jnp.float32,
                quantization: str = "none") -> ClipOutput:
    """CLIP's text transformer over ids [b, t] (t <= ``max_positions``), computing in ``dtype``:
    every hidden state, the last one normed, the pooled and (with a projection) projected outputs."""
    einsum = einsum_for(quantization, dtype)
    t = ids_bt.shape[1]
    x_btd = embed(params["token_embed"], ids_bt, dtype) + params["position_embed"][:t].astype(dtype)
    x_btd = constrain(x_btd, ("batch", "seq", "act_embed"))

    def body(x_btd, p):
        x_btd = clip_layer(x_btd, p, cfg, einsum)
        return x_btd, x_btd

    last_btd, hidden_lbtd = jax.lax.scan(body, x_btd, params["layers"])
    hidden_lbtd = jnp.concatenate([x_btd[None], hidden_lbtd])  # [l + 1, b, t, d]
    last_btd = layer_norm(last_btd, params["final_norm_w"], params["final_norm_b"], cfg.norm_eps)
    if cfg.eos_token_id == 2:  # legacy configs: the eos token has the largest id
        eos_b = jnp.argmax(ids_bt, axis=-1)
    else:
        eos_b = jnp.argmax(ids_bt == cfg.eos_token_id, axis=-1)
    pooled_bd = jnp.take_along_axis(last_btd, eos_b[:, None, None], axis=1)[:, 0]
    projected_bp = None
    if cfg.projection_dim is not None:
        projected_bp = einsum("bd,dp->bp", pooled_bd, params["projection"])
    return ClipOutput(hidden_lbtd, last_btd, pooled_bd, projected_bp)


def sd_prompt_embeds(out: ClipOutput, params: Params, cfg: ClipTextConfig, clip_skip: int | None = None
                     ) -> jax.Array:
    """SD 1.x / 2.x's prompt embeddings [b, t, d]: the last hidden state, or with ``clip_skip`` the
    final LayerNorm of the state ``clip_skip`` layers earlier (diffusers' ``encode_prompt``)."""
    if clip_skip is None:
        return out.last_btd
    return layer_norm(out.hidden_lbtd[-(clip_skip + 1)], params["final_norm_w"], params["final_norm_b"],
                      cfg.norm_eps)


def sdxl_prompt_embeds(first: ClipOutput, second: ClipOutput, clip_skip: int | None = None
                       ) -> tuple[jax.Array, jax.Array]:
    """SDXL's prompt embeddings [b, t, d1 + d2] (both encoders' penultimate states, or ``clip_skip``
    layers before those, side by side, without the final LayerNorm) and pooled embeddings [b, p]
    (the second encoder's projection)."""
    index = -(2 if clip_skip is None else clip_skip + 2)
    embeds_btd = jnp.concatenate([first.hidden_lbtd[index], second.hidden_lbtd[index]], axis=-1)
    return embeds_btd, second.projected_bp


# ---------------------------------------------------------------------------
# T5


def relative_buckets(t: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """T5's bidirectional relative-position bucket [t, s] of key s for query t (computed on the
    host, in float32 as transformers does): exact near the diagonal, logarithmic out to
    ``max_distance``, separate halves for keys before and after the query."""
    relative_ts = np.arange(t)[None, :] - np.arange(t)[:, None]
    half = num_buckets // 2
    buckets_ts = (relative_ts > 0).astype(np.int64) * half
    distance_ts = np.abs(relative_ts)
    exact = half // 2
    # Distances under ``exact`` take the other branch; 1 keeps the log finite there.
    ratio_ts = np.maximum(distance_ts, 1).astype(np.float32) / np.float32(exact)
    log_ts = np.log(ratio_ts) / np.float32(math.log(max_distance / exact))
    large_ts = np.minimum(exact + (log_ts * np.float32(half - exact)).astype(np.int64), half - 1)
    return buckets_ts + np.where(distance_ts < exact, distance_ts, large_ts)


def rms_norm(x_btd: jax.Array, w_d: jax.Array, eps: float) -> jax.Array:
    """T5's RMSNorm (no mean, no bias) in float32, returned in ``x``'s dtype."""
    x = x_btd.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * w_d.astype(jnp.float32)).astype(x_btd.dtype)


def t5_layer(x_btd: jax.Array, p: Params, bias_1nts: jax.Array, cfg: T5EncoderConfig, einsum) -> jax.Array:
    """One T5 encoder block: unscaled self-attention with the position bias, then the gated MLP."""
    with jax.named_scope("attention"):
        h_btd = rms_norm(x_btd, p["attn_norm"], cfg.norm_eps)
        q_btnh = einsum("btd,dnh->btnh", h_btd, p["wq"])
        k_btnh = einsum("btd,dnh->btnh", h_btd, p["wk"])
        v_btnh = einsum("btd,dnh->btnh", h_btd, p["wv"])
        o_btnh = jax.nn.dot_product_attention(q_btnh, k_btnh, v_btnh, bias=bias_1nts, scale=1.0)
        o_btnh = constrain(o_btnh, ("batch", "seq", "act_heads", None))
        x_btd = x_btd + einsum("btnh,nhd->btd", o_btnh, p["wo"])
    with jax.named_scope("mlp"):
        h_btd = rms_norm(x_btd, p["mlp_norm"], cfg.norm_eps)
        gate_btf = ACTIVATIONS[cfg.activation](einsum("btd,df->btf", h_btd, p["w_gate"]))
        h_btf = constrain(gate_btf * einsum("btd,df->btf", h_btd, p["w_up"]), ("batch", "seq", "act_mlp"))
        x_btd = x_btd + einsum("btf,fd->btd", h_btf, p["w_down"])
    return constrain(x_btd, ("batch", "seq", "act_embed"))


def t5_encode(params: Params, cfg: T5EncoderConfig, ids_bt: jax.Array, *, dtype: Any = jnp.float32,
              quantization: str = "none") -> jax.Array:
    """T5's encoder over ids [b, t] (no attention mask, as Flux runs it): the last hidden state
    [b, t, d] in ``dtype``."""
    einsum = einsum_for(quantization, dtype)
    buckets_ts = relative_buckets(ids_bt.shape[1], cfg.num_buckets, cfg.max_distance)
    bias_tsn = jnp.take(params["position_bias"].astype(dtype), jnp.asarray(buckets_ts), axis=0)
    bias_1nts = jnp.transpose(bias_tsn, (2, 0, 1))[None]
    x_btd = constrain(embed(params["token_embed"], ids_bt, dtype), ("batch", "seq", "act_embed"))

    def body(x_btd, p):
        return t5_layer(x_btd, p, bias_1nts, cfg, einsum), None

    x_btd, _ = jax.lax.scan(body, x_btd, params["layers"])
    return rms_norm(x_btd, params["final_norm"], cfg.norm_eps)
