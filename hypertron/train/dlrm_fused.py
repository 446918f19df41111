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
from hypertron.recsys import dlrm


def summed_dense_step(mesh: Mesh, axis: str, batch: int, optimizer: optax.GradientTransformation, lr):
    """The dense step over a batch split by samples over ``axis`` (the forward pass, the mean
    log-loss, its gradient with respect to the MLPs and to each pooled embedding, the MLPs'
    optimiser), with each device's gradient summed as one flat vector: one all-reduce.
    ``(dense, opt, step, x, y, pooled) -> (dense, opt, pooled gradients, metrics)``."""

    def part(dense, x, y, pooled):  # this device's samples' share of the loss and of its gradients
        def loss_fn(dense, pooled):
            return jnp.sum(dlrm.bce_with_logits(dlrm.forward(dense, x, pooled), y)) / batch

        dense = jax.lax.pcast(dense, axis, to="varying")  # its gradient this device's, summed below
        loss, (g_dense, g_pooled) = jax.value_and_grad(loss_fn, argnums=(0, 1))(dense, pooled)
        flat, unravel = ravel_pytree((loss, g_dense))
        return (*unravel(jax.lax.psum(flat, axis)), g_pooled)

    summed = jax.shard_map(part, mesh=mesh, in_specs=(P(), P(axis), P(axis), P(axis)),
                           out_specs=(P(), P(), P(axis)))

    def step_fn(dense, opt, step, x, y, pooled):
        loss, g_dense, g_pooled = summed(dense, x, y, pooled)
        updates, opt = optimizer.update(g_dense, opt, dense)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(g_dense), "lr": jnp.asarray(lr(step), jnp.float32),
                   "samples": jnp.float32(batch)}
        return optax.apply_updates(dense, updates), opt, g_pooled, metrics

    return step_fn


def _subset(mask: list[bool], done: list, rest: list) -> list:
    """``rest`` with the places ``mask`` marks taken, in order, from ``done``."""
    it = iter(done)
    return [next(it) if m else r for r, m in zip(rest, mask)]


def fused_programs(tables: list[ShardedTable], mesh: Mesh, axis: str, batch: int, capacities: list[int],
                   per_process: bool, dense_step, eps: float) -> tuple:
    """``(step, predict, gathered)``: the whole step
    ``(dense, opt, tables, accs, step, x, y, routed) -> (dense, opt, tables, accs, metrics)`` (the
    dense and table arguments donated), the logits ``(dense, tables, x, routed, zero) -> [batch]``,
    and per table whether its routing travels packed (``routed`` is ``(packed or None, each
    table's arrays, () where packed)``). ``dense_step``: :func:`summed_dense_step`'s."""
    s, b = mesh.shape[axis], batch
    batch_sharding = NamedSharding(mesh, P(axis))
    per = [-(-b // s) if t.spec.placement == "row" or per_process else b for t in tables]
    gathered = [per_process and t.spec.placement == "column" for t in tables]
    columns = [t.spec.placement == "column" and s > 1 for t in tables]
    pools = [pooling_fn(t, n, per_process, g) for t, n, g in zip(tables, per, gathered)]
    updates = [update_fn(t, n, per_process, g) for t, n, g in zip(tables, per, gathered)]
    of = lambda mask, xs: [x for x, m in zip(xs, mask) if m]  # noqa: E731

    def gather(routed: tuple) -> list:
        packed, inputs = routed
        if packed is None:
            return inputs
        return _subset(gathered, gather_ids(of(gathered, tables), -(-b // s), packed, of(gathered, capacities)),
                       inputs)

    def reshard(arrays: list, to_samples: bool) -> list:
        if not any(columns):
            return arrays
        return _subset(columns, reshard_pooled(of(columns, tables), of(columns, arrays), to_samples), arrays)

    def update_all(data, accs, routed, grads, lr) -> list:
        e = jnp.float32(eps)
        args = [(d, a, *r, g) for d, a, r, g in zip(data, accs, routed, grads)]
        done = update_columns(of(columns, tables), of(columns, per)[0], per_process, per_process,
                              of(columns, args), lr, e) if any(columns) else []
        return _subset(columns, done, [None if c else fn(*x, lr, e) for fn, x, c in zip(updates, args, columns)])

    def whole_step(dense, opt, data, accs, step, x, y, routed):
        x, y = jax.lax.with_sharding_constraint((x, y), batch_sharding)
        routed = gather(routed)
        pooled = reshard([pool(t, *r)[:b] for pool, t, r in zip(pools, data, routed)], True)
        dense, opt, grads, metrics = dense_step(dense, opt, step, x, y, pooled)
        new = update_all(data, accs, routed, reshard(grads, False), metrics["lr"])
        return dense, opt, [d for d, _ in new], [a for _, a in new], metrics

    def whole_predict(dense, data, x, routed, zero):
        pooled = reshard([pool(t, *r)[:b] for pool, t, r in zip(pools, data, gather(routed))], True)
        if zero:
            pooled = [jnp.zeros_like(p) for p in pooled]
        x, pooled = jax.lax.with_sharding_constraint((x, pooled), batch_sharding)
        return dlrm.forward(dense, x, pooled)

    return (jax.jit(whole_step, donate_argnums=(0, 1, 2, 3)),
            jax.jit(whole_predict, static_argnums=4, out_shardings=batch_sharding), gathered)
