"""Pipeline parallelism (``mesh.stage``): the stacked layers split into ``S`` stages, and the rows
of a micro-batch cut into ``M`` pieces that follow one another through them.

With ``R = train.pipeline_repeats`` of 1 (GPipe's schedule), stage ``s`` holds the block of
``L / S`` consecutive layers ``s``: the sharding rules put the parameters' ``layers`` axis on
``stage``, so each stage's devices hold a contiguous part of ``[L, ...]``. With ``R`` > 1 (the
circular schedule, as MaxText's ``Pipeline``), the layers form ``R x S`` blocks of
``L / (R S)``, and stage ``s`` holds blocks ``s, S + s, 2 S + s, ...``: a piece goes through every
stage once per repeat, and the bubble shrinks to ``(S - 1) / (M R + S - 1)`` of the step. For
the rules' contiguous split to give each stage its blocks, the train step holds the stacked
layers in :func:`held_order`, not the model's (``Trainer.to_held`` / ``to_model`` move a state
between the two, all to all over the stages; checkpoints, bundles and HF export keep the
model's order, so a run resumes on any stage count or repeats. Each save makes that copy of the
stacked layers' state, parameters and moments, beside the state it is saved from).

Each of ``M R + S - 1`` iterations runs every stage on its piece at once (``vmap`` over the
stage axis, with ``spmd_axis_name`` so that each stage's work stays on its devices), then passes
each stage's output one stage on (a roll along the stage axis: a collective permute). Stage 0
takes the next piece: a new one in the first ``M`` iterations, after that the last stage's
output of that piece from the repeat before (kept in the output buffer, which the last stage
writes ``M - S + 1`` iterations or more before stage 0 reads it: ``M >= S``). The first and last
``S - 1`` iterations leave stages idle (their work is discarded). Piece ``m`` is rows
``m, m + M, ...`` of the batch, so each data shard cuts its own rows and nothing moves between
data shards for it. Embedding, final norm, unembedding and loss run outside, over the whole
batch; remat applies per layer, as without stages (``remat=dots`` saves the projections, whose
dots the stages' ``vmap`` gives a batch dimension: ``models.decoder``'s staged policy).

Not yet: MoE models, and ``mesh.context`` or ``mesh.tensor`` beside ``stage``
(``config.validation`` refuses them).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hypertron.parallel.rules import active_rules, constrain, mesh_axes, spec_for

_SCHEDULE: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("hypertron_pipeline", default=(0, 1))


@contextlib.contextmanager
def use_schedule(microbatches: int, repeats: int = 1) -> Iterator[None]:
    """Within this block (while tracing), a pipeline cuts the batch into ``microbatches`` pieces
    (0: as many as the stages) that go through the stages ``repeats`` times, the stacked layers
    in :func:`held_order`; ``train.pipeline_microbatches`` and ``train.pipeline_repeats``."""
    token = _SCHEDULE.set((microbatches, repeats))
    try:
        yield
    finally:
        _SCHEDULE.reset(token)


def held_order(num_layers: int, stages: int, repeats: int) -> np.ndarray:
    """The model's layer at each position of the stacked layers as a pipeline of ``stages`` x
    ``repeats`` holds them: stage ``s``'s contiguous part is blocks ``s, S + s, ...`` (of
    ``L / (R S)`` layers each), in that order. The identity for one repeat."""
    per = num_layers // (stages * repeats)
    return np.arange(num_layers).reshape(repeats, stages, per).swapaxes(0, 1).reshape(-1)


def stage_axes() -> tuple[str, ...]:
    """The mesh axes the active rules put the stacked layers on (``stage``), if larger than 1."""
    active = active_rules()
    if active is None:
        return ()
    mesh, rules = active
    return mesh_axes(spec_for(("layers",), rules, mesh)[0])


def run_stages(body, x_btd: jax.Array, layers, ctx: dict, num_layers: int) -> jax.Array:
    """The stacked ``layers`` (in :func:`held_order`) over ``x_btd`` as the stages' pipeline (see
    the module docstring). ``body(carry, (layer params, layer index), ctx)`` is the decoder's scan
    body with carry ``(x, None)``; ``ctx`` holds the rows' ``positions`` and ``segment_ids`` (None
    or ``[b, t]``)."""
    axes = stage_axes()
    mesh = active_rules()[0]
    stages = math.prod(mesh.shape[a] for a in axes)
    pieces, repeats = _SCHEDULE.get()
    pieces = pieces or stages
    b = x_btd.shape[0]

    def split(a):  # [b, ...] -> [pieces, b / pieces, ...]: piece m is rows m, m + pieces, ...
        return a.reshape(b // pieces, pieces, *a.shape[1:]).swapaxes(0, 1)

    xs = split(x_btd)
    rows = {k: split(ctx[k]) for k in ("positions", "segment_ids") if ctx[k] is not None}
    per = num_layers // (stages * repeats)
    staged = jax.tree.map(lambda a: a.reshape(stages, repeats, per, *a.shape[1:]), layers)
    ids = jnp.asarray(held_order(num_layers, stages, repeats).reshape(stages, repeats, per))

    def stage(p, layer_ids, repeat, x, row):  # one stage's block of this repeat
        p, layer_ids = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, repeat, 0, keepdims=False), (p, layer_ids))
        (x, _), _ = lax.scan(lambda carry, li: body(carry, li, ctx | row), (x, None), (p, layer_ids))
        return x

    run = jax.vmap(stage, spmd_axis_name=axes if len(axes) > 1 else axes[0])
    on_stages = lambda a: constrain(a, ("layers", "batch", "seq", "act_embed"))  # noqa: E731
    work = pieces * repeats

    def iteration(carry, i):
        state, out = carry
        # Stage 0's input: a new piece in the first repeat, else that piece's output of the last one.
        first = jnp.where(i < pieces, xs[jnp.minimum(i, pieces - 1)], out[i % pieces])
        feed = jnp.roll(state, 1, axis=0).at[0].set(first)
        place = jnp.clip(i - jnp.arange(stages), 0, work - 1)  # where each stage is in pieces x repeats
        piece = place % pieces
        state = on_stages(run(staged, ids, place // pieces, on_stages(feed), {k: v[piece] for k, v in rows.items()}))
        out = lax.dynamic_update_index_in_dim(out, state[-1], piece[-1], 0)
        return (state, out), None

    start = (on_stages(jnp.zeros((stages, *xs.shape[1:]), xs.dtype)), jnp.zeros_like(xs))
    (_, out), _ = lax.scan(iteration, start, jnp.arange(work + stages - 1))
    return out.swapaxes(0, 1).reshape(x_btd.shape)
