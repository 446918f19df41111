"""DLRM's whole step as one compiled program (:func:`fused_programs`): lookups, the dense step, the
sparse updates, and the logits the same way.

Built where every table lives on the mesh's devices as one ``jax.jit`` can take them: split row- or
column-wise, or whole on a mesh of one device (a whole table on one of several devices is an array
of another device set, so those steps run in parts, :meth:`hypertron.train.dlrm.DlrmTrainer.step`).

The step's exchanges between devices are few and grouped, one collective each, whatever the number
of tables (on a multi-process CPU job each is a gloo round trip, and XLA's CPU runtime makes one a
buffer even of the all-reduces it combines: 28 arrays summed one by one took 13 ms a step against
0.35 ms as one, 2026-11-29):

1. routed per process, every column-wise table's ids gathered onto the devices
   (:func:`hypertron.embed.grouped.gather_ids`, from one packed host array);
2. the column-wise tables' pooled rows to the samples' devices
   (:func:`hypertron.embed.grouped.reshard_pooled`), and their gradients back;
3. the dense gradient (with the loss) summed as one flat vector (:func:`summed_dense_step`);
4. row-wise Adagrad's row sums of every column-wise table in one ``psum``
   (:func:`hypertron.embed.grouped.update_columns`).

A data-parallel table (``data``: TorchRec's ``data_parallel``, what the planner picks for a small
table on several processes) takes part in none of them: each device pools its own samples' ids
(the batch's own ``sparse`` columns, fixed ids a sample) from its own copy, inside the dense
step, and the gradient of the whole table joins the MLPs' in the one flat all-reduce; every copy
then takes the same optimiser step (:func:`hypertron.embed.tables.update_whole`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hypertron.embed import ShardedTable, pooling_fn, update_fn
from hypertron.embed.grouped import gather_ids, reshard_pooled, update_columns
from hypertron.embed.tables import update_whole
from hypertron.recsys import dlrm


def data_parallel_pooled(tables: list, ids, hots: list[int]) -> list:
    """Data-parallel tables' pooled rows (sum) of ``ids [batch, sum of hots]`` (each table's
    ``hot`` ids a sample in turn), from each device's own copy: no exchange."""
    starts = [sum(hots[:i]) for i in range(len(hots) + 1)]
    return [jnp.take(t, ids[:, a:b], axis=0).sum(1) for t, a, b in zip(tables, starts[:-1], starts[1:])]


def summed_dense_step(mesh: Mesh, axis: str, batch: int, optimizer: optax.GradientTransformation, lr,
                      hots: list[int]):
    """The dense step over a batch split by samples over ``axis`` (the forward pass, the mean
    log-loss, its gradient with respect to the MLPs, to each pooled embedding and to each
    data-parallel table, the MLPs' optimiser), with each device's gradients summed as one flat
    vector: one all-reduce. ``(dense, opt, step, x, y, pooled, tables, ids) -> (dense, opt, pooled
    gradients, tables' gradients, metrics)``: ``pooled`` None where a data-parallel table (of
    ``tables``, its ``hots`` ids a sample in ``ids``) pools its own, in feature order."""

    def part(dense, tables, x, y, pooled, ids):  # this device's samples' share of the loss and of its gradients
        def loss_fn(dense, tables, pooled):
            own = iter(data_parallel_pooled(tables, ids, hots))
            full = [next(own) if p is None else p for p in pooled]
            return jnp.sum(dlrm.bce_with_logits(dlrm.forward(dense, x, full), y)) / batch

        # Their gradients this device's, summed below in one collective.
        dense, tables = jax.tree.map(lambda a: jax.lax.pcast(a, axis, to="varying"), (dense, tables))
        loss, (g_dense, g_tables, g_pooled) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(dense, tables, pooled)
        flat, unravel = ravel_pytree((loss, g_dense, g_tables))
        return (*unravel(jax.lax.psum(flat, axis)), g_pooled)

    summed = jax.shard_map(part, mesh=mesh, in_specs=(P(), P(), P(axis), P(axis), P(axis), P(axis)),
                           out_specs=(P(), P(), P(), P(axis)))

    def step_fn(dense, opt, step, x, y, pooled, tables, ids):
        loss, g_dense, g_tables, g_pooled = summed(dense, tables, x, y, pooled, ids)
        updates, opt = optimizer.update(g_dense, opt, dense)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(g_dense), "lr": jnp.asarray(lr(step), jnp.float32),
                   "samples": jnp.float32(batch)}
        return optax.apply_updates(dense, updates), opt, g_pooled, g_tables, metrics

    return step_fn


def _subset(mask: list[bool], done: list, rest: list) -> list:
    """``rest`` with the places ``mask`` marks taken, in order, from ``done``."""
    it = iter(done)
    return [next(it) if m else r for r, m in zip(rest, mask)]


def _of(mask: list[bool], xs: list) -> list:
    """The items of ``xs`` that ``mask`` marks."""
    return [x for x, m in zip(xs, mask) if m]


def _members(features: list[tuple[int, int | None]], count: int) -> tuple[list, list, list]:
    """Per array: its features, whether it is a group of tables, and its samples per sample."""
    members = [[f for f, (a, _) in enumerate(features) if a == i] for i in range(count)]
    grouped = [any(features[f][1] is not None for f in m) for m in members]
    return members, grouped, [len(m) if g else 1 for m, g in zip(members, grouped)]


