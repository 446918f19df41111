"""A step's column-wise tables together: one collective for all of them where each would take one.

A job of several processes on CPU runs each collective as a gloo round trip (about 0.5 ms on this
machine's loopback, 2026-11-29, whatever the size at DLRM's), and XLA's CPU runtime makes one round
trip per array even of the all-reduces it combines; so a step's exchanges are grouped here by hand:

- :func:`gather_ids`: every table's ids, routed per process, gathered onto every device;
- :func:`reshard_pooled`: the pooled rows from the table's column shards to the samples' devices
  (and, for the gradients, back);
- :func:`update_columns`: the tables' sparse updates, row-wise Adagrad's row sums (each row's
  squared gradient summed over the column shards) in one ``psum``.

Each is meant to be called inside one ``jax.jit`` (a model's whole step, :mod:`hypertron.train.dlrm`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hypertron.embed.tables import (
    ShardedTable, _apply, _every_ids, _laid, _Layout, _layout, _own, _row_grads, _update_specs,
)


@functools.lru_cache(maxsize=None)
def _gather_fn(mesh: Mesh, axis: str, per: int, sizes: tuple[tuple[int, int], ...]):
    def gather(packed):
        parts = _every_ids(axis, mesh.shape[axis], per, packed[0], sizes, checked=False)
        return tuple(x for part in parts for x in part)

    # An all-gather's result is the same on every device, which the replication check cannot see: it is off.
    return jax.shard_map(gather, mesh=mesh, in_specs=P(axis), out_specs=(P(),) * (4 * len(sizes)), check_vma=False)


def gather_ids(tables: list[ShardedTable], per_device: int, packed, capacities: list[int]) -> list[tuple]:
    """Column-wise tables' input routed per process, packed (:func:`hypertron.embed.tables.pack_ids`,
    split by devices, each table's ids at its routing's capacity), gathered onto every device in one
    collective, for :func:`hypertron.embed.pooling_fn` and :func:`hypertron.embed.update_fn` with
    ``gathered=True``: each ``rows, sample, w, scale`` over the whole batch. Inside a ``jax.jit``."""
    t = tables[0]
    flat = _gather_fn(t.mesh, t.axis, per_device, tuple((c, per_device) for c in capacities))(packed)
    return [tuple(flat[i:i + 4]) for i in range(0, len(flat), 4)]


@functools.lru_cache(maxsize=None)
def _reshard_fn(mesh: Mesh, axis: str, dims: tuple[int, ...], to_samples: bool):
    s = mesh.shape[axis]
    cols = [d // s for d in dims]
    starts = np.cumsum([0, *cols])

    def columns_to_samples(*parts):  # each [batch, dim / S] (its columns) -> [batch / S, dim] (its samples)
        x = jnp.concatenate(parts, axis=1)
        x = jax.lax.all_to_all(x.reshape(s, -1, x.shape[1]), axis, 0, 2, tiled=True)  # [1, batch / S, S * C]
        x = x.reshape(x.shape[1], s, -1)
        return tuple(x[:, :, a:b].reshape(x.shape[0], -1) for a, b in zip(starts[:-1], starts[1:]))

    def samples_to_columns(*parts):  # the transpose: each [batch / S, dim] -> [batch, dim / S]
        x = jnp.concatenate([g.reshape(g.shape[0], s, -1) for g in parts], axis=2)  # [batch / S, S, C]
        x = jax.lax.all_to_all(x, axis, 1, 0, tiled=True).reshape(-1, int(starts[-1]))  # [batch, C]
        return tuple(x[:, a:b] for a, b in zip(starts[:-1], starts[1:]))

    columns, samples = (P(None, axis),) * len(dims), (P(axis),) * len(dims)
    if to_samples:
        return jax.shard_map(columns_to_samples, mesh=mesh, in_specs=columns, out_specs=samples)
    return jax.shard_map(samples_to_columns, mesh=mesh, in_specs=samples, out_specs=columns)


def reshard_pooled(tables: list[ShardedTable], arrays: list, to_samples: bool = True) -> list:
    """Column-wise tables' pooled embeddings ``[batch, dim]`` (split by columns, as :func:`lookup`
    leaves them) split by samples instead, all in one exchange (an all-to-all), not one a table;
    ``to_samples=False``: the transpose, for their gradients. Inside a ``jax.jit``."""
    t = tables[0]
    return list(_reshard_fn(t.mesh, t.axis, tuple(x.spec.dim for x in tables), to_samples)(*arrays))


@functools.lru_cache(maxsize=None)
def _columns_update_fn(lays: tuple[_Layout, ...], per: int, dims: tuple[int, ...]):
    counts = [len(_update_specs(lay)[0]) for lay in lays]
    starts = np.cumsum([0, *counts])

    def shard(*flat):
        lr, eps = flat[-2:]
        parts = [flat[a:b] for a, b in zip(starts[:-1], starts[1:])]
        own = [_own(lay, t, state) for lay, (t, state, *_) in zip(lays, parts)]
        grads = [_row_grads(lay, per, block, tuple(rest[:-1]), rest[-1])
                 for lay, (block, _), (_, _, *rest) in zip(lays, own, parts)]
        summing = [lay.optimizer == "rowwise_adagrad" for lay in lays]
        sq = [jnp.sum(g * g, axis=-1) for (_, g), on in zip(grads, summing) if on]
        sizes = np.cumsum([0, *(x.shape[0] for x in sq)])
        total = jax.lax.psum(jnp.concatenate(sq), lays[0].axis) if sq else None
        sums = iter(total[a:b] for a, b in zip(sizes[:-1], sizes[1:]))
        out = []
        for lay, dim, (block, st), (uniq, g), (_, state, *_), on in zip(lays, dims, own, grads, parts, summing):
            block, st = _apply(lay, dim, block, st, uniq, g, lr, eps, next(sums) if on else None)
            out.extend(_laid(lay, block, st, state))
        return tuple(out)

    specs = [_update_specs(lay) for lay in lays]
    return jax.shard_map(shard, mesh=lays[0].mesh, in_specs=(*(x for a, _ in specs for x in a), P(), P()),
                         out_specs=tuple(x for _, b in specs for x in b))


def update_columns(tables: list[ShardedTable], per_device: int, merged: bool, gathered: bool, arrays: list[tuple],
                   lr, eps) -> list[tuple]:
    """Column-wise tables' sparse updates as one program, row-wise Adagrad's row sums in one
    collective: ``arrays``, per table, ``(data, state, *routed, grad)`` as :func:`update_fn`
    takes them; each table's ``(data, state)`` back. Inside a ``jax.jit``."""
    lays = tuple(_layout(t, merged, gathered) for t in tables)
    flat = _columns_update_fn(lays, per_device, tuple(t.spec.dim for t in tables))(
        *[a for part in arrays for a in part], lr, eps)
    return [tuple(flat[i:i + 2]) for i in range(0, len(flat), 2)]
