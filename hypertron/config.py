"""Typed configuration: frozen dataclasses, YAML recipes and ``key=value`` overrides.

A run is described by one :class:`Config`. It is built from, in order: the
defaults below, an optional YAML recipe, then command-line overrides
(``train.steps=100``, ``model=llama3-8b``, ``model.num_layers=2``). Unknown
keys, wrong types and impossible combinations raise :class:`ConfigError`
with one line that names the key, before anything is compiled.

``model`` may be given as a preset name (a string); the remaining
``model.*`` keys then modify that preset.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hypertron.errors import UserError

# The names hypertron.data.sources.SOURCES accepts (kept here so config imports no data libraries).
DATA_SOURCES = ("stdlib", "synthetic", "text", "jsonl", "parquet", "hf", "arrayrecord", "tokens")


class ConfigError(UserError):
    """A user mistake in the configuration; its message is one line naming the key."""


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1 style RoPE frequency scaling (``rope_type: llama3`` in HF configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Mixture-of-Experts MLPs: each token goes to ``top_k`` of ``num_experts`` SwiGLU experts
    of hidden size ``model.mlp_dim``."""

    num_experts: int = 8
    top_k: int = 2
    # dropless: every routed token is computed (grouped matmul); capped: at most
    # capacity_factor * seq_len * top_k / num_experts copies per expert and row, the rest dropped.
    mode: str = "dropless"  # dropless | capped
    capacity_factor: float = 1.25
    # topk_softmax: softmax over the top-k logits (Mixtral); softmax_topk: softmax over all
    # experts, then the top-k probabilities as weights (Switch / GShard, not renormalised).
    gating: str = "topk_softmax"
    shared_experts: int = 0  # dense experts every token also goes through
    load_balance_weight: float = 0.01  # Switch load-balancing loss
    router_z_weight: float = 0.001  # router z-loss
    gmm_backend: str = "auto"  # auto | pallas | ragged_dot | grouped | reference


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The decoder's architecture. One decoder covers Llama, Mistral and Gemma."""

    name: str = "custom"
    vocab_size: int = 259
    embed_dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    mlp_dim: int = 384
    activation: str = "silu"  # silu -> SwiGLU, gelu -> GeGLU (tanh approximation)
    norm_eps: float = 1e-5
    norm_zero_centered: bool = False  # Gemma: scale = 1 + w
    embed_scale: bool = False  # Gemma: embeddings times sqrt(embed_dim)
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None  # Mistral: attend to the last N positions only
    max_seq_len: int = 4096
    attention: str = "auto"  # auto | cudnn | xla | plain
    remat: str = "full"  # none | full | dots
    scan_layers: bool = True
    # Master weights stay float32 by default: in bfloat16, AdamW updates much smaller
    # than a weight round away. "auto" means the compute rule below.
    param_dtype: str = "float32"
    dtype: str = "auto"  # compute dtype; auto: float32 on CPU, bfloat16 on accelerators
    moe: MoEConfig | None = None  # Mixture-of-Experts MLPs instead of dense ones
    # Quantised training matmuls (hypertron.quant): none | fp8 | int8. Generation and serving
    # compute in the compute dtype whatever this says (serving has its own --quantize).
    quantization: str = "none"
    fp8_scaling: str = "delayed"  # delayed (amax history in the train state) | current
    amax_history: int = 16  # steps of amax kept per tensor for delayed scaling
    quantize_unembed: bool = False  # quantise the unembedding too

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh sizes. One axis may be -1: it takes the remaining devices."""

    data: int = 1
    fsdp: int = -1
    expert: int = 1  # MoE expert parallelism; a data-parallel axis outside the experts
    tensor: int = 1

    AXES: typing.ClassVar[tuple[str, ...]] = ("data", "fsdp", "expert", "tensor")

    def shape(self, num_devices: int) -> dict[str, int]:
        """Resolve -1 and check the product against ``num_devices``."""
        sizes = {a: getattr(self, a) for a in self.AXES}
        free = [a for a, s in sizes.items() if s == -1]
        if len(free) > 1:
            raise ConfigError(f"mesh: at most one axis may be -1, got {', '.join(free)}")
        for a, s in sizes.items():
            if s == 0 or s < -1:
                raise ConfigError(f"mesh.{a}={s}: sizes must be positive (or -1 for the rest)")
        fixed = 1
        for s in sizes.values():
            fixed *= s if s != -1 else 1
        if free:
            if num_devices % fixed:
                raise ConfigError(
                    f"mesh: fixed axes multiply to {fixed}, which does not divide {num_devices} devices"
                )
            sizes[free[0]] = num_devices // fixed
        prod = 1
        for s in sizes.values():
            prod *= s
        if prod != num_devices:
            desc = " x ".join(f"{a}={s}" for a, s in sizes.items())
            raise ConfigError(f"mesh: {desc} = {prod} devices, but {num_devices} are available")
        return sizes


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where training text comes from and how it is tokenised."""

    source: str = "stdlib"  # stdlib | synthetic | text | jsonl | parquet | hf | arrayrecord | tokens
    paths: tuple[str, ...] = ()
    text_field: str = "text"
    tokenizer: str = "byte"  # byte | a tokenizer.json (or its directory) | a SentencePiece .model
    shuffle: bool = True
    seed: int = 0
    eval_fraction: float = 0.0  # documents held out of training for train.eval_every (0 = none)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation and the loop."""

    steps: int = 100
    global_batch: int = 8
    seq_len: int = 128
    grad_accum: int = 1
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # 0 disables clipping
    z_loss: float = 0.0
    seed: int = 0
    log_every: int = 10
    peak_flops: float = 0.0  # per-device bf16 peak; 0 = look it up from the device kind
    init_from: str = ""  # a run directory (e.g. a converted HF model) whose parameters start this run
    eval_every: int = 0  # steps between eval-loss measurements on the held-out split (0 = off)
    eval_batches: int = 4  # global batches per evaluation


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    enabled: bool = True
    every: int = 100  # steps; a checkpoint is also written at the end
    keep: int = 3


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Multi-process runs (``jax.distributed``). Empty values fall back to the environment:
    ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (what ``hypertron launch``
    sets); under Slurm or Open MPI with several tasks JAX finds them itself."""

    coordinator: str = ""  # host:port of process 0
    num_processes: int = 0  # 0 = from the environment (1 if unset)
    process_id: int = -1  # -1 = from the environment
    initialization_timeout: int = 300  # seconds to wait for every process to join
    heartbeat_timeout: int = 100  # seconds without a heartbeat before a process is presumed dead


@dataclass(frozen=True, kw_only=True)
class Config:
    """Everything one run needs."""

    run_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


# ---------------------------------------------------------------------------
# Building configs from dicts, YAML and overrides.


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (from YAML or a ``key=value`` string) to type ``tp`` or fail naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        last: ConfigError | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                last = e
        raise last or ConfigError(f"{key}: cannot be {value!r}")
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (elem,) = typing.get_args(tp)[:1]
        return tuple(_coerce(v, elem, key) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")


def _build(cls: type, values: dict[str, Any], prefix: str = "", base: Any = None) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in values.items():
        if k not in names:
            raise ConfigError(f"unknown config key '{prefix}{k}'")
        kwargs[k] = _coerce(v, hints[k], prefix + k)
    if base is not None:
        return dataclasses.replace(base, **kwargs)
    return cls(**kwargs)


def _set_nested(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if isinstance(child, str) and p == "model":
            child = {"preset": child}
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{dotted}': '{p}' is not a section")
        node[p] = child
        node = child
    last = parts[-1]
    if last == "model" and len(parts) == 1 and isinstance(node.get("model"), dict):
        node["model"]["preset"] = value
    else:
        node[last] = value


def _resolve_model(raw: Any) -> ModelConfig:
    from hypertron.presets import PRESETS

    if raw is None:
        return PRESETS["tiny"]
    if isinstance(raw, str):
        raw = {"preset": raw}
    if not isinstance(raw, dict):
        raw = {"preset": raw}
    raw = dict(raw)
    preset = raw.pop("preset", None)
    if preset is None:
        base = PRESETS["tiny"]
    else:
        if str(preset) not in PRESETS:
            raise ConfigError(
                f"model={preset}: unknown preset (choose from {', '.join(sorted(PRESETS))})"
            )
        base = PRESETS[str(preset)]
    if isinstance(raw.get("rope_scaling"), dict):
        # Changing one field keeps the preset's others.
        raw["rope_scaling"] = _build(
            RopeScaling, raw["rope_scaling"], "model.rope_scaling.", base=base.rope_scaling or RopeScaling()
        )
    if isinstance(raw.get("moe"), dict):
        raw["moe"] = _build(MoEConfig, raw["moe"], "model.moe.", base=base.moe or MoEConfig())
    return _build(ModelConfig, raw, "model.", base=base)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Split ``key=value`` strings; one that has no ``=`` is an error naming it."""
    out = []
    for a in args:
        if "=" not in a:
            raise ConfigError(f"override '{a}' is not of the form key=value")
        k, v = a.split("=", 1)
        if not k:
            raise ConfigError(f"override '{a}' has an empty key")
        out.append((k.strip(), v))
    return out


