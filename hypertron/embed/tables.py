"""Pooled embedding lookups and their sparse updates, over the devices of one mesh axis.

A table is laid out for its spec's placement over the ``S`` devices of one mesh axis
(:func:`shard_table`):

- ``row``: id ``i`` is row ``i // S`` of shard ``i % S`` (jax-tpu-embedding deals rows out the
  same way), so a table of any size spreads evenly and hot low ids do not all land on one
  device. Stored as ``[S, ceil(rows / S), dim]``, split on the first axis.
- ``column``: every shard holds every row, ``dim / S`` of its columns.
- ``table``: the whole table on one device of the axis (``owner``).
- ``data``: the whole table on every device (replicated). Through :func:`lookup` and
  :func:`apply_gradients` every device computes the whole batch, as a table-wise owner does; a
  model's step does better, each device pooling its own samples and the gradient summed with the
  model's (:mod:`hypertron.train.dlrm_fused`).

:func:`lookup` pools each sample's rows, from input laid out on the host by
:func:`hypertron.embed.route` (each step's distinct rows found there, so each is read once).
Row-wise it runs in ``shard_map`` with the batch split by samples over the axis: each device sends
its ids to the shards that own their rows (an all-to-all), each shard pools its part of every
sample of every device, and a reduce-scatter sums those parts and hands each device its own
samples (TorchRec's row-wise input and output steps). Column-wise each shard pools its columns of
every sample, and the result stays split by columns. Table-wise the owner does it all. The
combiner is applied last: ``sum``; ``mean`` divides by the sample's total weight; ``sqrtn`` by
the square root of its sum of squared weights; an empty sample pools to zeros.

:func:`apply_gradients` takes the loss's gradient with respect to the pooled embeddings (what
``jax.grad`` of the dense part of a model gives) and updates, in place, only the rows the batch
touched: each id's gradient is its sample's times its weight and the combiner's scale, the
gradients of an id that occurs several times are summed (one update per row, as the dense
gradient would give), and the optimiser (``sgd``; ``adagrad``; ``rowwise_adagrad``, MLPerf
DLRM-v2's, one accumulator per row: the mean of the squared gradient over the row) runs on those
rows only, its state laid out like the table. No table-sized gradient exists at any point: the
largest temporary is ``[ids in the batch, dim]``. (A custom VJP could not do this: JAX wants the
cotangent of a table as large as the table, so the update takes the pooled gradient instead, as
jax-tpu-embedding does.) Row-wise, the pooled gradient is all-gathered (the transpose of the
reduce-scatter) and each shard updates its own rows.

Input routed per process (:func:`hypertron.embed.route` with ``process``; what a job of several
processes does) holds each id's row, not its place in a list of distinct rows: each shard gathers
the rows it receives directly (row-wise after the all-to-all, column-wise after an all-gather of
every device's ids) and, in an update, sorts them into distinct rows on the device (``jnp.unique``
at the received count) and sums each one's gradients before its optimiser step, so duplicates
within a process and across processes get one update, as above.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from hypertron.embed.route import PAD, Routed, route
from hypertron.embed.spec import OPTIMIZERS, EmbedError, Jagged, TableSpec
from hypertron.hardware import device_memory
from hypertron.units import describe_bytes


@dataclasses.dataclass(frozen=True)
class ShardedTable:
    """A table's values (``data``) and optimiser state (``state``: None for SGD), laid out for its
    placement over the ``mesh.shape[axis]`` devices of ``axis`` (``owner``: table-wise, which one)."""

    spec: TableSpec
    data: jax.Array
    mesh: Mesh
    axis: str
    optimizer: str = "sgd"
    state: jax.Array | None = None
    owner: int = 0

    @property
    def shards(self) -> int:
        return self.mesh.shape[self.axis]

    def dense(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The table ``[rows, dim]`` and its state (``[rows]`` row-wise Adagrad, ``[rows, dim]``
        Adagrad, None for SGD) on the host, whatever the placement."""
        data = np.asarray(self.data)
        state = None if self.state is None else np.asarray(self.state)
        if self.spec.placement == "row":
            data = data.transpose(1, 0, 2).reshape(-1, self.spec.dim)
            if state is not None:
                state = np.moveaxis(state, 0, 1).reshape(-1, *state.shape[2:])
        return data[:self.spec.rows], None if state is None else state[:self.spec.rows]


