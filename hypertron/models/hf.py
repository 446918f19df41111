"""Hugging Face interop: ``config.json`` + safetensors checkpoints to and from hypertron.

Covers the families the shared decoder implements: Llama 2/3/3.1
(``model_type: llama``, incl. ``rope_type: llama3``), Mistral (sliding window),
Gemma (GeGLU, zero-centred norms, scaled and tied embeddings) and Mixtral
(top-2 of 8 experts; experts stored one tensor each, ``block_sparse_moe.*``). Anything
else is refused with :class:`HFError` rather than loaded into a model that
would compute something different.

Only numpy, ``safetensors`` and ``ml_dtypes`` are needed at run time (no
torch). The tensor mapping comes from the parameter declarations
(:func:`hypertron.models.decoder.declare`): each parameter carries its HF name
(with ``{layer}`` / ``{expert}`` for stacked axes stored one tensor per index)
and one of four layout rules, and :func:`declared_tensors` expands them. RoPE uses HF's
"rotate_half" layout in both, so attention projections need no permutation,
only a transpose and a split of the fused head axis; Gemma norms are stored
zero-centred on both sides, so they are copied as they are.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

# Registers bfloat16 with numpy, so safetensors' numpy API can read bf16 checkpoints.
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from hypertron.config import ModelConfig, MoEConfig, RopeScaling, validate_model
from hypertron.config.loading import read_json
from hypertron.errors import ConfigError, UserError
from hypertron.models.decoder import declare
from hypertron.models.params import ParamSpec, leaves_with_paths

Params = dict[str, Any]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFError(UserError):
    """A checkpoint or config this converter cannot read or write; the message is one line."""


# ---------------------------------------------------------------------------
# Configs

@dataclass(frozen=True)
class Family:
    """One HF ``model_type`` the shared decoder computes exactly: what :func:`config_from_hf`,
    :func:`config_to_hf` and the tests need of it. A family is a record here, not a branch."""

    model_type: str
    architecture: str                # its ``architectures`` entry
    hf_defaults: dict[str, Any]      # the HF config class's defaults for keys a config.json may leave out
    hidden_acts: tuple[str, ...]     # the ``hidden_act`` values it reads
    sets: dict[str, Any]             # what it sets in ModelConfig beyond the shared keys
    reads_window: bool               # whether its attention reads ``sliding_window`` (elsewhere a stray key is ignored)
    # Whether it computes what a (validated, HF-expressible) config does; None: the family a config
    # falls back to when no other family's holds.
    exports: Callable[[ModelConfig], bool] | None
    extra: Callable[[ModelConfig], dict] = lambda cfg: {}  # keys config_to_hf writes for it beyond the shared ones
    experts: bool = False            # whether its config carries Mixtral's expert keys
    tiny: dict[str, Any] = field(default_factory=dict)  # a tiny HF config (the tests build their models from it)


def _gemma_bits(cfg: ModelConfig) -> tuple[bool, bool, bool]:
    return cfg.norm_zero_centered, cfg.embed_scale, cfg.activation == "gelu"


def _mixtral_extra(cfg: ModelConfig) -> dict:
    return {"attention_bias": False, "sliding_window": cfg.sliding_window, "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.top_k, "output_router_logits": False,
            # transformers' load-balancing loss is top_k times ours (it counts tokens, not copies).
            "router_aux_loss_coef": cfg.moe.load_balance_weight / cfg.moe.top_k}


_DEFAULTS = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", head_dim=None, sliding_window=None)
# Gemma's legacy ``gelu`` means the tanh approximation too (transformers rewrites it so).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu", "gelu_new")

# config_to_hf names a config by the first family whose ``exports`` holds, else by llama's.
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("mixtral", "MixtralForCausalLM",
           {**_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "num_local_experts": 8,
            "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
           ("silu",), {"activation": "silu"}, reads_window=True, exports=lambda cfg: cfg.moe is not None,
           extra=_mixtral_extra, experts=True,
           tiny=dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=4, num_experts_per_tok=2, sliding_window=6)),
    Family("gemma", "GemmaForCausalLM",
           {**_DEFAULTS, "max_position_embeddings": 8192, "tie_word_embeddings": True,
            "hidden_act": "gelu_pytorch_tanh", "head_dim": 256},
           _GELU_TANH, {"activation": "gelu", "norm_zero_centered": True, "embed_scale": True},
           reads_window=False, exports=lambda cfg: all(_gemma_bits(cfg)),
           extra=lambda cfg: {"attention_bias": False, "hidden_act": "gelu_pytorch_tanh",
                              "hidden_activation": "gelu_pytorch_tanh"},
           tiny=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=1,
                     head_dim=16)),
    Family("mistral", "MistralForCausalLM", {**_DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096},
           ("silu",), {"activation": "silu"}, reads_window=True, exports=lambda cfg: cfg.sliding_window is not None,
           extra=lambda cfg: {"sliding_window": cfg.sliding_window},
           tiny=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                     sliding_window=4)),
    Family("llama", "LlamaForCausalLM", {**_DEFAULTS, "max_position_embeddings": 2048},
           ("silu",), {"activation": "silu"}, reads_window=False, exports=None,
           extra=lambda cfg: {"attention_bias": False, "mlp_bias": False},
           tiny=dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4)),
)}


def _require(hf: dict, key: str) -> Any:
    if hf.get(key) is None:
        raise HFError(f"HF config: missing '{key}'")
    return hf[key]


def _rope_from_hf(hf: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x)."""
    # transformers itself lets a legacy ``rope_scaling`` win over ``rope_parameters``.
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise HFError(f"HF config: rope parameters {rope!r} are not a mapping")
    if "rope_type" not in rope and "type" not in rope and any(isinstance(v, dict) for v in rope.values()):
        raise HFError("HF config: per-layer-type RoPE parameters are not supported")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise HFError("HF config: partial_rotary_factor != 1 is not supported")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise HFError(f"HF config: rope_type '{kind}' is not supported (only default and llama3)")
    original = rope.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return theta, RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position=int(original),
    )