def _parse_value(text: str) -> Any:
    """Read an override value like YAML does (numbers, booleans, lists), keeping strings as-is."""
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(v, (dict,)) or v is None and text.strip() not in ("null", "None", "~", ""):
        return text
    return text if v is None and text.strip() == "" else v


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated :class:`Config` from a YAML recipe and ``key=value`` overrides."""
    tree: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"recipe {path} must hold a mapping at the top level")
        tree = loaded
    for k, v in parse_overrides(overrides or []):
        _set_nested(tree, k, _parse_value(v))
    return from_dict(tree)


def from_dict(tree: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from a nested dict (as in a recipe)."""
    tree = dict(tree)
    model = _resolve_model(tree.pop("model", None))
    cfg = _build(Config, tree)
    cfg = dataclasses.replace(cfg, model=model)
    validate(cfg)
    return cfg


def to_dict(cfg: Any) -> Any:
    """A plain, YAML-serialisable dict of a config dataclass."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value}: must be one of {', '.join(choices)}")


def validate_model(m: ModelConfig) -> None:
    """Architecture checks that hold whatever the hardware."""
    for k in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
        if getattr(m, k) <= 0:
            raise ConfigError(f"model.{k}={getattr(m, k)}: must be positive")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}"
        )
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim}: RoPE needs an even head dimension")
    _check_choice("model.activation", m.activation, ("silu", "gelu"))
    _check_choice("model.attention", m.attention, ("auto", "cudnn", "xla", "plain"))
    _check_choice("model.remat", m.remat, ("none", "full", "dots"))
    _check_choice("model.quantization", m.quantization, ("none", "fp8", "int8"))
    _check_choice("model.fp8_scaling", m.fp8_scaling, ("delayed", "current"))
    if m.amax_history < 1:
        raise ConfigError(f"model.amax_history={m.amax_history}: must be at least 1")
    for k in ("param_dtype", "dtype"):
        # No float16: training it needs loss scaling, which hypertron does not do.
        _check_choice(f"model.{k}", getattr(m, k), ("auto", "float32", "bfloat16"))
    if m.norm_eps <= 0:
        raise ConfigError(f"model.norm_eps={m.norm_eps}: must be positive")
    if m.rope_theta <= 0:
        raise ConfigError(f"model.rope_theta={m.rope_theta}: must be positive")
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        if rs.factor <= 0 or rs.original_max_position <= 0:
            raise ConfigError("model.rope_scaling: factor and original_max_position must be positive")
        if not 0 < rs.low_freq_factor < rs.high_freq_factor:
            raise ConfigError("model.rope_scaling: need 0 < low_freq_factor < high_freq_factor")
    if m.sliding_window is not None and m.sliding_window <= 0:
        raise ConfigError(f"model.sliding_window={m.sliding_window}: must be positive")
    if m.moe is not None:
        e = m.moe
        if e.num_experts <= 0 or not 0 < e.top_k <= e.num_experts:
            raise ConfigError(
                f"model.moe.top_k={e.top_k} must be in 1..model.moe.num_experts ({e.num_experts})"
            )
        if e.top_k == 1 and e.gating == "topk_softmax":
            raise ConfigError("model.moe.top_k=1 with gating=topk_softmax gives every token weight 1, so the "
                              "router learns nothing from the loss; use model.moe.gating=softmax_topk")
        _check_choice("model.moe.mode", e.mode, ("dropless", "capped"))
        _check_choice("model.moe.gating", e.gating, ("topk_softmax", "softmax_topk"))
        _check_choice("model.moe.gmm_backend", e.gmm_backend, ("auto", "pallas", "ragged_dot", "grouped", "reference"))
        if e.capacity_factor <= 0:
            raise ConfigError(f"model.moe.capacity_factor={e.capacity_factor}: must be positive")
        if e.shared_experts < 0 or e.load_balance_weight < 0 or e.router_z_weight < 0:
            raise ConfigError("model.moe.shared_experts, load_balance_weight and router_z_weight must not be negative")


def validate(cfg: Config) -> None:
    """Checks that need no devices. Mesh and batch divisibility are checked in :func:`validate_for_devices`."""
    validate_model(cfg.model)
    t = cfg.train
    for k in ("steps", "global_batch", "seq_len", "grad_accum", "log_every"):
        if getattr(t, k) <= 0:
            raise ConfigError(f"train.{k}={getattr(t, k)}: must be positive")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps}: must not be negative")
    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr}: must be positive")
    _check_choice("train.schedule", t.schedule, ("cosine", "linear", "constant"))
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio}: must be between 0 and 1")
    if t.clip_norm < 0 or t.weight_decay < 0 or t.z_loss < 0:
        raise ConfigError("train.clip_norm, train.weight_decay and train.z_loss must not be negative")
    if not cfg.run_dir.strip():
        raise ConfigError("run_dir: must not be empty")
    if t.eval_every < 0 or t.eval_batches <= 0:
        raise ConfigError("train.eval_every must not be negative and train.eval_batches must be positive")
    if not 0 <= cfg.data.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={cfg.data.eval_fraction}: must be in [0, 1)")
    if t.eval_every and cfg.data.source != "synthetic" and cfg.data.eval_fraction == 0:
        raise ConfigError(
            f"train.eval_every={t.eval_every} needs a held-out split: set data.eval_fraction (e.g. 0.01)"
        )
    if t.global_batch % t.grad_accum:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by train.grad_accum={t.grad_accum}"
        )
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}"
        )
    _check_choice("data.source", cfg.data.source, DATA_SOURCES)
    if not cfg.data.tokenizer.strip():
        raise ConfigError("data.tokenizer: must be 'byte' or a path to a tokenizer")
    if cfg.data.source not in ("stdlib", "synthetic") and not cfg.data.paths:
        raise ConfigError(f"data.paths: data.source={cfg.data.source} needs at least one path")
    if cfg.checkpoint.every <= 0 or cfg.checkpoint.keep <= 0:
        raise ConfigError("checkpoint.every and checkpoint.keep must be positive")
    d = cfg.distributed
    if d.num_processes < 0 or d.process_id < -1 or (d.num_processes and d.process_id >= d.num_processes):
        raise ConfigError(
            f"distributed.process_id={d.process_id} must be in 0..num_processes-1 (num_processes={d.num_processes})"
        )
    if d.initialization_timeout <= 0 or d.heartbeat_timeout <= 0:
        raise ConfigError("distributed.initialization_timeout and distributed.heartbeat_timeout must be positive")
    for a in MeshConfig.AXES:
        s = getattr(cfg.mesh, a)
        if s == 0 or s < -1:
            raise ConfigError(f"mesh.{a}={s}: sizes must be positive (or -1 for the rest)")


def validate_for_devices(cfg: Config, num_devices: int) -> dict[str, int]:
    """Checks for training on these devices; returns the resolved mesh shape."""
    import jax

    if cfg.model.attention == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(f"model.attention=cudnn needs an NVIDIA GPU; this backend is {jax.default_backend()}")
    if cfg.data.source != "synthetic":
        from hypertron.data import get_tokenizer

        tok = get_tokenizer(cfg.data.tokenizer)
        if cfg.model.vocab_size < tok.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size}: the tokenizer {cfg.data.tokenizer} needs at least "
                f"{tok.vocab_size}"
            )
    shape = cfg.mesh.shape(num_devices)
    data_shards = shape["data"] * shape["fsdp"] * shape["expert"]
    micro = cfg.train.global_batch // cfg.train.grad_accum
    if micro % data_shards:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} (micro-batch {micro}) is not divisible "
            f"by the {data_shards} data shards (mesh data x fsdp x expert)"
        )
    moe = cfg.model.moe
    if shape["expert"] > 1 and moe is not None and moe.num_experts % shape["expert"]:
        raise ConfigError(
            f"mesh.expert={shape['expert']} does not divide model.moe.num_experts={moe.num_experts}"
        )
    processes = jax.process_count()
    if processes > 1:
        # Each process feeds its own rows, so the batch axes must split over the processes and a
        # tensor-parallel group must not span two of them (its devices would get different rows).
        if data_shards % processes:
            raise ConfigError(
                f"mesh: the {data_shards} data shards (data x fsdp x expert) do not divide over {processes} processes"
            )
        if jax.local_device_count() % shape["tensor"]:
            raise ConfigError(
                f"mesh.tensor={shape['tensor']} does not divide the {jax.local_device_count()} devices of a process"
            )
    return shape
