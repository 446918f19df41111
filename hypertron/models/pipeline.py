"""Pipeline parallelism (``mesh.stage``): the stacked layers split into ``S`` stages, one block of
``L / S`` consecutive layers on each stage's devices (the sharding rules put the parameters'
``layers`` axis on ``stage``, so checkpoints, bundles and HF export keep ``[L, ...]`` and a run
resumes on any stage count), and the rows of a micro-batch cut into ``M`` pieces that follow one
another through the stages, GPipe's schedule.

Each of ``M + S - 1`` iterations runs every stage on its piece at once (``vmap`` over the stage
axis, with ``spmd_axis_name`` so that each stage's work stays on its devices), then passes each
stage's output one stage on (a roll along the stage axis: a collective permute). Stage 0 takes the
next piece; the last stage's output is piece ``i - (S - 1)``'s. The first and last ``S - 1``
iterations leave stages idle (their work is discarded): the bubble, ``(S - 1) / (M + S - 1)``
of the step. Piece ``m`` is rows ``m, m + M, ...`` of the batch, so each data shard cuts its own
rows and nothing moves between data shards for it. Embedding, final norm, unembedding and loss
run outside, over the whole batch; remat applies per layer, as without stages.

Not yet: repeats (the circular schedule, a stage holding several blocks), MoE models, and
``mesh.context`` or ``mesh.tensor`` beside ``stage`` (``config.validation`` refuses them).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax

from hypertron.parallel.rules import active_rules, constrain, mesh_axes, spec_for

_MICROBATCHES: contextvars.ContextVar[int] = contextvars.ContextVar("hypertron_pipeline_microbatches", default=0)


@contextlib.contextmanager
def use_microbatches(count: int) -> Iterator[None]:
    """Within this block (while tracing), a pipeline cuts the batch into ``count`` pieces (0: as
    many as the stages); ``train.pipeline_microbatches``."""
    token = _MICROBATCHES.set(count)
    try:
        yield
    finally:
        _MICROBATCHES.reset(token)


def stage_axes() -> tuple[str, ...]:
    """The mesh axes the active rules put the stacked layers on (``stage``), if larger than 1."""
    active = active_rules()
    if active is None:
        return ()
    mesh, rules = active
    return mesh_axes(spec_for(("layers",), rules, mesh)[0])


def run_stages(body, x_btd: jax.Array, layers, ctx: dict, num_layers: int) -> jax.Array:
    """The stacked ``layers`` over ``x_btd`` as the stages' pipeline (see the module docstring).
    ``body(carry, (layer params, layer index), ctx)`` is the decoder's scan body with carry
    ``(x, None)``; ``ctx`` holds the rows' ``positions`` and ``segment_ids`` (None or ``[b, t]``)."""
    axes = stage_axes()
    mesh = active_rules()[0]
    stages = math.prod(mesh.shape[a] for a in axes)
    pieces = _MICROBATCHES.get() or stages
    b = x_btd.shape[0]

    def split(a):  # [b, ...] -> [pieces, b / pieces, ...]: piece m is rows m, m + pieces, ...
        return a.reshape(b // pieces, pieces, *a.shape[1:]).swapaxes(0, 1)

    xs = split(x_btd)
    rows = {k: split(ctx[k]) for k in ("positions", "segment_ids") if ctx[k] is not None}
    per = num_layers // stages
    staged = jax.tree.map(lambda a: a.reshape(stages, per, *a.shape[1:]), layers)
    ids = jnp.arange(num_layers).reshape(stages, per)

    def stage(p, layer_ids, x, row):
        (x, _), _ = lax.scan(lambda carry, li: body(carry, li, ctx | row), (x, None), (p, layer_ids))
        return x

    run = jax.vmap(stage, spmd_axis_name=axes if len(axes) > 1 else axes[0])
    on_stages = lambda a: constrain(a, ("layers", "batch", "seq", "act_embed"))  # noqa: E731

    def iteration(carry, i):
        state, out = carry
        feed = jnp.roll(state, 1, axis=0).at[0].set(xs[jnp.minimum(i, pieces - 1)])
        piece = jnp.clip(i - jnp.arange(stages), 0, pieces - 1)  # what each stage works on
        state = on_stages(run(staged, ids, on_stages(feed), {k: v[piece] for k, v in rows.items()}))
        out = lax.dynamic_update_index_in_dim(out, state[-1], jnp.maximum(i - (stages - 1), 0), 0)
        return (state, out), None

    start = (on_stages(jnp.zeros((stages, *xs.shape[1:]), xs.dtype)), jnp.zeros_like(xs))
    (_, out), _ = lax.scan(iteration, start, jnp.arange(pieces + stages - 1))
    return out.swapaxes(0, 1).reshape(x_btd.shape)