def _axis_devices(mesh: Mesh, axis: str) -> list:
    """The devices along ``axis`` (at index 0 of the other axes)."""
    devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0)
    return list(devices.reshape(mesh.shape[axis], -1)[:, 0])


def _checked(spec: TableSpec, mesh: Mesh, axis: str, optimizer: str | None) -> TableSpec:
    """``spec`` with its optimiser, once it is known to fit a device under its placement."""
    optimizer = optimizer or spec.optimizer
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"table {spec.name!r}: optimizer={optimizer!r}: must be one of {', '.join(OPTIMIZERS)}")
    spec = dataclasses.replace(spec, optimizer=optimizer)
    need, have = spec.device_bytes(mesh.shape[axis]), device_memory(mesh.devices.flat[0])
    if have is not None and need > have:
        raise EmbedError(f"table {spec.name!r}: needs {describe_bytes(need)} on a device {spec.placement}-wise over "
                         f"{mesh.shape[axis]} devices, more than a device's {describe_bytes(have)}")
    return spec


def _sharding(spec: TableSpec, mesh: Mesh, axis: str, owner: int, ndim: int):
    """Where a table's array (``ndim`` 2: values or Adagrad's state; 1: row-wise Adagrad's) lives."""
    if spec.placement == "row":
        return NamedSharding(mesh, P(axis))
    if spec.placement == "column":
        return NamedSharding(mesh, P(None, axis) if ndim == 2 else P())
    if spec.placement == "data":
        return NamedSharding(mesh, P())
    return SingleDeviceSharding(_axis_devices(mesh, axis)[owner % mesh.shape[axis]])


def _state_shape(spec: TableSpec) -> tuple[int, ...] | None:
    return {"sgd": None, "rowwise_adagrad": (spec.rows,), "adagrad": (spec.rows, spec.dim)}[spec.optimizer]