def config_from_hf(hf: dict, name: str | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of an HF ``config.json`` dict (a model_type of :data:`FAMILIES`).

    ``name`` defaults to the ``model_type``. Dtypes are left ``auto``: the
    checkpoint's storage dtype is a property of the file, not the model.
    Raises :class:`HFError` naming the first unsupported feature.
    """
    family = FAMILIES.get(hf.get("model_type"))
    if family is None:
        raise HFError(
            f"HF config: model_type '{hf.get('model_type')}' is not supported (choose from {', '.join(FAMILIES)})"
        )
    get = lambda k: hf[k] if k in hf else family.hf_defaults[k]  # noqa: E731
    for flag in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
        if hf.get(flag):
            raise HFError(f"HF config: {flag}=true is not supported")

    act = hf.get("hidden_activation") or get("hidden_act")  # Gemma 1 configs may use either key
    if act not in family.hidden_acts:
        raise HFError(f"HF config: hidden_act '{act}' is not supported for model_type {family.model_type}")

    d = int(_require(hf, "hidden_size"))
    n = int(_require(hf, "num_attention_heads"))
    head_dim = get("head_dim") or d // n
    theta, scaling = _rope_from_hf(hf)
    # Only some families' attention reads sliding_window; a stray key elsewhere must not change the model.
    window = get("sliding_window") if family.reads_window else None
    window = None if window is None else int(window)
    cfg = ModelConfig(
        name=name or family.model_type,
        vocab_size=int(_require(hf, "vocab_size")),
        embed_dim=d,
        num_layers=int(_require(hf, "num_hidden_layers")),
        num_heads=n,
        num_kv_heads=int(hf.get("num_key_value_heads") or n),
        head_dim=int(head_dim),
        mlp_dim=int(_require(hf, "intermediate_size")),
        norm_eps=float(get("rms_norm_eps")),
        tie_embeddings=bool(get("tie_word_embeddings")),
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=window,
        max_seq_len=int(get("max_position_embeddings")),
        moe=None if not family.experts else MoEConfig(
            num_experts=int(get("num_local_experts")), top_k=int(get("num_experts_per_tok")),
            # transformers' load-balancing loss is top_k times ours (it counts tokens, not copies).
            load_balance_weight=float(get("router_aux_loss_coef")) * int(get("num_experts_per_tok")),
            router_z_weight=0.0,
        ),
        **family.sets,
    )
    try:
        validate_model(cfg)
    except ConfigError as e:
        raise HFError(f"HF config: {e}") from None
    return cfg


def _family_of(cfg: ModelConfig) -> Family:
    """The HF family that computes exactly what ``cfg`` computes, or HFError for a mix that no
    HF model_type has."""
    if cfg.moe is not None and (cfg.moe.gating != "topk_softmax" or cfg.moe.shared_experts or cfg.activation != "silu"
                                or cfg.norm_zero_centered or cfg.embed_scale or cfg.rope_scaling is not None):
        raise HFError("config_to_hf: of MoE models, only Mixtral's (topk_softmax gating, no shared "
                      "experts, SwiGLU, plain RoPE) exists in HF")
    gemma_bits = _gemma_bits(cfg)
    if any(gemma_bits) and not all(gemma_bits):
        raise HFError(
            "config_to_hf: norm_zero_centered, embed_scale and activation=gelu come together "
            "(Gemma) in HF; this mix has no HF model_type"
        )
    if all(gemma_bits) and (cfg.sliding_window is not None or cfg.rope_scaling is not None):
        raise HFError("config_to_hf: Gemma has no sliding_window or rope_scaling in HF")
    if cfg.moe is None and cfg.sliding_window is not None and cfg.rope_scaling is not None:
        raise HFError("config_to_hf: Mistral has no llama3 rope_scaling in HF")
    specific = [f for f in FAMILIES.values() if f.exports is not None and f.exports(cfg)]
    return specific[0] if specific else next(f for f in FAMILIES.values() if f.exports is None)


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """An HF ``config.json`` dict for ``cfg``; ``dtype`` is the checkpoint's storage dtype.

    The model_type is the first of :data:`FAMILIES` that computes what ``cfg`` does (mixtral with
    experts, gemma with zero-centred norms, mistral with a sliding window, else llama). RoPE is
    written both ways (``rope_parameters``
    for transformers 5, ``rope_theta`` + ``rope_scaling`` for 4.x).
    """
    family = _family_of(cfg)
    rope: dict[str, Any] = {"rope_type": "default"}
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        rope = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position,
        }
    hf: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else dict(rope),
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    hf |= family.extra(cfg)
    return hf


# ---------------------------------------------------------------------------
# Tensors: names and layouts come from the declarations (ParamSpec.hf, ParamSpec.hf_layout);
# the layout rules are described at hypertron.models.params.HFLayout.


def _ours_from_hf(rule: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if rule == "same":
        return w
    if rule == "conv":
        return w.transpose(2, 3, 1, 0)  # OIHW -> HWIO
    return w.T.reshape(shape)  # linear: [in, out]; heads_in: [D, n, h]; heads_out: [n, h, D]


def _hf_from_ours(rule: str, w: np.ndarray) -> np.ndarray:
    if rule == "same":
        return w
    if rule == "conv":
        return w.transpose(3, 2, 0, 1)  # HWIO -> OIHW
    if rule == "heads_in":
        w = w.reshape(w.shape[0], -1)  # [D, n*h]
    elif rule == "heads_out":
        w = w.reshape(-1, w.shape[-1])  # [n*h, D]
    return w.T


def _hf_shape(rule: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if rule == "same":
        return shape
    if rule == "linear":
        return shape[::-1]
    if rule == "conv":
        return (shape[3], shape[2], shape[0], shape[1])
    if rule == "heads_in":
        return (math.prod(shape[1:]), shape[0])
    return (shape[-1], math.prod(shape[:-1]))


# The axes whose indices are separate HF tensors, and the placeholder each index fills in the name.
_SPLIT_AXES = {"layers": "layer", "expert": "expert"}


class _Tensor(NamedTuple):
    """One HF tensor: the parameter (key path) it is part of, the index into that parameter along
    its split axes, the tensor's HF name, and the parameter's declaration."""

    path: tuple[str, ...]
    index: tuple[int, ...]
    name: str
    spec: ParamSpec

    @property
    def shape(self) -> tuple[int, ...]:
        """Our shape of this one tensor (the parameter's, without the split axes)."""
        return self.spec.shape[len(self.index):]


def declared_tensors(specs: Params, name: str) -> list[_Tensor]:
    """Every HF tensor of the parameters declared in ``specs`` (of the model ``name``), in checkpoint
    order: the parameters declared before the layers, then layer by layer, then the rest. A
    parameter without an HF name refuses export."""
    before, layers, after = [], [], []
    past_layers = False
    for path, spec in leaves_with_paths(specs):
        if spec.hf is None:
            raise HFError(f"parameter {'/'.join(path)} of {name} has no Hugging Face name")
        split = [a for a in spec.axes if a in _SPLIT_AXES and "{" + _SPLIT_AXES[a] + "}" in spec.hf]
        if tuple(spec.axes[:len(split)]) != tuple(split):
            raise ValueError(f"{'/'.join(path)}: the axes {split} stored one tensor per index must lead")
        for index in itertools.product(*(range(n) for n in spec.shape[:len(split)])):
            tensor_name = spec.hf.format(**{_SPLIT_AXES[a]: i for a, i in zip(split, index)})
            tensor = _Tensor(path, index, tensor_name, spec)
            (layers if split[:1] == ["layers"] else after if past_layers else before).append(tensor)
        past_layers |= path[0] == "layers"
    layers.sort(key=lambda t: t.index[0])  # stable: a layer's tensors in declaration order
    return before + layers + after


# Non-persistent buffers some older exports still carry; they are recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _np_dtype(dtype: Any) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if str(dtype) == "bfloat16" else np.dtype(dtype)


def _check_shape(name: str, w: np.ndarray, rule: str, ours: tuple[int, ...], where: str) -> None:
    want = _hf_shape(rule, ours)
    if tuple(w.shape) != want:
        raise HFError(f"tensor {name} of {where}: shape {tuple(w.shape)}, config expects {want}")


def from_hf_tensors(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype: Any = None) -> Params:
    """hypertron parameters from HF-named tensors (a dict, or a lazy mapping over files).

    Per-layer tensors ``model.layers.{i}.*`` are stacked on a leading layer
    axis: e.g. ``q_proj.weight`` [N*H, D] x L -> ``layers/wq`` [L, D, N, H].
    ``dtype`` None keeps each tensor's dtype. Tensors are read one at a time,
    so a lazy mapping never holds more than the output plus one tensor.
    Missing, misshapen or unexpected tensors raise :class:`HFError`.
    """
    # Tied checkpoints sometimes store lm_head anyway; accept it if it really is the embedding.
    extra = {"lm_head.weight"} if cfg.tie_embeddings else set()
    params = params_from_hf(declare(cfg), tensors, dtype, cfg.name, ignored=extra)
    if cfg.tie_embeddings and "lm_head.weight" in tensors:
        lm = np.asarray(tensors["lm_head.weight"])
        if lm.shape != params["embed"].shape or not np.array_equal(lm.astype(params["embed"].dtype), params["embed"]):
            raise HFError("tensor lm_head.weight differs from the embedding, but the config ties them")
    return params


def params_from_hf(specs: Params, tensors: Mapping[str, np.ndarray], dtype: Any, where: str, *,
                   ignored: Iterable[str] = ()) -> Params:
    """The parameters declared in ``specs`` from the HF-named ``tensors``, each by its declared
    ``hf`` name and layout (what :func:`from_hf_tensors` does for the decoder). ``dtype`` None keeps
    each tensor's dtype; tensor names in ``ignored`` may be present and are not read. A missing,
    misshapen or unexpected tensor is an :class:`HFError` naming it and ``where`` (the model or file)."""
    names = set(tensors.keys())
    table = declared_tensors(specs, where)
    expected = {t.name for t in table}
    unexpected = sorted(n for n in names - expected - set(ignored) if not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise HFError(f"unexpected tensor {unexpected[0]} ({len(unexpected)} in all) for {where}")
    missing = sorted(expected - names)
    if missing:
        raise HFError(f"missing tensor {missing[0]} ({len(missing)} in all) for {where}")

    params: Params = {}
    for t in table:
        w = np.asarray(tensors[t.name])
        _check_shape(t.name, w, t.spec.hf_layout, t.shape, where)
        w = _ours_from_hf(t.spec.hf_layout, w, t.shape)
        w = w if dtype is None else w.astype(_np_dtype(dtype))
        *parents, key = t.path
        node = params
        for p in parents:
            node = node.setdefault(p, {})
        if not t.index:
            node[key] = np.ascontiguousarray(w)
            continue
        if key not in node:
            node[key] = np.empty(t.spec.shape, w.dtype)
        node[key][t.index] = w
    return params


def to_hf_tensors(cfg: ModelConfig, params: Params, dtype: Any = None) -> dict[str, np.ndarray]:
    """HF-named, C-contiguous numpy tensors of hypertron ``params`` (the inverse of
    :func:`from_hf_tensors`); ``dtype`` None keeps each parameter's dtype.

    Tied models write no ``lm_head.weight``, as transformers does.
    """
    return declared_to_hf(declare(cfg), params, cfg.name, dtype)


def declared_to_hf(specs: Params, params: Params, name: str, dtype: Any = None) -> dict[str, np.ndarray]:
    """HF-named, C-contiguous numpy tensors of ``params`` declared by ``specs`` (of the model
    ``name``; a diffusers component's too): the inverse of :func:`params_from_hf`."""
    def out(w: Any, rule: str) -> np.ndarray:
        w = _hf_from_ours(rule, np.asarray(w))
        return np.ascontiguousarray(w if dtype is None else w.astype(_np_dtype(dtype)))

    tensors = {}
    for t in declared_tensors(specs, name):
        w = params
        for key in t.path:
            w = w[key]
        if not any(t.index):
            _check_ours("/".join(t.path), w, t.spec.shape)  # each parameter once, whole
        tensors[t.name] = out(w[t.index] if t.index else w, t.spec.hf_layout)
    return tensors


def _check_ours(key: str, w: Any, shape: tuple[int, ...]) -> None:
    if tuple(w.shape) != tuple(shape):
        raise HFError(f"parameter {key}: shape {tuple(w.shape)}, config declares {tuple(shape)}")


# ---------------------------------------------------------------------------
# Files


class _SafetensorsFiles(Mapping):
    """Read-only name -> numpy array view over one or more open safetensors files."""

    def __init__(self, files: list[Path], stack: contextlib.ExitStack):
        self._where: dict[str, Any] = {}
        for f in files:
            handle = stack.enter_context(safe_open(str(f), framework="np"))
            for name in handle.keys():
                if name in self._where:
                    raise HFError(f"{f}: tensor {name} is also in another shard")
                self._where[name] = handle

    def __getitem__(self, name: str) -> np.ndarray:
        return self._where[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _checkpoint_files(path: Path, file: str = SINGLE_FILE) -> list[Path]:
    single, index = path / file, path / f"{file}.index.json"  # INDEX_FILE for model.safetensors
    if single.is_file():
        return [single]
    if not index.is_file():
        raise HFError(f"{path}: no {single.name} or {index.name} (only safetensors checkpoints load)")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise HFError(f"{index}: not a safetensors index (no weight_map)") from None
    files = [path / f for f in dict.fromkeys(weight_map.values())]
    for f in files:
        if not f.is_file():
            raise HFError(f"{f}: shard named in {index.name} is missing")
    return files


@contextlib.contextmanager
def checkpoint_tensors(path: Path, file: str = SINGLE_FILE) -> Iterator[Mapping[str, np.ndarray]]:
    """The tensors of the safetensors checkpoint in the directory ``path`` (``file``, or its
    ``.index.json`` and the shards it names; diffusers' ``diffusion_pytorch_model.safetensors``), as a
    lazy name -> numpy mapping open while the context is."""
    files = _checkpoint_files(path, file)
    with contextlib.ExitStack() as stack:
        yield _SafetensorsFiles(files, stack)


def load_hf(path: str | Path, dtype: Any = None) -> tuple[ModelConfig, Params]:
    """Read an HF checkpoint directory: ``config.json`` and ``model.safetensors``
    (or ``model.safetensors.index.json`` and its shards).

    Returns ``(cfg, params)`` with params as numpy arrays in ``dtype``
    (float32 when None; ``"bfloat16"`` keeps bf16 checkpoints at half the memory).
    """
    path = Path(path)
    config_file = path / "config.json"
    hf = read_json(config_file, HFError, f"{config_file}: not found",
                   lambda reason: f"{config_file}: invalid JSON ({reason})")
    cfg = config_from_hf(hf, name=path.resolve().name)
    with checkpoint_tensors(path) as tensors:
        params = from_hf_tensors(cfg, tensors, np.float32 if dtype is None else dtype)
    return cfg, params


def _plan_shards(tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most ``max_shard_bytes``
    (a single larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, w in tensors.items():
        if shards[-1] and size + w.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += w.nbytes
    return shards


def save_hf(
    path: str | Path,
    cfg: ModelConfig,
    params: Params,
    *,
    max_shard_bytes: int = 5 * 2**30,
    dtype: Any = None,
) -> None:
    """Write ``params`` as an HF checkpoint directory that ``from_pretrained`` loads.

    One ``model.safetensors`` when it fits in ``max_shard_bytes``, else
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.
    ``dtype`` None keeps the parameters' dtype. Refuses to write into an existing
    non-empty directory.
    """
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise HFError(f"{path}: exists and is not an empty directory; refusing to overwrite")
    tensors = to_hf_tensors(cfg, params, dtype)
    stored = tensors["model.embed_tokens.weight"].dtype
    hf = config_to_hf(cfg, dtype=stored.name)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    # transformers checks this metadata key before loading a safetensors file.
    meta = {"format": "pt"}
    shards = _plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, path / SINGLE_FILE, metadata=meta)
        return
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, path / fname, metadata=meta)
        weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": sum(w.nbytes for w in tensors.values())}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
