"""Pooled embedding lookups and their sparse updates, over the devices of one mesh axis.

A table is laid out for its spec's placement over the ``S`` devices of one mesh axis
(:func:`shard_table`):

- ``row``: id ``i`` is row ``i // S`` of shard ``i % S`` (jax-tpu-embedding deals rows out the
  same way), so a table of any size spreads evenly and hot low ids do not all land on one
  device. Stored as ``[S, ceil(rows / S), dim]``, split on the first axis.
- ``column``: every shard holds every row, ``dim / S`` of its columns.
- ``table``: the whole table on one device of the axis (``owner``).

:func:`lookup` pools each sample's rows. Row-wise it runs in ``shard_map``: each shard gathers the
ids it owns (the others count zero), pools its part of every sample, and the parts are summed
over the axis (the reduce step of TorchRec's row-wise sharding; its input step, sending each id to
its owner with an all-to-all, this version leaves out: every shard sees every id). Column-wise each
shard gathers and pools its columns, and the result stays split by columns. Table-wise the owner
does it all. The combiner is applied last: ``sum``; ``mean`` divides by the sample's total weight;
``sqrtn`` by the square root of its sum of squared weights; an empty sample pools to zeros.

:func:`apply_gradients` takes the loss's gradient with respect to the pooled embeddings (what
``jax.grad`` of the dense part of a model gives) and updates, in place, only the rows the batch
touched: each id's gradient is its sample's times its weight and the combiner's scale, the
gradients of an id that occurs several times are summed (one update per row, as the dense
gradient would give), and the optimiser (``sgd``; ``adagrad``; ``rowwise_adagrad``, MLPerf
DLRM-v2's, one accumulator per row: the mean of the squared gradient over the row) runs on those
rows only, its state laid out like the table. No table-sized gradient exists at any point: the
largest temporary is ``[ids in the batch, dim]``. (A custom VJP could not do this: JAX wants the
cotangent of a table as large as the table, so the update takes the pooled gradient instead, as
jax-tpu-embedding does.)

The ids of a batch are padded to a power of two (weight 0), so batches compile to few shapes.
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

from hypertron.embed.spec import Jagged, TableSpec

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")


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


def shard_table(values: np.ndarray, spec: TableSpec, mesh: Mesh, axis: str, *, optimizer: str = "sgd",
                state: np.ndarray | None = None, owner: int = 0) -> ShardedTable:
    """``values [rows, dim]`` (and the optimiser's ``state``: zeros when None) laid out and placed
    for ``spec.placement`` over ``axis`` of ``mesh``."""
    values = np.asarray(values)
    if values.shape != (spec.rows, spec.dim):
        raise ValueError(f"table {spec.name!r}: values of shape {values.shape}, spec {(spec.rows, spec.dim)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"table {spec.name!r}: optimizer={optimizer!r}: must be one of {', '.join(OPTIMIZERS)}")
    if optimizer != "sgd" and state is None:
        state = np.zeros((spec.rows,) if optimizer == "rowwise_adagrad" else (spec.rows, spec.dim), np.float32)
    s = mesh.shape[axis]
    if spec.placement == "row":
        per = -(-spec.rows // s)

        def lay(a):
            padded = np.zeros((per * s, *a.shape[1:]), a.dtype)
            padded[:spec.rows] = a
            return np.moveaxis(padded.reshape(per, s, *a.shape[1:]), 1, 0)

        put = lambda a: jax.device_put(lay(a), NamedSharding(mesh, P(axis)))  # noqa: E731
    elif spec.placement == "column":
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P(None, axis) if a.ndim == 2 else P()))  # noqa: E731
    else:
        device = _axis_devices(mesh, axis)[owner % s]
        put = lambda a: jax.device_put(a, SingleDeviceSharding(device))  # noqa: E731
    return ShardedTable(spec, put(values), mesh, axis, optimizer, None if state is None else put(np.asarray(state)),
                        owner % s)


def _prepare(x: Jagged) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Ids, each id's sample and weight, padded to a power of two (id 0, weight 0, sample
    ``batch``, which pooling drops)."""
    n, b = len(x.values), x.batch
    size = 1 << max(n - 1, 0).bit_length()
    ids = np.zeros(size, np.int32)
    seg = np.full(size, b, np.int32)
    w = np.zeros(size, np.float32)
    ids[:n] = x.values
    seg[:n] = np.repeat(np.arange(b, dtype=np.int32), x.lengths)
    w[:n] = 1.0 if x.weights is None else x.weights
    return ids, seg, w, b


def _scale(w: np.ndarray, seg: np.ndarray, b: int, combiner: str) -> np.ndarray:
    """What each sample's pooled sum is multiplied by."""
    if combiner == "sum":
        return np.ones(b, np.float32)
    per = np.bincount(seg, weights=w if combiner == "mean" else w * w, minlength=b + 1)[:b]
    if combiner == "sqrtn":
        per = np.sqrt(per)
    return np.where(per > 0, 1.0 / np.where(per > 0, per, 1.0), 0.0).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What a compiled lookup or update depends on: the table's layout, not its arrays."""

    placement: str
    mesh: Mesh
    axis: str
    optimizer: str

    @property
    def shards(self) -> int:
        return self.mesh.shape[self.axis]


def _layout(table: ShardedTable) -> _Layout:
    return _Layout(table.spec.placement, table.mesh, table.axis, table.optimizer)


def _local(ids, lay: _Layout):
    """Each id's row in this shard's block, and whether this shard owns it (inside shard_map)."""
    if lay.placement != "row":
        return ids, jnp.ones(ids.shape, bool)
    return ids // lay.shards, ids % lay.shards == jax.lax.axis_index(lay.axis)


def _specs(lay: _Layout) -> tuple:
    """shard_map specs of the table, its state and the pooled output."""
    if lay.placement == "row":
        return P(lay.axis), (P() if lay.optimizer == "sgd" else P(lay.axis)), P()
    return P(None, lay.axis), (P(None, lay.axis) if lay.optimizer == "adagrad" else P()), P(None, lay.axis)


def _over_shards(lay: _Layout, fn, in_specs, out_specs):
    if lay.placement == "table":
        return fn
    return jax.shard_map(fn, mesh=lay.mesh, in_specs=in_specs, out_specs=out_specs)


@functools.lru_cache(maxsize=None)
def _pooled_fn(lay: _Layout, batch: int):
    t_spec, _, out_spec = _specs(lay)
    row = lay.placement == "row"

    def shard(t, ids, seg, w):
        local, mine = _local(ids, lay)
        block = t[0] if row else t
        rows = jnp.where(mine[:, None], block[local] * w[:, None], 0.0)
        pooled = jax.ops.segment_sum(rows, seg, num_segments=batch)
        return jax.lax.psum(pooled, lay.axis) if row else pooled

    return jax.jit(_over_shards(lay, shard, (t_spec, P(), P(), P()), out_spec))


def lookup(table: ShardedTable, x: Jagged, combiner: str = "sum") -> jax.Array:
    """The pooled embeddings ``[batch, dim]`` of ``x``'s samples (ids checked by the caller:
    :func:`hypertron.embed.check_ids`)."""
    ids, seg, w, b = _prepare(x)
    pooled = _pooled_fn(_layout(table), b)(table.data, ids, seg, w)
    return pooled * _scale(w, seg, b, combiner)[:, None]


@functools.lru_cache(maxsize=None)
def _update_fn(lay: _Layout, batch: int, dim: int):
    t_spec, s_spec, _ = _specs(lay)
    row, column, opt = lay.placement == "row", lay.placement == "column", lay.optimizer

    def shard(t, state, ids, seg, w, scale, grad, lr, eps):
        block = t[0] if row else t
        local, mine = _local(ids, lay)
        n, r = ids.shape[0], block.shape[0]
        local = jnp.where(mine & (seg < batch), local, r)  # not this shard's, or padding: row r, dropped
        uniq, inv = jnp.unique(local, size=n, fill_value=r, return_inverse=True)
        g_id = jnp.take(grad, seg, axis=0, mode="fill", fill_value=0) * (w * jnp.take(scale, seg, mode="fill",
                                                                                        fill_value=0))[:, None]
        g = jax.ops.segment_sum(g_id, inv.reshape(-1), num_segments=n)  # one gradient per distinct row
        rows = block.at[uniq].get(mode="fill", fill_value=0)
        if opt == "sgd":
            new, new_state = rows - lr * g, state
        else:
            st = state[0] if row else state
            if opt == "adagrad":
                acc = st.at[uniq].get(mode="fill", fill_value=0) + g * g
                new = rows - lr * g / (jnp.sqrt(acc) + eps)
            else:
                sq = jnp.sum(g * g, axis=-1)
                if column:
                    sq = jax.lax.psum(sq, lay.axis)
                acc = st.at[uniq].get(mode="fill", fill_value=0) + sq / dim
                new = rows - lr * g / (jnp.sqrt(acc) + eps)[:, None]
            st = st.at[uniq].set(acc, mode="drop")
            new_state = st[None] if row else st
        block = block.at[uniq].set(new, mode="drop")
        return (block[None] if row else block), new_state

    grad_spec = P(None, lay.axis) if column else P()  # column-wise: each shard its columns' gradient
    specs = (t_spec, s_spec, P(), P(), P(), P(), grad_spec, P(), P())
    return jax.jit(_over_shards(lay, shard, specs, (t_spec, s_spec)), donate_argnums=(0, 1))


def apply_gradients(table: ShardedTable, x: Jagged, grad_pooled, combiner: str = "sum", *, lr: float,
                    eps: float = 1e-8) -> ShardedTable:
    """``table`` after one optimiser step on the rows ``x`` touched, from the gradient of the loss
    with respect to ``lookup(table, x, combiner)`` (``[batch, dim]``). The old arrays are donated."""
    ids, seg, w, b = _prepare(x)
    state = table.state if table.state is not None else jnp.zeros((), jnp.float32)
    fn = _update_fn(_layout(table), b, table.spec.dim)
    data, state = fn(table.data, state, ids, seg, w, _scale(w, seg, b, combiner), jnp.asarray(grad_pooled),
                     jnp.float32(lr), jnp.float32(eps))
    return dataclasses.replace(table, data=data, state=None if table.state is None else state)


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
