"""A diffusers component's weights: ``diffusion_pytorch_model.safetensors`` (or its index and shards)
read into the parameters a component declares, by each :class:`ParamSpec`'s ``hf`` name and layout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hypertron.config.loading import read_json
from hypertron.diffusion.errors import DiffusionError
from hypertron.models.hf import HFError, checkpoint_tensors, params_from_hf

WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"


def load_component(specs: Any, folder: Path, dtype: Any = np.float32) -> Any:
    """The parameters declared in ``specs`` (numpy arrays in ``dtype``) from the component ``folder``.
    No safetensors weights (``.bin`` only: reading them needs torch, which hypertron runs without), a
    missing, extra or misshapen tensor: a :class:`DiffusionError` naming the file and the tensor."""
    index = folder / f"{WEIGHTS_FILE}.index.json"
    where = str(index if index.is_file() and not (folder / WEIGHTS_FILE).is_file() else folder / WEIGHTS_FILE)
    if not (folder / WEIGHTS_FILE).is_file() and not index.is_file() and any(folder.glob("*.bin")):
        raise DiffusionError(f"{folder}: only .bin weights, which need torch to read (hypertron runs "
                             "without it): save the model as safetensors")
    try:
        with checkpoint_tensors(folder, WEIGHTS_FILE) as tensors:
            return params_from_hf(specs, tensors, dtype, where)
    except HFError as e:
        raise DiffusionError(str(e)) from None


def load_model(folder: str | Path, parse: Callable[[dict, str], Any], declare: Callable[[Any], Any],
               dtype: Any = np.float32) -> tuple[Any, Any]:
    """``(cfg, params)`` of a diffusers model folder: ``parse(config.json's dict, its path)`` gives the
    config, ``declare(cfg)`` the specs read by :func:`load_component` (numpy arrays in ``dtype``).
    Anything it cannot use is a one-line :class:`DiffusionError` naming the file and key or tensor."""
    folder = Path(folder)
    config_file = folder / "config.json"
    hf = read_json(config_file, DiffusionError, f"{config_file}: not found",
                   lambda reason: f"{config_file}: invalid JSON ({reason})")
    cfg = parse(hf, str(config_file))
    return cfg, load_component(declare(cfg), folder, dtype)