def fused_programs(arrays: list[ShardedTable], features: list[tuple[int, int | None]], mesh: Mesh, axis: str,
                   batch: int, capacities: list[int], hots: list[int], per_process: bool,
                   optimizer: optax.GradientTransformation, lr, eps: float) -> tuple:
    """``(step, predict, gathered)``: the whole step
    ``(dense, opt, tables, accs, step, x, y, routed) -> (dense, opt, tables, accs, metrics)`` (the
    dense and table arguments donated), the logits ``(dense, tables, x, routed, zero) -> [batch]``,
    and per array whether its routing travels packed. ``arrays``: each table's layout, a group of
    table-wise tables one (:mod:`hypertron.embed.batched`: its features' samples interleaved);
    ``features``: each feature's array and place in its group (None: its own table), in feature
    order; ``capacities``: each array's routing's; ``hots``: each feature's ids a sample.
    ``routed`` is ``(packed or None, each array's routing (() where packed or data-parallel), the
    data-parallel tables' ids or None)``."""
    s, b = mesh.shape[axis], batch
    batch_sharding = NamedSharding(mesh, P(axis))
    members, grouped, width = _members(features, len(arrays))
    per = [(-(-b // s) if t.spec.placement == "row" or per_process else b) * w for t, w in zip(arrays, width)]
    gathered = [per_process and t.spec.placement == "column" for t in arrays]
    columns = [t.spec.placement == "column" and s > 1 for t in arrays]
    own = [t.spec.placement == "data" for t in arrays]  # data-parallel: each device pools its own samples
    pools = [None if o else pooling_fn(t, n, per_process, g) for t, n, g, o in zip(arrays, per, gathered, own)]
    updates = [None if o else update_fn(t, n, per_process, g) for t, n, g, o in zip(arrays, per, gathered, own)]
    own_hots = [hots[[a for a, _ in features].index(i)] for i, o in enumerate(own) if o]
    dense_step = summed_dense_step(mesh, axis, b, optimizer, lr, own_hots)

    def gather(packed, inputs: list) -> list:
        if packed is None:
            return inputs
        return _subset(gathered, gather_ids(_of(gathered, arrays), -(-b // s), packed, _of(gathered, capacities)),
                       inputs)

    def reshard(xs: list, to_samples: bool) -> list:
        if not any(columns):
            return xs
        return _subset(columns, reshard_pooled(_of(columns, arrays), _of(columns, xs), to_samples), xs)

    def by_feature(pooled: list) -> list:  # each array's pooled rows -> each feature's
        return [pooled[a] if k is None else pooled[a].reshape(b, width[a], -1)[:, k] for a, k in features]

    def by_array(grads: list) -> list:  # each feature's gradient -> each array's
        return [jnp.stack([grads[f] for f in m], axis=1).reshape(b * len(m), -1) if g else grads[m[0]]
                for m, g in zip(members, grouped)]

    def pooled_rows(data, routed: tuple) -> tuple[list, list]:
        """The routing as the updates take it, and each feature's pooled rows split by samples
        (None where data-parallel: the dense step pools those)."""
        packed, inputs, _ = routed
        inputs = gather(packed, inputs)
        pooled = reshard([None if o else pool(t, *r)[:b * w]
                          for pool, t, r, o, w in zip(pools, data, inputs, own, width)], True)
        return inputs, by_feature(pooled)

    def update_all(data, accs, routed, grads, whole, lr) -> list:
        e = jnp.float32(eps)
        args = [(d, a, *r, g) for d, a, r, g in zip(data, accs, routed, grads)]
        done = update_columns(_of(columns, arrays), _of(columns, per)[0], per_process, per_process,
                              _of(columns, args), lr, e) if any(columns) else []
        whole = iter(whole)
        rest = [None if c else update_whole(t, x[0], x[1], next(whole), lr, e) if o else fn(*x, lr, e)
                for t, fn, x, c, o in zip(arrays, updates, args, columns, own)]
        return _subset(columns, done, rest)

    def whole_step(dense, opt, data, accs, step, x, y, routed):
        x, y = jax.lax.with_sharding_constraint((x, y), batch_sharding)
        inputs, pooled = pooled_rows(data, routed)
        dense, opt, grads, whole, metrics = dense_step(dense, opt, step, x, y, pooled, _of(own, data), routed[2])
        new = update_all(data, accs, inputs, reshard(by_array(grads), False), whole, metrics["lr"])
        return dense, opt, [d for d, _ in new], [a for _, a in new], metrics

    def whole_predict(dense, data, x, routed, zero):
        _, pooled = pooled_rows(data, routed)
        if any(own):
            mine = iter(data_parallel_pooled(_of(own, data), routed[2], own_hots))
            pooled = [next(mine) if p is None else p for p in pooled]
        if zero:
            pooled = [jnp.zeros_like(p) for p in pooled]
        x, pooled = jax.lax.with_sharding_constraint((x, pooled), batch_sharding)
        return dlrm.forward(dense, x, pooled)

    return (jax.jit(whole_step, donate_argnums=(0, 1, 2, 3)),
            jax.jit(whole_predict, static_argnums=4, out_shardings=batch_sharding), gathered)