def shard_table(values: np.ndarray, spec: TableSpec, mesh: Mesh, axis: str, *, optimizer: str | None = None,
                state: np.ndarray | None = None, owner: int = 0) -> ShardedTable:
    """``values [rows, dim]`` (and the optimiser's ``state``: zeros when None) laid out and placed
    for ``spec.placement`` over ``axis`` of ``mesh``; ``optimizer``: the spec's when None. A table
    that does not fit a device under its placement is refused before anything is copied."""
    values = np.asarray(values)
    if values.shape != (spec.rows, spec.dim):
        raise ValueError(f"table {spec.name!r}: values of shape {values.shape}, spec {(spec.rows, spec.dim)}")
    spec = _checked(spec, mesh, axis, optimizer)
    if spec.optimizer != "sgd" and state is None:
        state = np.zeros(_state_shape(spec), np.float32)
    s = mesh.shape[axis]

    def put(a):
        if spec.placement == "row":
            per = -(-spec.rows // s)
            padded = np.zeros((per * s, *a.shape[1:]), a.dtype)
            padded[:spec.rows] = a
            a = np.moveaxis(padded.reshape(per, s, *a.shape[1:]), 1, 0)
        return jax.device_put(a, _sharding(spec, mesh, axis, owner, np.ndim(a) - (spec.placement == "row")))

    return ShardedTable(spec, put(values), mesh, axis, spec.optimizer,
                        None if state is None else put(np.asarray(state, np.float32)), owner % s)


def init_table(spec: TableSpec, mesh: Mesh, axis: str, *, seed: int = 0, optimizer: str | None = None,
               owner: int = 0) -> ShardedTable:
    """A new table, made on its devices in its layout (no host copy, whatever its size): values
    uniform in ``[-scale, scale]`` with ``spec.init_scale``, or TorchRec's default
    ``sqrt(1 / rows)``; the optimiser's state zeros. The values depend on ``seed`` only, not on
    the placement or the shard count (JAX's partitionable random bits)."""
    spec = _checked(spec, mesh, axis, optimizer)
    s, rows, dim = mesh.shape[axis], spec.rows, spec.dim
    scale = spec.init_scale if spec.init_scale is not None else math.sqrt(1.0 / rows)
    per = -(-rows // s)

    def lay(a):  # logical rows -> this placement's layout (row-wise: [S, per, ...], id i at [i % S, i // S])
        if spec.placement != "row":
            return a
        a = jnp.pad(a, [(0, per * s - rows)] + [(0, 0)] * (a.ndim - 1))
        return jnp.moveaxis(a.reshape(per, s, *a.shape[1:]), 1, 0)

    def values():
        return lay(jax.random.uniform(jax.random.key(seed), (rows, dim), jnp.float32, -scale, scale))

    data = jax.jit(values, out_shardings=_sharding(spec, mesh, axis, owner, 2))()
    state = None
    shape = _state_shape(spec)
    if shape is not None:
        state = jax.jit(lambda: lay(jnp.zeros(shape, jnp.float32)),
                        out_shardings=_sharding(spec, mesh, axis, owner, len(shape)))()
    return ShardedTable(spec, data, mesh, axis, spec.optimizer, state, owner % s)


def abstract_table(spec: TableSpec, mesh: Mesh, axis: str, *, optimizer: str | None = None,
                   owner: int = 0) -> ShardedTable:
    """The table :func:`init_table` would make, with ``jax.ShapeDtypeStruct`` s (shape, dtype,
    sharding) for arrays: what restoring a checkpoint into this layout needs. Nothing is allocated."""
    spec = _checked(spec, mesh, axis, optimizer)
    s = mesh.shape[axis]
    per = -(-spec.rows // s)

    def shaped(shape: tuple[int, ...]):
        laid = (s, per, *shape[1:]) if spec.placement == "row" else shape
        return jax.ShapeDtypeStruct(laid, jnp.float32, sharding=_sharding(spec, mesh, axis, owner, len(shape)))

    state = _state_shape(spec)
    return ShardedTable(spec, shaped((spec.rows, spec.dim)), mesh, axis, spec.optimizer,
                        None if state is None else shaped(state), owner % s)


def pooled_sharding(table: ShardedTable):
    """Where :func:`lookup` leaves a table's pooled embeddings ``[batch, dim]`` (and where
    :func:`apply_gradients` wants their gradient): split by samples row-wise, by columns
    column-wise, on the owner table-wise, on every device data-parallel."""
    if table.spec.placement == "row":
        return NamedSharding(table.mesh, P(table.axis))
    if table.spec.placement == "column":
        return NamedSharding(table.mesh, P(None, table.axis))
    if table.spec.placement == "data":
        return NamedSharding(table.mesh, P())
    return SingleDeviceSharding(_axis_devices(table.mesh, table.axis)[table.owner])


def process_values(n: int) -> list[int]:
    """Each process's value of the host integer ``n``, in process order (one small collective)."""
    if jax.process_count() == 1:
        return [int(n)]
    from jax.experimental import multihost_utils

    return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int32(n))).reshape(-1)]


def _routed(table: ShardedTable, x: Jagged | Routed, combiner: str, capacity: int | None, overflow: str) -> Routed:
    if isinstance(x, Routed):
        if (x.placement, x.shards) != (table.spec.placement, table.shards):
            raise ValueError(f"table {table.spec.name!r}: input routed for {x.placement}-wise on {x.shards} shards, "
                             f"the table is {table.spec.placement}-wise on {table.shards}")
        return x
    process = (jax.process_index(), jax.process_count()) if jax.process_count() > 1 else None
    return route(table.spec, x, combiner, table.shards, capacity=capacity, overflow=overflow, process=process,
                 gather=process_values)


def routed_inputs(table: ShardedTable, r: Routed) -> tuple:
    """``r``'s arrays as the compiled lookup and update take them: routed on several processes,
    each one global, assembled from every process's part (split by devices on the first axis)."""
    if r.processes == 1:
        return r.arrays()
    split = NamedSharding(table.mesh, P(table.axis))
    return tuple(jax.make_array_from_process_local_data(split, a) for a in r.arrays())


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What a compiled lookup or update depends on: the table's layout, not its arrays."""

    placement: str
    mesh: Mesh
    axis: str
    optimizer: str
    merged: bool = False  # input routed per process: duplicates merged on the device
    gathered: bool = False  # merged column-wise input gathered already (gather_ids): whole on every device

    @property
    def shards(self) -> int:
        return self.mesh.shape[self.axis]


def _layout(table: ShardedTable, merged: bool = False, gathered: bool = False) -> _Layout:
    return _Layout(table.spec.placement, table.mesh, table.axis, table.optimizer, merged, gathered)


def _specs(lay: _Layout) -> tuple:
    """shard_map specs of the table, its state, the routed ids, the pooled output (or its gradient)
    and the combiner's scale."""
    if lay.placement == "row":
        return P(lay.axis), (P() if lay.optimizer == "sgd" else P(lay.axis)), P(lay.axis), P(lay.axis), P(lay.axis)
    ids = P(lay.axis) if lay.merged and not lay.gathered else P()  # per process: each device's own samples' ids
    return P(None, lay.axis), (P(None, lay.axis) if lay.optimizer == "adagrad" else P()), ids, P(None, lay.axis), ids


def _over_shards(lay: _Layout, fn, in_specs, out_specs):
    if lay.placement in ("table", "data"):
        return fn
    return jax.shard_map(fn, mesh=lay.mesh, in_specs=in_specs, out_specs=out_specs)


def _receive(lay: _Layout, per: int, slot, seg, w):
    """Row-wise, inside shard_map: the ids this shard owns, from every source device (all-to-all):
    each one's place in this shard's distinct rows, its sample among the whole padded batch
    (``S * per`` for padding) and its weight, flat."""
    s = lay.shards
    ids = jax.lax.all_to_all(jnp.stack([slot[0], seg[0]]), lay.axis, 1, 1, tiled=True)  # [2, source, capacity]
    w = jax.lax.all_to_all(w[0], lay.axis, 0, 0, tiled=True)
    sample = jnp.where(ids[1] < per, jnp.arange(s, dtype=jnp.int32)[:, None] * per + ids[1], s * per)
    return ids[0].reshape(-1), sample.reshape(-1), w.reshape(-1)


def _every_ids(axis: str, s: int, per: int, mine, sizes: tuple[tuple[int, int], ...],
               checked: bool = True) -> list[tuple]:
    """Column-wise, routed per process, inside shard_map over ``axis`` (``s`` devices): from
    ``mine``, this device's part of some tables' input packed as one int32 vector (per table
    ``slot, seg, w, scale`` of ``sizes``' ``(capacity, samples)``, floats bitcast: :func:`pack_ids`),
    each table's every device's ids, each one's sample among the whole padded batch (``S * per``
    for padding), its weight and every sample's scale. One collective for all of them: an
    all-gather, or where the shard_map's replication check is on (``checked``), each device's part
    in its place, summed (zeros elsewhere: exact), a value the check sees as the same on every
    device, as an all-gather's is not (at the cost of S / 2 times the bytes moved or more)."""
    if checked:
        every = jax.lax.psum(jnp.zeros((s, mine.shape[0]), jnp.int32).at[jax.lax.axis_index(axis)].set(mine), axis)
    else:
        every = jax.lax.all_gather(mine, axis)
    out, start = [], 0
    for cap, n in sizes:
        rows, seg, w, sc = (every[:, start + a:start + b] for a, b in
                            ((0, cap), (cap, 2 * cap), (2 * cap, 3 * cap), (3 * cap, 3 * cap + n)))
        start += 3 * cap + n
        w, sc = (jax.lax.bitcast_convert_type(a, jnp.float32) for a in (w, sc))
        sample = jnp.where(seg < per, jnp.arange(s, dtype=jnp.int32)[:, None] * per + seg, s * per)
        out.append((rows.reshape(-1), sample.reshape(-1), w.reshape(-1), sc.reshape(-1)))
    return out


def pack_ids(routed: list[Routed], xp=np):
    """Column-wise tables' input routed per process, as one int32 array ``[local devices, total]``
    (per device, each table's ``slot, seg, w, scale`` in turn, the floats bitcast), so that it
    travels to the devices, and between them, as one array (:func:`hypertron.embed.grouped.gather_ids`).
    ``xp``: ``jax.numpy`` inside a ``jax.jit`` (then ``routed``: tuples of arrays)."""
    bits = (lambda a: a.view(np.int32)) if xp is np else (lambda a: jax.lax.bitcast_convert_type(a, jnp.int32))
    parts = []
    for r in routed:
        slot, seg, w, scale = r.arrays() if isinstance(r, Routed) else r
        d = slot.shape[0]
        parts += [slot, seg, bits(w), bits(scale).reshape(d, -1)]
    return xp.concatenate(parts, axis=1)


def _ids(lay: _Layout, per: int, routed: tuple):
    """Inside shard_map: the ids this shard reads (places in ``uniq``, or rows when merged on the
    device), each one's sample (among every device's when row-wise or merged), its weight, and the
    scale of the samples the output holds (the whole batch column-wise when merged)."""
    if lay.merged:
        slot, seg, w, scale = routed
        uniq = None
    else:
        uniq, slot, seg, w, scale = routed
    if lay.placement == "row":
        slot, seg, w = _receive(lay, per, slot, seg, w)
        uniq = None if uniq is None else uniq[0]
    elif lay.merged and not lay.gathered:
        mine = pack_ids([(slot, seg, w, scale)], jnp)[0]
        ((slot, seg, w, scale),) = _every_ids(lay.axis, lay.shards, per, mine, ((slot.shape[-1], per),))
    return uniq, slot, seg, w, scale


@functools.lru_cache(maxsize=None)
def _pooled_fn(lay: _Layout, per: int):
    t_spec, _, in_spec, out_spec, scale_spec = _specs(lay)
    row = lay.placement == "row"
    samples = lay.shards * per if row or lay.merged else per

    def shard(t, *routed):
        uniq, slot, sample, w, scale = _ids(lay, per, routed)
        t = t[0] if row else t
        if uniq is None:  # merged on the device: the rows themselves
            vals = t.at[slot].get(mode="fill", fill_value=0) * w[:, None]
        else:
            vals = t.at[uniq].get(mode="fill", fill_value=0)[slot] * w[:, None]  # each distinct row read once
        partial = jax.ops.segment_sum(vals, sample, num_segments=samples)
        if row:
            partial = jax.lax.psum_scatter(partial.reshape(lay.shards, per, -1), lay.axis, scatter_dimension=0)
        return partial * scale[:, None]

    ids = (in_spec,) * (3 if lay.merged else 4)
    return jax.jit(_over_shards(lay, shard, (t_spec, *ids, scale_spec), out_spec))


def lookup(table: ShardedTable, x: Jagged | Routed, combiner: str = "sum", *, capacity: int | None = None,
           overflow: str = "raise") -> jax.Array:
    """The pooled embeddings ``[batch, dim]`` of ``x``'s samples (ids checked by the caller:
    :func:`hypertron.embed.check_ids`), split by samples over the axis row-wise, by columns
    column-wise, on the owner table-wise. ``x`` may be routed already (:func:`route`), else it
    is routed here (``capacity``, ``overflow``: as :func:`route` takes them)."""
    r = _routed(table, x, combiner, capacity, overflow)
    pooled = _pooled_fn(_layout(table, r.merged_on_device), r.per_device)(table.data, *routed_inputs(table, r))
    return pooled if r.padded_batch == r.batch or r.processes > 1 else pooled[:r.batch]


def _apply(lay: _Layout, dim: int, block, st, uniq, g, lr, eps, sq=None):
    """The optimiser on the distinct rows ``uniq`` (padding: past the block), with their
    gradients ``g``; ``block`` and ``st`` updated in place. ``sq``: row-wise Adagrad's sums of
    each row's squared gradient over the whole row (column-wise, over every shard), when the
    caller summed them already."""
    rows = block.at[uniq].get(mode="fill", fill_value=0)
    if lay.optimizer == "sgd":
        return block.at[uniq].set(rows - lr * g, mode="drop"), st
    if lay.optimizer == "adagrad":
        acc = st.at[uniq].get(mode="fill", fill_value=0) + g * g
        new = rows - lr * g / (jnp.sqrt(acc) + eps)
    else:
        if sq is None:
            sq = jnp.sum(g * g, axis=-1)
            if lay.placement == "column":
                sq = jax.lax.psum(sq, lay.axis)
        acc = st.at[uniq].get(mode="fill", fill_value=0) + sq / dim
        new = rows - lr * g / (jnp.sqrt(acc) + eps)[:, None]
    return block.at[uniq].set(new, mode="drop"), st.at[uniq].set(acc, mode="drop")


