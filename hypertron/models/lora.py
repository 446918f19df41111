"""LoRA adapters, derived from the parameter declarations, in PEFT's format both ways.

An adapter exists for each declared hook-matmul weight (``ParamSpec.einsum``) whose Hugging Face
module name (``q_proj`` of ``model.layers.{layer}.self_attn.q_proj.weight``) is among the targets:
PEFT's names, or ``all-linear`` for the seven projections of a decoder layer. No other list of
names is kept. A weight ``[*stack, *in, *out]`` (its einsum's input letters, then output letters;
``stack`` the scanned ``layers``) gets ``A [*stack, *in, r]`` and ``B [*stack, r, *out]``; the
hook (:class:`hypertron.quant.lora.LoraWeight`) adds ``scale * (x A) B`` to the base's product,
``scale`` being ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), as PEFT's.

PEFT's files: ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``) and ``adapter_model.safetensors`` with
``base_model.model.<module>.lora_A.weight [r, in]`` and ``lora_B.weight [out, r]`` per layer,
the HF weight being ``[out, in]``: ours is its transpose reshaped (the ``linear``, ``heads_in`` and
``heads_out`` layouts of :mod:`hypertron.models.hf`), so ``A`` is ``lora_A``'s transpose reshaped
and ``B`` ``lora_B``'s.

Serving many adapters in one batch is :mod:`hypertron.serve.lora_slots`'s. MoE expert weights,
DoRA, biases and other PEFT features are refused in one line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config import ModelConfig
from hypertron.errors import ConfigError
from hypertron.models.decoder import declare
from hypertron.models.params import ParamSpec, leaves_with_paths
from hypertron.quant.lora import LoraWeight, split_letters

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # a PeftModel's tensor names: this, then the module's
_LAYOUTS = ("linear", "heads_in", "heads_out")  # HF [out, in] -> ours: the transpose, reshaped


@dataclass(frozen=True)
class LoraSettings:
    """An adapter's hyper-parameters: ``rank`` r, ``alpha``, the PEFT module names it targets,
    rsLoRA's scaling."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = ALL_LINEAR
    rslora: bool = False

    def __post_init__(self):
        if self.rank <= 0:
            raise ConfigError(f"lora.rank={self.rank}: must be positive")
        order = {m: i for i, m in enumerate(ALL_LINEAR)}  # one spelling of a set of targets: the layer's order
        object.__setattr__(self, "targets", tuple(sorted(set(self.targets), key=lambda m: (order.get(m, 99), m))))

    @classmethod
    def of(cls, lora) -> LoraSettings:
        """The settings of a run's ``lora:`` section (:class:`hypertron.config.schema.LoraConfig`)."""
        return cls(rank=lora.rank, alpha=lora.alpha, targets=tuple(lora.targets), rslora=lora.rslora)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass(frozen=True)
class _Target:
    path: tuple[str, ...]  # the parameter's key path
    spec: ParamSpec
    module: str  # PEFT's module name
    stack: tuple[int, ...]  # the stacking axes' sizes
    ins: tuple[int, ...]  # the input letters' sizes
    outs: tuple[int, ...]


