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
import functools
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


@functools.lru_cache(maxsize=None)
def _to_logical(placement: str, rows: int, shards: int, out):
    """The jitted relayout of one of a table's arrays from ``placement``'s layout (over ``shards``)
    to ``[padded rows, ...]`` on ``out``."""
    n = _padded_rows(rows, shards)

    def relayout(a):
        if placement == "row":
            a = jnp.moveaxis(a, 0, 1).reshape(-1, *a.shape[2:])
        a = a[:rows]
        return jnp.pad(a, [(0, n - rows)] + [(0, 0)] * (a.ndim - 1))

    return jax.jit(relayout, out_shardings=out)


def logical_arrays(table: ShardedTable) -> dict[str, jax.Array]:
    """The table (``table``) and its optimiser state (``state``) in ``[padded rows, ...]`` row order,
    split by rows over its axis: what is saved (a copy; the table's own arrays are left alone)."""
    split = NamedSharding(table.mesh, P(table.axis))
    arrays = {"table": table.data} | ({} if table.state is None else {"state": table.state})
    spec, s = table.spec, table.shards
    if spec.placement != "table":
        return {k: _to_logical(spec.placement, spec.rows, s, split)(v) for k, v in arrays.items()}
    # Table-wise: padded on its owner, then its rows sent to their shards (a transfer).
    return {k: jax.device_put(_to_logical("table", spec.rows, s, v.sharding)(v), split) for k, v in arrays.items()}


def logical_abstract(spec: TableSpec, optimizer: str, mesh: Mesh, axis: str) -> dict[str, jax.ShapeDtypeStruct]:
    """What :func:`logical_arrays` gives for ``spec`` with ``optimizer``, as shapes and shardings on
    ``mesh`` (split by rows where the shard count divides the padded rows, else whole)."""
    n, s = _padded_rows(spec.rows, 1), mesh.shape[axis]
    split = NamedSharding(mesh, P(axis) if n % s == 0 else P())
    state = {"rowwise_adagrad": (n,), "adagrad": (n, spec.dim)}.get(optimizer)
    shapes = {"table": (n, spec.dim), "state": state}
    return {k: jax.ShapeDtypeStruct(v, jnp.float32, sharding=split) for k, v in shapes.items() if v is not None}


def save_tables(directory: str | Path, tables: Mapping[str, ShardedTable]) -> None:
    """Save ``tables`` (by name) and their optimiser state into the new ``directory``."""
    directory = Path(directory).absolute()
    if directory.exists():
        raise EmbedError(f"{directory}: exists already; embedding tables are saved into a new directory")
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(directory / "arrays", {name: logical_arrays(t) for name, t in tables.items()})
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
    abstract = {}
    for name, spec in specs.items():
        if name not in meta:
            raise EmbedError(f"table {name!r}: not in {directory} (it holds {', '.join(sorted(meta))})")
        m = meta[name]
        if (m["rows"], m["dim"]) != (spec.rows, spec.dim):
            raise EmbedError(f"table {name!r}: saved as {m['rows']} x {m['dim']}, asked for {spec.rows} x {spec.dim}")
        abstract[name] = logical_abstract(spec, m["optimizer"], mesh, axis)
    restored = ocp.StandardCheckpointer().restore(directory / "arrays", abstract)
    return {name: place_logical(restored[name], spec, meta[name]["optimizer"], mesh, axis,
                                (owners or {}).get(name, 0)) for name, spec in specs.items()}


@functools.lru_cache(maxsize=None)
def _from_logical(placement: str, rows: int, out):
    """The jitted relayout of one logical array (``[padded rows, ...]``) into ``placement``'s layout on ``out``."""
    if placement != "row":
        return jax.jit(lambda a: a[:rows], out_shardings=out)
    s = out.mesh.shape[out.spec[0]]
    per = -(-rows // s)

    def relayout(a):
        a = jnp.pad(a[:rows], [(0, per * s - rows)] + [(0, 0)] * (a.ndim - 1))
        return jnp.moveaxis(a.reshape(per, s, *a.shape[1:]), 1, 0)

    return jax.jit(relayout, out_shardings=out)


def place_logical(arrays: Mapping[str, jax.Array], spec: TableSpec, optimizer: str, mesh: Mesh, axis: str,
                  owner: int = 0) -> ShardedTable:
    """The table of ``arrays`` (:func:`logical_arrays`' form) laid out for ``spec.placement`` over
    ``axis`` of ``mesh`` (``owner``: table-wise, the device)."""
    s = mesh.shape[axis]
    if spec.placement == "row":
        shard = lambda a: NamedSharding(mesh, P(axis))  # noqa: E731
    elif spec.placement == "column":
        shard = lambda a: NamedSharding(mesh, P(None, axis) if a.ndim == 2 else P())  # noqa: E731
    elif spec.placement == "data":
        shard = lambda a: NamedSharding(mesh, P())  # noqa: E731
    else:  # the owner takes the rows (a transfer), then drops the padding
        device = SingleDeviceSharding(_axis_devices(mesh, axis)[owner % s])
        arrays = {k: jax.device_put(v, device) for k, v in arrays.items()}
        shard = lambda a: device  # noqa: E731
    placed = {k: _from_logical(spec.placement, spec.rows, shard(v))(v) for k, v in arrays.items()}
    return ShardedTable(dataclasses.replace(spec, optimizer=optimizer), placed["table"], mesh, axis, optimizer,
                        placed.get("state"), owner % s)
