"""An exponential moving average of the parameters, updated after each optimiser step, as diffusers'
``EMAModel`` (0.42.1) keeps one (:class:`hypertron.config.EmaConfig` holds its settings).

The average is a float32 tree built from the parameters leaf by leaf (so sharded like them). The
n-th update (n from 1, the optimiser step it follows) moves it by ``ema -= r (ema - params)`` with
``r = 1 - d``: ``d = 0`` while ``k = n - update_after_step - 1 <= 0`` (the average becomes the
parameters), then ``(1 + k) / (10 + k)``, or with ``warmup`` ``1 - (1 + k / inv_gamma) **
-power``, capped at ``decay`` and at least ``min_decay``. The host computes ``d`` in float64 from the
step number, as diffusers does, and hands the step ``r`` as a float32 scalar (traced: no recompile
per step), so the average follows ``EMAModel``'s to float32 rounding and needs no counter of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config import EmaConfig


def init(params):
    """The average before the first update: a float32 copy of ``params``."""
    return jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)


def decay(config: EmaConfig, count: int) -> float:
    """The decay of update number ``count`` (from 1): ``EMAModel.get_decay``."""
    k = max(0, count - config.update_after_step - 1)
    if k <= 0:
        return 0.0
    if config.warmup:
        d = 1 - (1 + k / config.inv_gamma) ** -config.power
    else:
        d = (1 + k) / (10 + k)
    return max(min(d, config.decay), config.min_decay)


def rate(config: EmaConfig, count: int) -> np.float32:
    """How far update number ``count`` moves the average towards the parameters: ``1 - decay``."""
    return np.float32(1 - decay(config, count))


def update(average, params, rate_: jax.Array):
    """``average`` moved ``rate_`` of the way to ``params`` (jit-able)."""
    return jax.tree.map(lambda e, p: e - rate_ * (e - p.astype(jnp.float32)), average, params)