def _distinct(rows: int, received: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The distinct rows of a shard's ``received`` rows (PAD past the shard's ``rows``; unused
    places PAD too) and each received one's place among them. Where the shard has no more rows
    than it received, its rows themselves, every one PAD but those received: no sort, and no
    temporary larger than the received ones'; else sorted (``jnp.unique``: XLA's CPU sort was
    most of a multi-process step, 2026-11-29)."""
    if rows <= received.shape[0]:
        every = jnp.arange(rows, dtype=received.dtype)
        touched = jnp.zeros(rows, bool).at[received].set(True, mode="drop")
        return jnp.where(touched, every, PAD), received
    uniq, slot = jnp.unique(received, size=received.shape[0], fill_value=PAD, return_inverse=True)
    return uniq, slot.reshape(-1)


def _row_grads(lay: _Layout, per: int, block, routed: tuple, grad):
    """Inside shard_map: the distinct rows this shard updates (padding: past the block) and each
    one's gradient, summed over its ids, from the pooled gradient ``grad``."""
    uniq, slot, sample, w, scale = _ids(lay, per, routed)
    g = grad * scale[:, None]
    if lay.placement == "row":  # every sample's gradient where its ids' rows live: the transpose of the scatter
        g = jax.lax.all_gather(g, lay.axis, tiled=True)
    g_id = jnp.take(g, sample, axis=0, mode="fill", fill_value=0) * w[:, None]
    if uniq is None:  # merged here: one gradient per distinct received row (padding: PAD, past the block)
        uniq, slot = _distinct(block.shape[0], slot)
    return uniq, jax.ops.segment_sum(g_id, slot, num_segments=uniq.shape[0])  # one gradient per distinct row


def _own(lay: _Layout, t, state) -> tuple:
    """Inside shard_map: this shard's block of the table and of its state (None for SGD)."""
    if lay.placement == "row":
        return t[0], (None if state.ndim == 0 else state[0])
    return t, (None if state.ndim == 0 else state)


def _laid(lay: _Layout, block, st, state) -> tuple:
    """:func:`_own`'s inverse, after an update (``state``: what came in, for SGD's placeholder)."""
    row = lay.placement == "row"
    return (block[None] if row else block), (state if st is None else st[None] if row else st)


def _update_specs(lay: _Layout) -> tuple:
    """shard_map specs of one table's update: its arguments (lr and eps last) and results."""
    t_spec, s_spec, in_spec, grad_spec, scale_spec = _specs(lay)
    return (t_spec, s_spec, *(in_spec,) * (3 if lay.merged else 4), scale_spec, grad_spec), (t_spec, s_spec)


@functools.lru_cache(maxsize=None)
def _update_fn(lay: _Layout, per: int, dim: int):
    def shard(t, state, *args):
        *routed, grad, lr, eps = args
        block, st = _own(lay, t, state)
        uniq, g_row = _row_grads(lay, per, block, tuple(routed), grad)
        return _laid(lay, *_apply(lay, dim, block, st, uniq, g_row, lr, eps), state)

    specs, out = _update_specs(lay)
    return jax.jit(_over_shards(lay, shard, (*specs, P(), P()), out), donate_argnums=(0, 1))


def apply_gradients(table: ShardedTable, x: Jagged | Routed, grad_pooled, combiner: str = "sum", *, lr: float,
                    eps: float = 1e-8, capacity: int | None = None, overflow: str = "raise") -> ShardedTable:
    """``table`` after one optimiser step on the rows ``x`` touched, from the gradient of the loss
    with respect to ``lookup(table, x, combiner)`` (``[batch, dim]``). The old arrays are donated."""
    r = _routed(table, x, combiner, capacity, overflow)
    grad = jnp.asarray(grad_pooled)
    if r.padded_batch != r.batch:
        grad = jnp.pad(grad, ((0, r.padded_batch - r.batch), (0, 0)))
    state = table.state if table.state is not None else jnp.zeros((), jnp.float32)
    fn = _update_fn(_layout(table, r.merged_on_device), r.per_device, table.spec.dim)
    data, state = fn(table.data, state, *routed_inputs(table, r), grad, jnp.float32(lr), jnp.float32(eps))
    return dataclasses.replace(table, data=data, state=None if table.state is None else state)


