"""What generation and serving load: a model bundle (``RUN/model``, written by training), a run
directory (its latest checkpoint, trained or converted) or a Hugging Face model directory, as the model config they compute with, its parameters cast once
for inference (or int8) and the tokenizer, checked against each other once."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hypertron import checkpoint as checkpoints
from hypertron.config import ModelConfig, choices
from hypertron.config.schema import WeightQuantization
from hypertron.errors import UserError
from hypertron.models import bundle, hf, serving_params
from hypertron.tokenizer import Tokenizer, check_vocab, get_tokenizer


def inference_config(cfg: ModelConfig) -> ModelConfig:
    """The model config generation and serving run: a model trained with quantised matmuls
    (``model.quantization``) computes in its compute dtype here, as fp8-trained models are
    usually served; weight quantisation for serving is ``--quantize``."""
    return dataclasses.replace(cfg, quantization="none")


def prepare_params(params, cfg: ModelConfig, quantize: str = "none"):
    """Parameters as generation uses them, cast once here rather than in every step: for ``"none"``
    the matmul and embedding weights in the compute dtype (``cfg.dtype``: bf16 on an accelerator),
    norms and the MoE router in float32 (:func:`hypertron.models.cast_params`); for ``"int8"`` every
    matmul weight int8 with per-output-channel scales (:func:`hypertron.models.quantize_params`,
    from the full-precision weights), about a quarter of float32's bytes."""
    if quantize in ("none", "int8"):
        return serving_params(params, cfg, quantize)
    raise ValueError(f"quantize={quantize!r}: expected one of {', '.join(choices(WeightQuantization))}")


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model directory (``config.json`` and weights), not a hypertron run."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "checkpoints").exists()


def served_name(path: str | Path) -> str:
    """The model's id in ``/v1/models``: the directory's name, or the run's for ``RUN/model``."""
    path = Path(path).resolve()
    return path.parent.name if bundle.is_bundle(path) and path.name == "model" else path.name


def load_for_inference(path: str | Path, quantize: str = "none", mesh=None) -> tuple[ModelConfig, dict, Tokenizer]:
    """``(model config, params, tokenizer)`` of ``path``: a model bundle
    (:mod:`hypertron.models.bundle`), a run directory's latest checkpoint (its tokenizer is the
    run's ``data.tokenizer``) or a Hugging Face directory (its ``tokenizer.json`` or SentencePiece
    model, and the end-of-sequence ids of its ``generation_config.json``). The
    config is the one generation runs (:func:`inference_config`); the parameters are cast once by
    :func:`prepare_params` (matmul and embedding weights in the compute dtype, or int8; norms and
    router in float32); a tokenizer with more ids than the model is refused. With ``mesh`` (a
    serving engine's, :mod:`hypertron.serve.placement`), each weight lands in its shards as it is
    read (a checkpoint restored into them, safetensors sent from the host slice by slice) and is
    cast there: no device holds a whole split weight."""
    from hypertron.serve.placement import place_weights, weights_on

    if bundle.is_bundle(path):
        model, params, tokenizer = bundle.read_bundle(path)  # its vocabulary is checked there
        key = f"{path}/{bundle.MANIFEST}: model.vocab_size"
    elif is_hf_dir(path):
        model, params = hf.load_hf(path)
        tokenizer = get_tokenizer(str(path))
        key = f"{path}/config.json: vocab_size"
    else:
        cfg, params = checkpoints.load_params(path) if mesh is None else \
            checkpoints.load_params(path, shardings=weights_on(mesh, checkpoints.read_run_config(path).model))
        model, tokenizer, key = cfg.model, get_tokenizer(cfg.data.tokenizer), f"{path}: model.vocab_size"
    check_vocab(tokenizer, model.vocab_size, key)
    model = inference_config(model)
    return model, prepare_params(place_weights(mesh, model, params), model, quantize), tokenizer


def model_config_of(path: str | Path) -> ModelConfig | None:
    """The model config :func:`load_for_inference` would compute with for ``path``, read without
    its weights (to plan before loading); None where it cannot be read (loading then says why)."""
    try:
        if bundle.is_bundle(path):
            model = bundle.read_config(path)[0]
        elif is_hf_dir(path):
            model = hf.config_from_hf(json.loads((Path(path) / "config.json").read_text()))
        else:
            model = checkpoints.read_run_config(path).model
    except (UserError, OSError, ValueError):
        return None
    return inference_config(model)


def check_draft(draft: ModelConfig, draft_tokenizer: Tokenizer, model: ModelConfig, tokenizer: Tokenizer,
                where: str = "draft_model") -> None:
    """A draft model (speculative decoding) proposes ids the served model reads as the same text: its
    tokenizer the same ids, bytes and end-of-sequence ids (its model's vocabulary may be padded to
    another size: it proposes only the served model's ids); else a :class:`UserError` naming
    ``where`` and the first difference."""
    if draft.max_seq_len < model.max_seq_len:
        raise UserError(f"{where}: its max_seq_len is {draft.max_seq_len}, under the served model's "
                        f"{model.max_seq_len} (it reads every position the served model does)")
    if draft_tokenizer.vocab_size != tokenizer.vocab_size or draft_tokenizer.eos_ids != tokenizer.eos_ids:
        raise UserError(f"{where}: its tokenizer has {draft_tokenizer.vocab_size} ids and end-of-sequence ids "
                        f"{sorted(draft_tokenizer.eos_ids)}, the served model's {tokenizer.vocab_size} and "
                        f"{sorted(tokenizer.eos_ids)} (a draft model needs the same tokenizer)")
    for i in range(tokenizer.vocab_size):
        if draft_tokenizer.token_bytes(i) != tokenizer.token_bytes(i):
            raise UserError(f"{where}: its tokenizer writes id {i} as {draft_tokenizer.token_bytes(i)!r}, the "
                            f"served model's as {tokenizer.token_bytes(i)!r} (a draft model needs the same tokenizer)")