def targets(model: ModelConfig | dict, modules: tuple[str, ...] | str = ALL_LINEAR) -> list[_Target]:
    """The declared weights an adapter on ``modules`` covers: of a decoder (``model`` a config) or
    of any declaration tree (a diffusion denoiser's). A module is named as PEFT matches it, the
    end of the weight's Hugging Face module path (``q_proj``, ``to_out.0``); ``"all-linear"``: a
    decoder layer's seven projections. A :class:`ConfigError` for a module the model does not have
    as a hook matmul, or one of MoE experts."""
    decoder = isinstance(model, ModelConfig)
    wanted = ALL_LINEAR if modules in ("all-linear", ("all-linear",)) else tuple(modules)
    found, out, names = set(), [], set()
    for path, spec in leaves_with_paths(declare(model) if decoder else model):
        if spec.einsum is None or spec.hf is None or not spec.hf.endswith(".weight"):
            continue
        where = spec.hf.removesuffix(".weight")
        names.add(_short(where))
        module = next((m for m in wanted if where == m or where.endswith("." + m)), None)
        if module is None:
            continue
        if "expert" in spec.axes:
            raise ConfigError(f"lora: {module} is an MoE expert weight, which adapters do not cover yet")
        _, ins, outs, _ = split_letters(spec.einsum)
        n_stack = len(spec.shape) - len(ins) - len(outs)
        shape = spec.shape
        out.append(_Target(path, spec, module, shape[:n_stack], shape[n_stack:n_stack + len(ins)],
                           shape[n_stack + len(ins):]))
        found.add(module)
    missing = [m for m in wanted if m not in found]
    if missing:
        have = ALL_LINEAR if decoder else sorted(names)
        raise ConfigError(f"lora: {model.name if decoder else 'the denoiser'} has no {', '.join(missing)} to adapt "
                          f"(its projections: {', '.join(have)})")
    return out


def _short(where: str) -> str:
    """The name a module is targeted by, from its path: ``q_proj``, ``to_out.0``."""
    head, _, last = where.rpartition(".")
    return f"{head.rpartition('.')[2]}.{last}" if last.isdigit() else last


def init_adapters(cfg: ModelConfig | dict, settings: LoraSettings, key: jax.Array, dtype=jnp.float32) -> dict:
    """New adapters, as PEFT initialises them: ``A`` uniform in +-1/sqrt(fan-in) (Kaiming-uniform
    with a = sqrt(5)), ``B`` zeros (the adapter starts as no change)."""
    out: dict = {}
    for i, t in enumerate(targets(cfg, settings.targets)):
        fan_in = math.prod(t.ins)
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(jax.random.fold_in(key, i), (*t.stack, *t.ins, settings.rank), dtype, -bound, bound)
        b = jnp.zeros((*t.stack, settings.rank, *t.outs), dtype)
        _put(out, t.path, {"a": a, "b": b})
    return out


def adapter_axes(cfg: ModelConfig | dict, settings: LoraSettings) -> dict:
    """The logical axes of :func:`init_adapters`' tree: each weight's own for ``A``'s input and
    ``B``'s output dimensions (and the stacking ``layers``), None (never sharded) for the rank."""
    out: dict = {}
    for t in targets(cfg, settings.targets):
        axes, n_stack, n_in = t.spec.axes, len(t.stack), len(t.ins)
        _put(out, t.path, {"a": (*axes[:n_stack + n_in], None), "b": (*axes[:n_stack], None, *axes[n_stack + n_in:])})
    return out


def held_base(cfg: ModelConfig | dict, params: dict, base_dtype: str) -> dict:
    """A frozen base (a decoder's, ``cfg`` its config; or any declaration tree's, a diffusion
    denoiser's) as adapters train on it (``lora.base_dtype``): ``auto`` as it is; ``bfloat16``
    its matmul weights in bfloat16; ``int8`` its matmul weights int8 with a scale per output
    channel (:func:`hypertron.models.params.quantize_params`, serving's int8); ``fp8`` the same in
    float8_e4m3fn (one byte a weight as int8; 3 mantissa bits, relative to each value rather than
    to its channel's largest). The matmuls read either in the compute dtype. Norms stay float32."""
    from hypertron.models.params import cast_params, quantize_params

    specs = declare(cfg) if isinstance(cfg, ModelConfig) else cfg
    if base_dtype in ("int8", "fp8"):
        return quantize_params(specs, params, jnp.int8 if base_dtype == "int8" else jnp.float8_e4m3fn)
    if base_dtype == "bfloat16":
        return cast_params(specs, params, jnp.bfloat16)
    return params


