"""Optimiser and learning-rate schedule, both from Optax."""

from __future__ import annotations

import optax

from hypertron.config import TrainConfig


def schedule(t: TrainConfig) -> optax.Schedule:
    """Linear warm-up to ``lr``, then cosine or linear decay to ``lr * min_lr_ratio`` at ``steps``."""
    warmup = min(t.warmup_steps, t.steps)
    end = t.lr * t.min_lr_ratio
    decay_steps = max(t.steps - warmup, 1)
    if t.schedule == "constant":
        after = optax.constant_schedule(t.lr)
    elif t.schedule == "linear":
        after = optax.linear_schedule(t.lr, end, decay_steps)
    else:
        after = optax.cosine_decay_schedule(t.lr, decay_steps, alpha=t.min_lr_ratio)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, t.lr, warmup), after], [warmup])


def _decay_mask(params):
    """Weight decay on matrices only: norms (rank-1 per layer) are not decayed."""
    import jax

    def mask(path, x):
        name = str(getattr(path[-1], "key", ""))
        return not name.endswith("norm")

    return jax.tree_util.tree_map_with_path(mask, params)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping (``clip_norm`` 0 disables it)."""
    parts = []
    if t.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(t.clip_norm))
    parts.append(
        optax.adamw(schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=_decay_mask)
    )
    return optax.chain(*parts)
