"""Models: parameter declarations and the shared decoder."""

from __future__ import annotations

import jax

from hypertron.config import ModelConfig
from hypertron.models import params as _params
from hypertron.models.decoder import (
    declare,
    forward,
    forward_cached,
    forward_paged,
    forward_with_stats,
    init_cache,
    resolve_dtype,
)


def count_params(cfg: ModelConfig) -> int:
    """Parameter count of ``cfg`` from abstract shapes (nothing is allocated)."""
    return _params.count(declare(cfg))


def init_params(cfg: ModelConfig, key: jax.Array, dtype=None):
    """Random parameters for ``cfg`` (unsharded; see ``hypertron.train`` for sharded init)."""
    dtype = resolve_dtype(cfg.param_dtype) if dtype is None else dtype
    return _params.initialize(declare(cfg), key, dtype)


__all__ = ["count_params", "declare", "forward", "forward_cached", "forward_paged", "forward_with_stats", "init_cache", "init_params", "resolve_dtype"]
