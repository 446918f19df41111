"""Embedding tables and their optimiser state saved with Orbax, restored under any placement.

What is saved is each table's logical layout, ``[rows, dim]`` (and its state, ``[rows]`` or
``[rows, dim]``), its rows padded to a multiple of ``ROW_ALIGN`` and split by rows over the mesh
axis, so no device ever holds a whole table on the way: every host writes its own rows. A
restore reads them split by rows over the new axis (any shard count that divides the padded
rows: every power of two up to ``ROW_ALIGN``), then lays them out for the new placement (row-wise
with another shard count, column-wise, table-wise) in one jitted step. Beside them,
``tables.json`` keeps each table's rows, dimension and optimiser, checked on restore.

A directory that exists is never written into (:class:`EmbedError`, one line).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from hypertron.embed.spec import EmbedError, TableSpec
from hypertron.embed.tables import ShardedTable, _axis_devices

ROW_ALIGN = 1024


def _padded_rows(rows: int, shards: int) -> int:
    align = math.lcm(ROW_ALIGN, shards)
    return -(-rows // align) * align


def _logical(table: ShardedTable) -> dict[str, jax.Array]:
    """The table (and state) in ``[padded rows, ...]`` row order, split by rows over its axis."""
    spec, s = table.spec, table.shards
    n = _padded_rows(spec.rows, s)
    out = NamedSharding(table.mesh, P(table.axis))

    def relayout(a):
        if spec.placement == "row":
            a = jnp.moveaxis(a, 0, 1).reshape(-1, *a.shape[2:])
        a = a[:spec.rows]
        return jnp.pad(a, [(0, n - spec.rows)] + [(0, 0)] * (a.ndim - 1))

    arrays = {"table": table.data} | ({} if table.state is None else {"state": table.state})
    return {k: jax.jit(relayout, out_shardings=out)(v) for k, v in arrays.items()}


def save_tables(directory: str | Path, tables: Mapping[str, ShardedTable]) -> None:
    """Save ``tables`` (by name) and their optimiser state into the new ``directory``."""
    directory = Path(directory).absolute()
    if directory.exists():
        raise EmbedError(f"{directory}: exists already; embedding tables are saved into a new directory")
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(directory / "arrays", {name: _logical(t) for name, t in tables.items()})
    ckpt.wait_until_finished()
    meta = {name: {"rows": t.spec.rows, "dim": t.spec.dim, "optimizer": t.optimizer} for name, t in tables.items()}
    (directory / "tables.json").write_text(json.dumps(meta, indent=1))


def restore_tables(directory: str | Path, specs: Mapping[str, TableSpec], mesh: Mesh, axis: str,
                   owners: Mapping[str, int] | None = None) -> dict[str, ShardedTable]:
    """The tables saved in ``directory``, laid out as ``specs`` (by name; their placement may
    differ from the saved one) over ``axis`` of ``mesh``; ``owners``: table-wise tables' devices."""
    directory = Path(directory).absolute()
    try:
        meta = json.loads((directory / "tables.json").read_text())
    except (OSError, ValueError) as e:
        raise EmbedError(f"{directory}: no embedding tables saved here ({type(e).__name__})") from None
    s = mesh.shape[axis]
    abstract = {}
    for name, spec in specs.items():
        if name not in meta:
            raise EmbedError(f"table {name!r}: not in {directory} (it holds {', '.join(sorted(meta))})")
        m = meta[name]
        if (m["rows"], m["dim"]) != (spec.rows, spec.dim):
            raise EmbedError(f"table {name!r}: saved as {m['rows']} x {m['dim']}, asked for {spec.rows} x {spec.dim}")
        n = _padded_rows(spec.rows, 1)
        split = NamedSharding(mesh, P(axis) if n % s == 0 else P())
        state = {"rowwise_adagrad": (n,), "adagrad": (n, spec.dim)}.get(m["optimizer"])
        shapes = {"table": (n, spec.dim), "state": state}
        abstract[name] = {k: jax.ShapeDtypeStruct(v, jnp.float32, sharding=split) for k, v in shapes.items()
                          if v is not None}
    restored = ocp.StandardCheckpointer().restore(directory / "arrays", abstract)
    return {name: _place(restored[name], spec, meta[name]["optimizer"], mesh, axis, (owners or {}).get(name, 0))
            for name, spec in specs.items()}


def _place(arrays: dict, spec: TableSpec, optimizer: str, mesh: Mesh, axis: str, owner: int) -> ShardedTable:
    s = mesh.shape[axis]
    if spec.placement == "row":
        per = -(-spec.rows // s)

        def relayout(a):
            a = jnp.pad(a[:spec.rows], [(0, per * s - spec.rows)] + [(0, 0)] * (a.ndim - 1))
            return jnp.moveaxis(a.reshape(per, s, *a.shape[1:]), 1, 0)

        shard = lambda a: NamedSharding(mesh, P(axis))  # noqa: E731
    else:
        relayout = lambda a: a[:spec.rows]  # noqa: E731
        if spec.placement == "column":
            shard = lambda a: NamedSharding(mesh, P(None, axis) if a.ndim == 2 else P())  # noqa: E731
        else:  # the owner takes the rows (a transfer), then drops the padding
            device = SingleDeviceSharding(_axis_devices(mesh, axis)[owner % s])
            arrays = {k: jax.device_put(v, device) for k, v in arrays.items()}
            shard = lambda a: device  # noqa: E731
    placed = {k: jax.jit(relayout, out_shardings=shard(v))(v) for k, v in arrays.items()}
    return ShardedTable(dataclasses.replace(spec, optimizer=optimizer), placed["table"], mesh, axis, optimizer,
                        placed.get("state"), owner % s)
