"""What generation and serving load from a run directory: the model config they compute with, its
parameters (int8 when asked) and the tokenizer, checked against each other once."""

from __future__ import annotations

from pathlib import Path

from hypertron import checkpoint as checkpoints
from hypertron.config import ModelConfig
from hypertron.serve.generate import inference_config, prepare_params
from hypertron.tokenizer import Tokenizer, check_vocab, get_tokenizer


def load_model(checkpoint: str | Path, quantize: str = "none") -> tuple[ModelConfig, dict, Tokenizer]:
    """``(model config, params, tokenizer)`` of a run directory's latest checkpoint (trained or
    converted from HF): the config as generation runs it (:func:`inference_config`), the
    parameters as :func:`prepare_params` makes them for ``quantize``, and the run's tokenizer,
    refused if the model has fewer ids than it."""
    cfg, params = checkpoints.load_params(checkpoint)
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    check_vocab(tokenizer, cfg.model.vocab_size, f"{checkpoint}: model.vocab_size")
    model = inference_config(cfg.model)
    return model, prepare_params(params, model, quantize), tokenizer