def attach(params: dict, adapters: dict, settings: LoraSettings) -> dict:
    """``params`` with each adapted weight wrapped as :class:`LoraWeight` (the einsum hook adds the
    adapter; the base is not changed)."""
    def walk(p, a):
        if isinstance(a, dict) and set(a) == {"a", "b"}:
            return LoraWeight(p, a["a"], a["b"], settings.scale)
        return {k: (walk(v, a[k]) if k in a else v) for k, v in p.items()}
    return walk(params, adapters)


def merge(params: dict, adapters: dict, settings: LoraSettings, sign: float = 1.0) -> dict:
    """``params`` with each adapted weight replaced by ``W + scale A B`` (``sign=-1``: :func:`unmerge`)."""
    def walk(p, a):
        if isinstance(a, dict) and set(a) == {"a", "b"}:
            return (p + sign * settings.scale * _product(a["a"], a["b"], p.ndim)).astype(p.dtype)
        return {k: (walk(v, a[k]) if k in a else v) for k, v in p.items()}
    return walk(params, adapters)


def unmerge(params: dict, adapters: dict, settings: LoraSettings) -> dict:
    """The inverse of :func:`merge` (to float rounding)."""
    return merge(params, adapters, settings, sign=-1.0)


def _product(a: jax.Array, b: jax.Array, weight_ndim: int) -> jax.Array:
    """``A B`` over the rank, per stacking index: ``[*stack, *in, r] x [*stack, r, *out]``."""
    n_stack = a.ndim + b.ndim - 2 - weight_ndim
    n_in = a.ndim - 1 - n_stack
    letters = "abcdefghijklmnopq"
    stack, ins, outs = letters[:n_stack], letters[n_stack:n_stack + n_in], letters[n_stack + n_in:weight_ndim]
    return jnp.einsum(f"{stack}{ins}z,{stack}z{outs}->{stack}{ins}{outs}", a, b, precision=jax.lax.Precision.HIGHEST)


# ---------------------------------------------------------------------------
# PEFT's files


def peft_config(path: str | Path) -> dict:
    """A PEFT adapter directory's ``adapter_config.json``; a :class:`ConfigError` if it has none
    or it is not a JSON object."""
    path = Path(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"lora: {path} is not a PEFT adapter directory ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"lora: {path}/{CONFIG_FILE} is not a JSON object")
    return config


def peft_modules(config: dict, path: str | Path) -> tuple[str, ...]:
    """The module names an adapter config targets (``all-linear`` spelled out); a pattern is refused."""
    modules = config.get("target_modules") or ()
    if isinstance(modules, str) and modules != "all-linear":
        raise ConfigError(f"lora: {path}: target_modules={modules!r} is a pattern; a list of module names is supported")
    return ALL_LINEAR if modules in ("all-linear", ["all-linear"]) else tuple(modules)


def load_peft(path: str | Path, cfg: ModelConfig) -> tuple[dict, LoraSettings]:
    """A PEFT LoRA adapter directory for a model of ``cfg``: ``(adapters, settings)``. A
    :class:`ConfigError` naming the key for what is not a plain LoRA of our projections (DoRA,
    biases, other modules, a tensor of another shape)."""
    from safetensors.numpy import load_file

    path = Path(path)
    config = peft_config(path)
    try:
        tensors = load_file(path / WEIGHTS_FILE)
    except (OSError, ValueError) as e:
        raise ConfigError(f"lora: {path} is not a PEFT adapter directory ({e})") from None
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"lora: {path}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, plain in (("use_dora", False), ("bias", "none"), ("modules_to_save", None), ("fan_in_fan_out", False)):
        if config.get(key, plain) not in (plain, [] if plain is None else plain):
            raise ConfigError(f"lora: {path}: {key}={config[key]!r} is not supported")
    modules = peft_modules(config, path)
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"lora: {path}/{CONFIG_FILE}: r and lora_alpha must be numbers ({e!r})") from None
    settings = LoraSettings(rank=rank, alpha=alpha, targets=modules, rslora=bool(config.get("use_rslora", False)))
    return from_peft_tensors(tensors, targets(cfg, settings.targets), settings, PEFT_PREFIX, path), settings


