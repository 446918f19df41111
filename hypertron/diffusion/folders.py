"""Writing diffusers pipeline folders: what :mod:`hypertron.diffusion.pipeline` reads back.

* :func:`write_component`: a model's ``config.json`` and its weights, named and laid out as
  diffusers and transformers save them (:func:`hypertron.models.hf.declared_to_hf`).
* :func:`write_clip_tokenizer`: a CLIP BPE folder as the hub ships one (``vocab.json`` +
  ``merges.txt`` + ``tokenizer_config.json``) over a given vocabulary of words.
* :func:`write_model_index`: ``model_index.json``.
* :func:`write_preset`: a pipeline of random weights at a preset's configs (:data:`PRESETS`), the
  start of a model trained from scratch (``diffusion.model=shapes-unet``).

A training run's final ``RUN/model`` is its base folder with the trained denoiser written over the
base's (``hypertron.train.diffusion_task``), so the pipeline class and every other component stay the
base's, and diffusers' ``from_pretrained`` and ``hypertron diffuse`` read it alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hypertron.config.schema import MODEL_INDEX
from hypertron.diffusion import schedulers as S
from hypertron.diffusion import shapes
from hypertron.diffusion.pipeline import KINDS, PIXEL, PipelineSpec
from hypertron.diffusion.text_encoders import declare_clip, text_config
from hypertron.diffusion.unet import declare_unet, unet_config
from hypertron.diffusion.weights import WEIGHTS_FILE
from hypertron.models.hf import declared_to_hf
from hypertron.models.params import initialize_on_host

TEXT_WEIGHTS_FILE = "model.safetensors"  # transformers' single file
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def _json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's (and CLIP's) byte -> printable character table, byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b if b in printable else next(extra)) for b in range(256)]


def _merged(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """``word``'s pieces after BPE with ``ranks`` (the lowest-ranked pair first, as ``tokenizers``)."""
    parts = [*word[:-1], word[-1] + "</w>"]
    while len(parts) > 1:
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(parts, parts[1:])))
        if rank == len(ranks):
            break
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
    return parts


def clip_vocab(words: Sequence[str]) -> tuple[dict[str, int], list[str]]:
    """A CLIP BPE vocabulary and merges: every byte alone and word-final, merges that make each of
    ``words`` (lower-case ASCII) one token, then the bos and eos specials. A word's merges are
    added after those before it, each the first pair its pieces still have: a later merge never
    applies to an earlier word, which its own merges join whole first."""
    chars = _bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars])}
    ranks: dict[tuple[str, str], int] = {}
    for word in words:
        while len(parts := _merged(word, ranks)) > 1:
            ranks[(parts[0], parts[1])] = len(ranks)
            vocab.setdefault(parts[0] + parts[1], len(vocab))
    vocab |= {BOS: len(vocab), EOS: len(vocab) + 1}
    return vocab, [f"{a} {b}" for a, b in ranks]


def write_clip_tokenizer(folder: Path, words: Sequence[str], max_length: int) -> int:
    """A CLIP tokenizer folder over ``words`` (:func:`clip_vocab`), padding with eos to
    ``max_length`` as SD 1.x's; returns the vocabulary's size."""
    vocab, merges = clip_vocab(words)
    folder.mkdir(parents=True, exist_ok=True)
    _json(folder / "vocab.json", vocab)
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    _json(folder / "tokenizer_config.json", {"tokenizer_class": "CLIPTokenizer", "model_max_length": max_length,
                                             "bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "unk_token": EOS})
    return len(vocab)


def write_component(folder: Path, config: dict, specs: Any, params: Any, weights_file: str = WEIGHTS_FILE) -> None:
    """``config.json`` and the weights of ``params`` (declared by ``specs``) under their hf names,
    float32 safetensors."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    _json(folder / "config.json", config)
    tensors = declared_to_hf(specs, jax.device_get(params), folder.name, np.float32)
    save_file(tensors, str(folder / weights_file), metadata={"format": "pt"})


def write_model_index(folder: Path, class_name: str, components: dict[str, tuple[str, str]]) -> None:
    """``model_index.json``: the pipeline's class and each component's ``[library, class]``."""
    folder.mkdir(parents=True, exist_ok=True)
    _json(folder / MODEL_INDEX, {"_class_name": class_name, "_diffusers_version": "0.42.1",
                                 **{k: list(v) for k, v in components.items()}})


@dataclasses.dataclass(frozen=True)
class Preset:
    """A pipeline trained from scratch: its class, configs and the words its tokenizer knows."""

    class_name: str
    unet: dict  # the UNet's config.json (diffusers' UNet2DConditionModel)
    text_encoder: dict  # the text encoder's config.json, but vocab_size and the specials' ids
    scheduler: dict  # scheduler_config.json
    words: tuple[str, ...]
    max_length: int  # tokens of a prompt (the text encoder's positions)


# The CPU demo: a UNet of 0.36M parameters denoising 32 x 32 pixels of the shapes source,
# conditioned on a random frozen 2-layer CLIP of width 32 over the captions' words, flow matching.
# Attention (self and cross) at 8 x 8 only: a training step at batch 32 took 0.29 s on this
# project's 2-core CPU, against 0.79 s with attention at 16 x 16 too (0.43M parameters) and 9.2 s
# at 32 x 32 as well (2026-11-28; diffusers' torch UNet of the same configs 0.17 and 0.46 s).
SHAPES_UNET = Preset(
    class_name=PIXEL,
    unet={"_class_name": "UNet2DConditionModel", "sample_size": shapes.SIZE, "in_channels": 3, "out_channels": 3,
          "block_out_channels": [16, 32, 32], "layers_per_block": 1, "cross_attention_dim": 32,
          "down_block_types": ["DownBlock2D", "DownBlock2D", "CrossAttnDownBlock2D"],
          "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D", "UpBlock2D"],
          "attention_head_dim": 8, "norm_num_groups": 8},
    text_encoder={"architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "hidden_size": 32,
                  "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "max_position_embeddings": 8, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    scheduler={"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0},
    words=("a", *shapes.COLOURS, *shapes.SHAPES),
    max_length=8,
)
PRESETS = {"shapes-unet": SHAPES_UNET}


def preset_spec(name: str) -> PipelineSpec:
    """The :class:`PipelineSpec` preset ``name``'s folder will have (its configs, from memory)."""
    preset = PRESETS[name]
    return PipelineSpec(folder=Path(name), class_name=preset.class_name, kind=KINDS[preset.class_name],
                        scheduler=S.parse_config(preset.scheduler, source=name), vae=None,
                        denoiser_config=preset.unet, options={})


def write_preset(folder: Path, preset: Preset, seed: int) -> None:
    """The pipeline folder of ``preset`` with random weights from ``seed`` (the UNet's, and the text
    encoder's from ``seed + 1``; :func:`~hypertron.models.params.initialize_on_host`), written to a temporary folder beside ``folder`` and then
    renamed, so a folder that exists is whole."""
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    vocab_size = write_clip_tokenizer(tmp / "tokenizer", preset.words, preset.max_length)
    text = {**preset.text_encoder, "vocab_size": vocab_size, "bos_token_id": vocab_size - 2,
            "eos_token_id": vocab_size - 1, "pad_token_id": vocab_size - 1}
    unet_specs = declare_unet(unet_config(preset.unet, "shapes-unet"))
    text_specs = declare_clip(text_config(text, "shapes-unet"))
    write_component(tmp / "unet", preset.unet, unet_specs, initialize_on_host(unet_specs, seed))
    write_component(tmp / "text_encoder", text, text_specs, initialize_on_host(text_specs, seed + 1), TEXT_WEIGHTS_FILE)
    (tmp / "scheduler").mkdir()
    _json(tmp / "scheduler" / "scheduler_config.json", preset.scheduler)
    write_model_index(tmp, preset.class_name, {
        "unet": ("diffusers", "UNet2DConditionModel"), "text_encoder": ("transformers", "CLIPTextModel"),
        "tokenizer": ("transformers", "CLIPTokenizer"), "scheduler": ("diffusers", preset.scheduler["_class_name"])})
    tmp.replace(folder) if not folder.exists() else shutil.rmtree(tmp)
