"""A model bundle: what inference needs of a model, and nothing of its training.

    DIR/model.json          {"format": "hypertron-model", "version": 1,
                             "model": {the ModelConfig's fields}, "tokenizer": "byte" or "tokenizer"}
    DIR/model.safetensors   every parameter under its dotted path ("layers.wq"), in the dtype it
                            was saved in (training writes its float32 master weights)
    DIR/tokenizer/          the tokenizer's files, if it is not the byte tokenizer:
                            tokenizer.json or tokenizer.model, and tokenizer_config.json (chat
                            template), special_tokens_map.json, generation_config.json (EOS ids)

``hypertron train`` writes one to ``RUN/model`` at its final save; ``serve``, ``generate`` and
``convert --to-hf`` read one (``--model DIR``). A bundle is self-contained: it can be copied
elsewhere and served without the run's config, data or checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, for safetensors)
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from hypertron.config import ConfigError, ModelConfig
from hypertron.config.loading import BUNDLE_FORMAT as FORMAT
from hypertron.config.loading import BUNDLE_MANIFEST as MANIFEST
from hypertron.config.loading import BUNDLE_VERSION as VERSION
from hypertron.config.loading import bundle_manifest, bundle_model, to_dict
from hypertron.models.decoder import declare
from hypertron.models.params import leaves_with_paths
from hypertron.tokenizer import Tokenizer, check_vocab, get_tokenizer, tokenizer_file, tokenizer_files

WEIGHTS, TOKENIZER_DIR = "model.safetensors", "tokenizer"
# The files that travel with a tokenizer file: its config (chat template), and generation_config.json,
# which carries the extra end-of-turn ids (hypertron.tokenizer reads them).
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class BundleError(ConfigError):
    """A model bundle that cannot be read: one line naming the file and the problem."""


def is_bundle(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def copy_tokenizer(tokenizer: str, target: str | Path, names: tuple[str, str] | None = None) -> bool:
    """Copy a file tokenizer (``data.tokenizer``: a file or a directory holding one) and its
    companion files into the directory ``target``; the tokenizer file under ``names[kind]``
    (default: its own name; CLIP's vocab.json and merges.txt always under theirs). False for the
    byte tokenizer, which has no file."""
    if tokenizer == "byte":
        return False
    kind, path = tokenizer_file(tokenizer)
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for src in tokenizer_files(kind, path):  # CLIP's vocab.json and merges.txt keep their names
        name = os.path.basename(src) if names is None or kind == "clip" else names[kind == "sentencepiece"]
        shutil.copyfile(src, target / name)
    for companion in TOKENIZER_COMPANIONS:
        src = Path(path).parent / companion
        if src.is_file():
            shutil.copyfile(src, target / companion)
    return True


def set_chat_template(path: str | Path, template: str) -> None:
    """Make ``template`` the chat template of the bundle at ``path`` (its tokenizer's
    ``tokenizer_config.json``, written or updated): what ``hypertron serve`` renders with. The
    bundle must hold a tokenizer file (the byte tokenizer has no folder to carry it)."""
    _, tok = read_config(path)
    if tok == "byte":
        raise BundleError(f"{path}: a bundle with the byte tokenizer cannot carry a chat template")
    config_path = Path(tok) / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    config["chat_template"] = template
    tmp = config_path.with_name(config_path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, config_path)


def save_model(path: str | Path, cfg: ModelConfig, params: Any, tokenizer: str = "byte") -> None:
    """Write the bundle of ``cfg`` and ``params`` (host or device arrays, any float dtype) with the
    ``tokenizer`` it reads text with. The folder is written beside ``path`` and moved into place
    at the end, replacing an older bundle there: a reader never sees half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        tensors = {}
        for keys, _ in leaves_with_paths(declare(cfg)):
            value = params
            for k in keys:
                value = value[k]
            tensors[".".join(keys)] = np.ascontiguousarray(np.asarray(value))
        save_file(tensors, tmp / WEIGHTS, metadata={"format": FORMAT})
        has_file = copy_tokenizer(tokenizer, tmp / TOKENIZER_DIR)
        manifest = {"format": FORMAT, "version": VERSION, "model": to_dict(cfg),
                    "tokenizer": TOKENIZER_DIR if has_file else "byte"}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}-old-", dir=path.parent))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def read_config(path: str | Path) -> tuple[ModelConfig, str]:
    """``(model config, tokenizer)`` of a bundle's manifest; ``tokenizer`` as ``get_tokenizer`` takes it."""
    try:
        manifest = bundle_manifest(path)
        cfg = bundle_model(path)
    except ConfigError as e:
        raise BundleError(str(e)) from None
    tok = manifest.get("tokenizer", "byte")
    return cfg, tok if tok == "byte" else str(Path(path) / tok)


def read_bundle(path: str | Path, dtype: Any = None) -> tuple[ModelConfig, dict, Tokenizer]:
    """``(model config, params, tokenizer)`` of a bundle; the params as numpy arrays in the dtype
    they were saved in, or ``dtype``. Every declared parameter must be there with its declared
    shape; a missing, extra or misshapen tensor is refused, naming it."""
    path = Path(path)
    cfg, tok_name = read_config(path)
    try:
        tensors = load_file(path / WEIGHTS)
    except (OSError, SafetensorError) as e:
        raise BundleError(f"{path / WEIGHTS}: unreadable ({e})") from None
    specs = declare(cfg)
    params: dict = {}
    for keys, spec in leaves_with_paths(specs):
        name = ".".join(keys)
        if name not in tensors:
            raise BundleError(f"{path / WEIGHTS}: no tensor {name!r} (the model declares it)")
        value = tensors.pop(name)
        if tuple(value.shape) != tuple(spec.shape):
            raise BundleError(f"{path / WEIGHTS}: {name} has shape {tuple(value.shape)}, the model declares "
                              f"{tuple(spec.shape)}")
        node = params
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value if dtype is None else value.astype(jnp.dtype(dtype))
    if tensors:
        raise BundleError(f"{path / WEIGHTS}: tensor {sorted(tensors)[0]!r} is not a parameter of {cfg.name}")
    tokenizer = get_tokenizer(tok_name)
    check_vocab(tokenizer, cfg.vocab_size, f"{path / MANIFEST}: model.vocab_size")
    return cfg, params, tokenizer

