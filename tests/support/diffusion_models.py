"""What the diffusion model tests share: diffusers models off their default init saved as folders,
and the loaders' one-line refusals of a folder with a tensor missing or an unsupported block."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest

from hypertron.diffusion.errors import DiffusionError
from hypertron.diffusion.weights import WEIGHTS_FILE


def perturbed_folders(tmp_path_factory, class_name: str, tiny: dict, configs: dict[str, dict],
                      prefix: str) -> dict:
    """``{name: (folder, model)}``: for each of ``configs`` a diffusers ``class_name`` of ``tiny |
    config``, seeded by its index, every parameter moved off its default init (zero biases, unit
    norms, zero-initialised convs and modulations) by 0.1 N(0, 1), saved in a folder of its own.
    diffusers and torch are imported here, not at collection (seconds in every xdist worker)."""
    diffusers = pytest.importorskip("diffusers")
    import torch

    out = {}
    for i, (name, extra) in enumerate(configs.items()):
        torch.manual_seed(i)
        model = getattr(diffusers, class_name)(**(tiny | extra)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp(f"{prefix}-{name}")
        model.save_pretrained(folder)
        out[name] = folder, model
    return out


def refuses_missing_tensor(source: Path, folder: Path, name: str, load: Callable) -> Path:
    """A copy of ``source`` at ``folder`` without tensor ``name``: ``load(folder)`` says so in one
    line naming the file. Returns the copy."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, folder)
    weights = folder / WEIGHTS_FILE
    tensors = load_file(weights)
    del tensors[name]
    save_file(tensors, weights)
    with pytest.raises(DiffusionError) as e:
        load(folder)
    assert str(e.value) == f"missing tensor {name} (1 in all) for {weights}"
    return folder


def refuses_block_type(folder: Path, key: str, index: int, value: str, load: Callable) -> None:
    """``folder``'s config with ``key[index] = value``: ``load(folder)`` refuses it in one line
    naming the key, the value and the config file."""
    config = json.loads((folder / "config.json").read_text())
    config[key][index] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DiffusionError) as e:
        load(folder)
    message = str(e.value)
    assert "\n" not in message and key in message and value in message and "config.json" in message