def from_peft_tensors(tensors: dict, found: list[_Target], settings: LoraSettings, prefix: str, path) -> dict:
    """The adapters of ``found`` from PEFT's tensors (``prefix + module + ".lora_A.weight"`` ``[r,
    in]``, ``lora_B`` ``[out, r]``); a :class:`ConfigError` naming a missing, misshapen or extra
    tensor of ``path``."""
    adapters: dict = {}
    used = set()
    for t in found:
        a_parts, b_parts = [], []
        for index in np.ndindex(*t.stack):
            name = _peft_name(t, index, prefix)
            for part in ("A", "B"):
                key = f"{name}.lora_{part}.weight"
                if key not in tensors:
                    raise ConfigError(f"lora: {path}: {key} is missing")
                used.add(key)
            a_hf, b_hf = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
            if a_hf.shape != (settings.rank, math.prod(t.ins)) or b_hf.shape != (math.prod(t.outs), settings.rank):
                raise ConfigError(f"lora: {path}: {name} has lora_A {a_hf.shape} and lora_B {b_hf.shape}, not "
                                  f"({settings.rank}, {math.prod(t.ins)}) and ({math.prod(t.outs)}, {settings.rank})")
            a_parts.append(a_hf.T.reshape(*t.ins, settings.rank))
            b_parts.append(b_hf.T.reshape(settings.rank, *t.outs))
        stack = lambda parts: np.stack(parts).reshape(*t.stack, *parts[0].shape)  # noqa: E731
        _put(adapters, t.path, {"a": jnp.asarray(stack(a_parts), jnp.float32),
                                "b": jnp.asarray(stack(b_parts), jnp.float32)})
    extra = sorted(set(tensors) - used)
    if extra:
        raise ConfigError(f"lora: {path}: {extra[0]} is not a LoRA tensor of this model's projections")
    return adapters


def peft_tensors(adapters: dict, found: list[_Target], settings: LoraSettings, prefix: str) -> dict[str, np.ndarray]:
    """``adapters`` as PEFT's tensors (:func:`from_peft_tensors`' inverse)."""
    tensors = {}
    for t in found:
        node = _get(adapters, t.path)
        a, b = np.asarray(node["a"], np.float32), np.asarray(node["b"], np.float32)
        for index in np.ndindex(*t.stack):
            name = _peft_name(t, index, prefix)
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[index].reshape(-1, settings.rank).T)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[index].reshape(settings.rank, -1).T)
    return tensors


def save_peft(path: str | Path, adapters: dict, settings: LoraSettings, cfg: ModelConfig, base: str = "") -> None:
    """``adapters`` as a PEFT adapter directory (what :func:`load_peft` and
    ``peft.PeftModel.from_pretrained`` read)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors(adapters, targets(cfg, settings.targets), settings, PEFT_PREFIX), path / WEIGHTS_FILE,
              metadata={"format": "pt"})
    modules = sorted({t.module for t in targets(cfg, settings.targets)})  # all-linear spelled out
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
              "target_modules": modules, "use_rslora": settings.rslora, "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_dora": False, "base_model_name_or_path": base,
              "inference_mode": True}
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")


def _peft_name(t: _Target, index: tuple[int, ...], prefix: str) -> str:
    if t.spec.hf_layout not in _LAYOUTS:
        raise ConfigError(f"lora: {t.spec.hf} is laid out as {t.spec.hf_layout!r}, which adapters do not cover")
    name = t.spec.hf if not index else t.spec.hf.replace("{layer}", str(index[0]))  # the one stack axis: layers
    return prefix + name.removesuffix(".weight")


def _put(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree
