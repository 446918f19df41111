"""Models: parameter declarations and the shared decoder."""

from __future__ import annotations

import jax

from hypertron.config import ModelConfig
from hypertron.models import params as _params
from hypertron.models.decoder import (
    Forward,
    declare,
    forward,
    resolve_dtype,
    unstack_layers,
)
from hypertron.models.kv_cache import KVCache, PagedCache


def count_params(cfg: ModelConfig) -> int:
    """Parameter count of ``cfg`` from abstract shapes (nothing is allocated)."""
    return _params.count(declare(cfg))


def init_params(cfg: ModelConfig, key: jax.Array, dtype=None):
    """Random parameters for ``cfg`` (unsharded; see ``hypertron.train`` for sharded init)."""
    dtype = resolve_dtype(cfg.param_dtype) if dtype is None else dtype
    return _params.initialize(declare(cfg), key, dtype)


def quantize_params(params, cfg: ModelConfig):
    """``params`` of ``cfg`` with every matmul weight int8 (one scale per output channel of its einsum,
    per layer for the stacked ``layers``), as the declarations say; norms and the MoE router stay as
    they are. About a quarter of float32's bytes (see :func:`hypertron.models.params.quantize_params`)."""
    return _params.quantize_params(declare(cfg), params)


def cast_params(params, cfg: ModelConfig):
    """``params`` of ``cfg`` for inference: matmul and embedding weights in the compute dtype
    (``model.dtype``), norms and the MoE router in float32, int8 weights kept
    (:func:`hypertron.models.params.cast_params`)."""
    return _params.cast_params(declare(cfg), params, resolve_dtype(cfg.dtype))


def serving_params(params, cfg: ModelConfig, quantize: str = "none", dtype=None):
    """``params`` as serving holds them: with ``quantize="int8"`` the matmul weights int8
    (:func:`quantize_params`), then cast as :func:`cast_params` casts them, to ``dtype`` (default
    ``model.dtype`` on the device in hand). ``hypertron.serve.model.prepare_params`` loads with it,
    ``models/serve_plan.py`` plans with it (abstract arrays, for a planned device's dtype)."""
    specs = declare(cfg)
    if quantize == "int8":
        params = _params.quantize_params(specs, params)
    return _params.cast_params(specs, params, resolve_dtype(cfg.dtype) if dtype is None else dtype)


def fp8_histories(cfg: ModelConfig) -> dict:
    """Zero fp8 amax histories (``model.amax_history`` steps) for the weights of ``cfg`` that carry one."""
    return _params.fp8_histories(declare(cfg), cfg.amax_history)


__all__ = ["Forward", "KVCache", "PagedCache", "cast_params", "count_params", "declare", "forward",
           "fp8_histories", "init_params", "quantize_params", "resolve_dtype", "serving_params",
           "unstack_layers"]
