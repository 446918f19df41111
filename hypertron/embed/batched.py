"""Table-wise tables on several processes: one row-wise array for a group of them (FBGEMM's
table-batched embedding, one block a device).

A table-wise table lives whole on one device, its owner. On one process the owner's array can be
the table's own (:mod:`hypertron.embed.tables`); a program over the devices of several processes
takes arrays laid out over all of them, so there the table-wise tables of one dimension and
optimiser are held together as one row-wise table ``[S, block, dim]``: table ``k``'s rows are rows
``offsets[k]`` to ``offsets[k] + rows - 1`` of its owner's block, and nothing of it is elsewhere.
Its ids become the group's rows (:meth:`TableGroup.rows`: row-wise, row ``v`` is row ``v // S`` of
shard ``v % S``), so they are routed as a row-wise table's are (on several processes each process
its own samples, the owner merging the duplicates), and each sample's ids of each table pool into
a sample of the group's own: sample ``i``'s ids of table ``k`` are the group's sample ``i * K + k``
(sample-major, so a device's samples stay its block; :func:`group_input`).

Checkpoints hold each table in its logical row order as for any placement
(:func:`group_logical`, :func:`group_from_logical`), so a run resumes under another placement or
process count.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hypertron.embed.checkpoint import logical_abstract
from hypertron.embed.spec import EmbedError, Jagged, TableSpec


@dataclasses.dataclass(frozen=True)
class TableGroup:
    """Table-wise tables held as one row-wise table (the module's docstring)."""

    specs: tuple[TableSpec, ...]
    owners: tuple[int, ...]
    offsets: tuple[int, ...]  # each table's first row in its owner's block
    block: int  # rows of each device's block
    shards: int

    @property
    def spec(self) -> TableSpec:
        """The group as one row-wise table (its rows: every device's block)."""
        first = self.specs[0]
        return TableSpec("+".join(s.name for s in self.specs), self.block * self.shards, first.dim, "row",
                         optimizer=first.optimizer)

    def rows(self, k: int, ids: np.ndarray) -> np.ndarray:
        """Table ``k``'s ``ids`` as the group's rows."""
        return (self.offsets[k] + np.asarray(ids, np.int64)) * self.shards + self.owners[k]


def group_tables(specs: list[TableSpec], owners: list[int], shards: int) -> TableGroup:
    """``specs`` (one dimension and optimiser) on their ``owners``, each device's in turn."""
    if len({(s.dim, s.optimizer) for s in specs}) != 1:
        raise EmbedError(f"tables {', '.join(s.name for s in specs)}: held together table-wise, they need one "
                         f"dimension and one optimiser")
    used, offsets = [0] * shards, []
    for spec, owner in zip(specs, owners):
        offsets.append(used[owner % shards])
        used[owner % shards] += spec.rows
    return TableGroup(tuple(specs), tuple(o % shards for o in owners), tuple(offsets), max(max(used), 1), shards)


def group_input(group: TableGroup, xs: list[Jagged]) -> Jagged:
    """The group's input from each table's (one batch): sample ``i``'s ids of table ``k`` as the
    group's sample ``i * K + k``, its rows the group's."""
    b, k = xs[0].batch, len(xs)
    lengths = np.stack([np.asarray(x.lengths, np.int64) for x in xs], axis=1)  # [b, K]
    keys = np.concatenate([np.repeat(np.arange(b) * k + j, lengths[:, j]) for j in range(k)])
    order = np.argsort(keys, kind="stable")
    values = np.concatenate([group.rows(j, x.values) for j, x in enumerate(xs)])[order]
    weighted = any(x.weights is not None for x in xs)
    weights = None if not weighted else np.concatenate(
        [np.ones(len(x.values), np.float32) if x.weights is None else np.asarray(x.weights, np.float32)
         for x in xs])[order]
    return Jagged(values, lengths.reshape(-1), weights)


def _scale(spec: TableSpec) -> float:
    return spec.init_scale if spec.init_scale is not None else math.sqrt(1.0 / spec.rows)


def _state_shape(group: TableGroup) -> tuple[int, ...] | None:
    dim = group.specs[0].dim
    return {"sgd": None, "rowwise_adagrad": (group.shards, group.block),
            "adagrad": (group.shards, group.block, dim)}[group.specs[0].optimizer]


def init_group(group: TableGroup, mesh: Mesh, axis: str, seeds: list[int]) -> tuple[jax.Array, jax.Array | None]:
    """The group's values (each table's from its seed, as :func:`hypertron.embed.init_table` makes
    them under any placement) and its optimiser state (zeros; None for SGD), made on the devices."""
    split = NamedSharding(mesh, P(axis))
    dim = group.specs[0].dim

    def values():
        data = jnp.zeros((group.shards, group.block, dim), jnp.float32)
        for spec, owner, offset, seed in zip(group.specs, group.owners, group.offsets, seeds):
            s = _scale(spec)
            rows = jax.random.uniform(jax.random.key(seed), (spec.rows, dim), jnp.float32, -s, s)
            data = data.at[owner, offset:offset + spec.rows].set(rows)
        return data

    shape = _state_shape(group)
    state = None if shape is None else jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=split)()
    return jax.jit(values, out_shardings=split)(), state


@functools.lru_cache(maxsize=None)
def _slice_fn(owner: int, offset: int, rows: int, padded: int, out):
    def cut(a):
        a = a[owner, offset:offset + rows]
        return jnp.pad(a, [(0, padded - rows)] + [(0, 0)] * (a.ndim - 1))

    return jax.jit(cut, out_shardings=out)


def group_logical(group: TableGroup, mesh: Mesh, axis: str, data, state) -> dict[str, dict[str, jax.Array]]:
    """Each table of the group in :func:`hypertron.embed.checkpoint.logical_arrays`' form (a copy)."""
    out = {}
    for spec, owner, offset in zip(group.specs, group.owners, group.offsets):
        shapes = logical_abstract(spec, spec.optimizer, mesh, axis)
        arrays = {"table": data} | ({} if state is None else {"state": state})
        out[spec.name] = {kind: _slice_fn(owner, offset, spec.rows, shapes[kind].shape[0], shapes[kind].sharding)(a)
                          for kind, a in arrays.items()}
    return out


def group_from_logical(group: TableGroup, mesh: Mesh, axis: str,
                       arrays: dict[str, dict[str, jax.Array]]) -> tuple[jax.Array, jax.Array | None]:
    """The group's arrays from each table's in :func:`group_logical`'s form."""
    split = NamedSharding(mesh, P(axis))
    dim = group.specs[0].dim

    def place(shape, parts):
        out = jnp.zeros(shape, jnp.float32)
        for spec, owner, offset, a in zip(group.specs, group.owners, group.offsets, parts):
            out = out.at[owner, offset:offset + spec.rows].set(a[:spec.rows])
        return out

    data = jax.jit(lambda parts: place((group.shards, group.block, dim), parts), out_shardings=split)(
        [arrays[s.name]["table"] for s in group.specs])
    shape = _state_shape(group)
    state = None if shape is None else jax.jit(lambda parts: place(shape, parts), out_shardings=split)(
        [arrays[s.name]["state"] for s in group.specs])
    return data, state