def pooling_fn(table: ShardedTable, per_device: int, merged: bool = False, gathered: bool = False):
    """:func:`lookup`'s compiled function for this table's layout, to call inside a larger
    ``jax.jit`` (a model's whole step): ``(data, *routed.arrays()) -> pooled [padded batch, dim]``;
    ``merged``: for input routed per process (:attr:`Routed.merged_on_device`); ``gathered``: and,
    column-wise, gathered already (:func:`hypertron.embed.grouped.gather_ids`)."""
    return _pooled_fn(_layout(table, merged, gathered), per_device)


def update_fn(table: ShardedTable, per_device: int, merged: bool = False, gathered: bool = False):
    """:func:`apply_gradients`' compiled function for this table's layout, to call inside a larger
    ``jax.jit``: ``(data, state, *routed.arrays(), grad [padded batch, dim], lr, eps) -> (data,
    state)``; ``state`` is a float32 scalar for SGD (and comes back unchanged)."""
    return _update_fn(_layout(table, merged, gathered), per_device, table.spec.dim)


def update_whole(table: ShardedTable, data, state, grad, lr, eps):
    """A data-parallel table's optimiser step from the gradient of the whole table ``[rows, dim]``
    (summed over the devices already), inside a ``jax.jit``: ``(data, state)`` back (``state`` a
    float32 scalar for SGD, as :func:`update_fn` takes it). Every row takes the step; a row the
    batch did not touch has a zero gradient, which leaves it and its accumulator as they were
    (exactly, for ``eps > 0``), so this equals the sparse update of the touched rows."""
    lay = _layout(table)
    st = None if state.ndim == 0 else state
    uniq = jnp.arange(data.shape[0], dtype=jnp.int32)
    data, st = _apply(lay, table.spec.dim, data, st, uniq, grad, lr, eps)
    return data, state if st is None else st


def reference_lookup(values: np.ndarray, x: Jagged, combiner: str = "sum") -> np.ndarray:
    """The same pooling in float64 numpy on one unsharded table: the oracle for tests."""
    m = _reference_pooling(x, combiner)
    return m @ values[:m.shape[1]].astype(np.float64)


def _reference_pooling(x: Jagged, combiner: str) -> np.ndarray:
    """``[batch, rows used]`` as a dense pooling matrix over the table's rows (float64)."""
    rows = int(np.max(x.values)) + 1 if len(x.values) else 1
    m = np.zeros((x.batch, rows))
    start = 0
    for i, n in enumerate(np.asarray(x.lengths)):
        ids = np.asarray(x.values[start:start + n])
        w = np.ones(n) if x.weights is None else np.asarray(x.weights[start:start + n], np.float64)
        start += n
        div = {"sum": 1.0, "mean": w.sum(), "sqrtn": math.sqrt((w * w).sum())}[combiner] if n else 0.0
        np.add.at(m[i], ids, w / div if div else 0.0)
    return m


def reference_update(values: np.ndarray, state: np.ndarray | None, x: Jagged, grad_pooled: np.ndarray,
                     combiner: str, optimizer: str, lr: float, eps: float = 1e-8):
    """One optimiser step on the whole table with its dense gradient, in float64 numpy: untouched
    rows have a zero gradient, so it changes exactly the rows the batch touched."""
    m = _reference_pooling(x, combiner)
    grad = np.zeros(values.shape)
    grad[:m.shape[1]] = m.T @ np.asarray(grad_pooled, np.float64)
    touched = np.zeros(values.shape[0], bool)
    touched[np.asarray(x.values, int)] = True
    v = values.astype(np.float64)
    if optimizer == "sgd":
        return v - lr * grad, None
    if optimizer == "adagrad":
        acc = state + grad * grad
        return np.where(touched[:, None], v - lr * grad / (np.sqrt(acc) + eps), v), acc
    acc = state + np.where(touched, (grad * grad).mean(-1), 0.0)
    return np.where(touched[:, None], v - lr * grad / (np.sqrt(acc) + eps)[:, None], v), acc
