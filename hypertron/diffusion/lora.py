"""LoRA adapters of a diffusion denoiser, in diffusers' file: ``pytorch_lora_weights.safetensors``,
what a pipeline's ``save_lora_weights`` writes and its ``load_lora_weights`` reads.

The adapters are :mod:`hypertron.models.lora`'s, derived from the denoiser's declarations (a
UNet's attention projections ``to_q``, ``to_k``, ``to_v``, ``to_out.0`` and its feed-forward
``ff.net.0.proj``, ``ff.net.2``, held to diffusers by the tests; a Flux transformer's attention
projections likewise, held to diffusers' module names by tests/test_diffusion_task.py): one mechanism for decoders and
denoisers, applied by the einsum hook or merged. The file holds PEFT's tensors under
the component's name, ``unet.`` (``transformer.`` for Flux) + the module + ``.lora_A.weight``
``[r, in]`` and ``.lora_B.weight`` ``[out, r]``, and the LoRA config (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``) as diffusers keeps it: JSON in the safetensors metadata under
``lora_adapter_metadata``, each key prefixed with the component's name. A file without it (older
diffusers, or other trainers) gets diffusers' reading: every module in the file, ``alpha = r``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hypertron.diffusion.pipeline import denoiser_specs
from hypertron.errors import ConfigError, one_line
from hypertron.models import lora as L

LORA_FILE = "pytorch_lora_weights.safetensors"
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
UNET_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # diffusers' training scripts' default
COMPONENTS = {"UNet2DConditionModel": "unet", "FluxTransformer2DModel": "transformer"}  # the tensors' prefix


def save_lora(folder: str | Path, adapters: dict, settings: L.LoraSettings, specs: Any, component: str) -> Path:
    """``adapters`` of the denoiser declared by ``specs`` as ``folder/pytorch_lora_weights.safetensors``
    (``component``: ``unet`` or ``transformer``); returns the file's path."""
    from safetensors.numpy import save_file

    found = L.targets(specs, settings.targets)
    tensors = L.peft_tensors(adapters, found, settings, f"{component}.")
    config = {"r": settings.rank, "lora_alpha": settings.alpha, "use_rslora": settings.rslora,
              "target_modules": sorted({t.module for t in found})}
    metadata = {"format": "pt", METADATA_KEY: json.dumps({f"{component}.{k}": v for k, v in config.items()},
                                                         indent=2, sort_keys=True)}
    path = Path(folder) / LORA_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, tmp, metadata=metadata)
    tmp.replace(path)
    return path


def load_lora(path: str | Path, specs: Any, component: str) -> tuple[dict, L.LoraSettings]:
    """``(adapters, settings)`` of a diffusers LoRA file (or a folder holding ``pytorch_lora_weights.safetensors``)
    for the denoiser declared by ``specs``; a :class:`ConfigError` naming the file for what is not
    a plain LoRA of its projections (another component's tensors, DoRA, per-module ranks)."""
    from safetensors import safe_open

    path = Path(path)
    path = path / LORA_FILE if path.is_dir() else path
    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, ValueError, RuntimeError) as e:  # safetensors raises its own for a bad header
        raise ConfigError(f"lora: {path} is not a safetensors LoRA file ({one_line(e)})") from None
    prefix = f"{component}."
    other = next((k for k in sorted(tensors) if not k.startswith(prefix)), None)
    if other is not None:
        raise ConfigError(f"lora: {path}: {other} is not the {component}'s (adapters of other components are "
                          "not supported)")
    try:
        config = {k.removeprefix(prefix): v for k, v in json.loads(meta.get(METADATA_KEY) or "{}").items()
                  if k.startswith(prefix)}
    except ValueError as e:
        raise ConfigError(f"lora: {path}: its {METADATA_KEY} is not JSON ({e})") from None
    for key, plain in (("use_dora", False), ("bias", "none"), ("rank_pattern", {}), ("alpha_pattern", {})):
        if config.get(key, plain) not in (plain, None):
            raise ConfigError(f"lora: {path}: {key}={config[key]!r} is not supported")
    modules = sorted({k.removeprefix(prefix).rsplit(".lora_", 1)[0] for k in tensors})
    ranks = {int(v.shape[0]) for k, v in tensors.items() if k.endswith(".lora_A.weight")}
    if not modules or len(ranks) != 1:
        raise ConfigError(f"lora: {path}: " + ("no LoRA tensors" if not modules else f"ranks {sorted(ranks)}: "
                                               "one rank for every module is supported"))
    rank = int(config.get("r", ranks.pop()))
    try:
        settings = L.LoraSettings(rank=rank, alpha=float(config.get("lora_alpha", rank)),
                                  targets=tuple(config.get("target_modules") or modules),
                                  rslora=bool(config.get("use_rslora", False)))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"lora: {path}: r, lora_alpha and target_modules must be numbers and names ({e})") from None
    return L.from_peft_tensors(tensors, L.targets(specs, settings.targets), settings, prefix, path), settings


def with_lora(pipe, path: str | Path, scale: float = 1.0):
    """``pipe`` (a loaded :class:`~hypertron.diffusion.pipeline.Pipeline`) with the LoRA file
    ``path`` merged into its denoiser, ``scale`` times (diffusers' ``lora_scale``)."""
    component = COMPONENTS[pipe.spec.kind.denoiser_class]
    adapters, settings = load_lora(path, denoiser_specs(pipe), component)
    scaled = dataclasses.replace(settings, alpha=settings.alpha * scale)
    return dataclasses.replace(pipe, denoiser_params=L.merge(pipe.denoiser_params, adapters, scaled))


def lora_argument(text: str) -> tuple[Path, float]:
    """``FILE[:SCALE]`` (``hypertron diffuse --lora``): the LoRA file (or a folder holding
    ``pytorch_lora_weights.safetensors``) and its scale, 1 when not given; a :class:`ConfigError`
    for a file that is not there or a scale that is not a number."""
    path, scale = text, 1.0
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            path, scale = head, float(tail)
        except ValueError:
            pass  # a colon in the path itself
    found = Path(path) / LORA_FILE if Path(path).is_dir() else Path(path)
    if not found.is_file():
        raise ConfigError(f"--lora={text}: no file {found}")
    return found, scale
