"""The recommender task (``task: dlrm``): DLRM-v2 trained by the same loop as the language models.

A step has three parts, as jax-tpu-embedding's and TorchRec's do:

1. **lookups**: each feature's ids are routed on the host (:func:`hypertron.embed.route`) and
   each table pools them where it lives (:func:`hypertron.embed.lookup`). The loop's batches are
   routed one batch ahead on a thread (:class:`RoutedAhead`), beside the device's step, so a step
   waits for its routing only where the routing is slower than the step before (the loop counts
   that wait as ``data_wait``);
2. **the dense step**, one compiled function over the batch split by samples over the mesh's one
   axis (``data``): the forward pass (:mod:`hypertron.recsys.dlrm`), the mean log-loss, its
   gradient with respect to the MLPs and to each pooled embedding, and the MLPs' optimiser
   (SGD, or Adagrad as PyTorch's: ``w -= lr * g / (sqrt(sum g^2) + eps)``);
3. **sparse updates**: each table's optimiser runs on the rows the batch touched, from the gradient
   of its pooled embeddings (:func:`hypertron.embed.apply_gradients`).

The train state is the loop's dict: ``params`` = ``{"dense", "tables"}``, ``opt_state`` =
``{"dense", "tables"}`` (a table's accumulator; none for SGD), ``step``; checkpoints save and
restore it as they do a language model's. Each step's buffers have one shape (the routing's
capacity is fixed at the most a device could send), so each part compiles once.

Placements: ``dlrm.placement=auto`` asks :func:`hypertron.embed.plan.plan` per table; ``row``,
``column``, ``table`` or ``data`` puts every table so; ``dlrm.placements`` gives one per table
(``auto`` among them: the planner's).

On several processes (``hypertron launch local --processes 2``, Slurm, JobSet) the tables are
split over every device of every process and each process routes only its own samples' ids
(:func:`hypertron.embed.route` with ``process``): duplicates are merged on the devices that read
them, so no process ever holds the step's ids. The dense step and its batch are split by samples
as on one process (each process's batch its block of the global one). Table-wise tables are held
there as one row-wise array, each table in its owner's block (:mod:`hypertron.embed.batched`), and
routed together as one; ``auto`` puts no table whole on one device there (it splits the large
ones and keeps small ones data-parallel where that exchanges less), a table-wise one is asked by
hand.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hypertron.config import Config, ConfigError
from hypertron.config.validation import check_dlrm_devices
from hypertron.data import resolve_shards
from hypertron.embed import (
    Jagged, ShardedTable, abstract_table, apply_gradients, init_table, lookup, pooled_sharding, route,
)
from hypertron.embed.batched import TableGroup, group_from_logical, group_input, group_logical, group_tables, init_group
from hypertron.embed.checkpoint import logical_abstract, logical_arrays, place_logical
from hypertron.embed.plan import plan as plan_tables
from hypertron.embed.tables import pack_ids, routed_inputs
from hypertron.hardware import device_memory
from hypertron.models.flops import device_peak_flops
from hypertron.recsys import data as recsys_data
from hypertron.recsys import dlrm
from hypertron.recsys.metrics import auc, log_loss
from hypertron.train.dlrm_fused import fused_programs
from hypertron.train.metrics import Throughput
from hypertron.train.optimizer import schedule

AXIS = "data"


def scale_by_adagrad(eps: float) -> optax.GradientTransformation:
    """PyTorch's (and fbgemm's) Adagrad direction: ``g / (sqrt(sum of g^2 so far) + eps)``, the sum
    starting at zero. (``optax.adagrad`` adds eps inside the root and starts the sum at 0.1.)"""

    def init(params):
        return {"sum": jax.tree.map(jnp.zeros_like, params)}

    def update(grads, state, params=None):
        total = jax.tree.map(lambda s, g: s + g * g, state["sum"], grads)
        return jax.tree.map(lambda g, s: g / (jnp.sqrt(s) + eps), grads, total), {"sum": total}

    return optax.GradientTransformation(init, update)


def dense_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The MLPs' optimiser: SGD with the tables' SGD, Adagrad with either of theirs (MLPerf's)."""
    lr = schedule(cfg.train)
    if cfg.dlrm.optimizer == "sgd":
        return optax.sgd(lr)
    return optax.chain(scale_by_adagrad(cfg.dlrm.eps), optax.scale_by_learning_rate(lr))


def place_tables(cfg: Config, mesh: Mesh, split_all: bool) -> list[tuple[Any, int]]:
    """Each table's spec (with its placement) and owner over the mesh's axis: ``dlrm.placements``
    (per table) or ``dlrm.placement``, ``auto`` the planner's; ``split_all``: no table whole on one
    device by the planner's choice (``auto`` on several processes)."""
    d = cfg.dlrm
    specs, features = dlrm.table_specs(d, "auto")
    wanted = list(d.placements) or [d.placement] * len(specs)
    specs = [dataclasses.replace(s, placement=p) for s, p in zip(specs, wanted)]
    if "auto" not in wanted:
        return [(s, i % mesh.shape[AXIS]) for i, s in enumerate(specs)]
    chosen = plan_tables(specs, features, {f.name: float(h) for f, h in zip(features, d.ids_per_sample)},
                         shards=mesh.shape[AXIS], batch=cfg.train.global_batch,
                         device_bytes=int(device_memory(mesh.devices.flat[0]) or 0),
                         split_all=split_all)
    return [(c.table, c.owner or 0) for c in chosen.choices]


@dataclasses.dataclass
class DlrmTrainer:
    """The sharded DLRM state and its step (see the module's docstring)."""

    cfg: Config
    mesh: Mesh
    tables: list[ShardedTable]  # layouts only: the arrays live in the state
    state_shardings: dict
    batch_sharding: NamedSharding
    optimizer: optax.GradientTransformation
    dense_step: Any
    predict_fn: Any
    capacities: list[int]
    fused_step: Any = None  # the whole step as one compiled function, where the tables allow (see make_dlrm_trainer)
    fused_predict: Any = None  # the same for the logits (on several processes, one program a batch, not one a table)
    processes: int = 1  # more than one: each feeds its block of the global batch
    per_process: bool = False  # each process routes its own samples' ids, duplicates merged on the devices
    gathered: list[bool] = dataclasses.field(default_factory=list)  # per array: its ids gathered on the devices
    group: TableGroup | None = None  # routed per process, the table-wise tables held as one array
    arrays: list[ShardedTable] = dataclasses.field(default_factory=list)  # the fused step's: tables, then the group
    features: list[tuple[int, int | None]] = dataclasses.field(default_factory=list)  # each feature's array, place
    names: list[str] = dataclasses.field(default_factory=list)  # each array's key in the state

    def grouped(self, i: int) -> bool:
        """Whether table ``i`` is held in :attr:`group`."""
        return self.group is not None and self.tables[i].spec.placement == "table"

    def init(self, key: jax.Array) -> dict:
        replicated = NamedSharding(self.mesh, P())
        dense = jax.jit(lambda k: dlrm.init_dense(self.cfg.dlrm, k), out_shardings=replicated)(key)
        opt = jax.jit(self.optimizer.init, out_shardings=replicated)(dense)
        tables, table_state = {}, {}
        seed = lambda i: self.cfg.train.seed * 1_000_003 + i  # noqa: E731
        for i, t in enumerate(self.tables):
            if self.grouped(i):
                continue
            made = init_table(t.spec, self.mesh, AXIS, seed=seed(i), owner=t.owner)
            tables[t.spec.name] = made.data
            if made.state is not None:
                table_state[t.spec.name] = made.state
        if self.group is not None:
            data, st = init_group(self.group, self.mesh, AXIS, [seed(i) for i in range(len(self.tables))
                                                                if self.grouped(i)])
            tables[GROUP] = data
            if st is not None:
                table_state[GROUP] = st
        return {"params": {"dense": dense, "tables": tables}, "opt_state": {"dense": opt, "tables": table_state},
                "step": jax.device_put(np.int32(0), replicated)}

    def to_model(self, state: dict) -> dict:
        """``state`` as checkpoints hold it: every table and its optimiser state in its logical row
        order (:func:`hypertron.embed.checkpoint.logical_arrays`, a copy), whatever its placement,
        so a run resumes under another placement, device count or process count."""
        logical = {t.spec.name: logical_arrays(t) for t in self.live_tables(state)}
        if self.group is not None:
            logical |= group_logical(self.group, self.mesh, AXIS, state["params"]["tables"][GROUP],
                                     state["opt_state"]["tables"].get(GROUP))
        return _with_tables(state, logical)

    def to_held(self, state: dict) -> dict:
        """A checkpoint's state (:meth:`to_model`'s form) laid out as this trainer's step holds it."""
        placed, logical = {}, {}
        for t in self.tables:
            arrays = {"table": state["params"]["tables"][t.spec.name]}
            if t.state is not None:
                arrays["state"] = state["opt_state"]["tables"][t.spec.name]
            logical[t.spec.name] = arrays
        for i, t in enumerate(self.tables):
            if not self.grouped(i):
                p = place_logical(logical[t.spec.name], t.spec, t.optimizer, self.mesh, AXIS, t.owner)
                placed[t.spec.name] = {"table": p.data} | ({} if p.state is None else {"state": p.state})
        if self.group is not None:
            data, st = group_from_logical(self.group, self.mesh, AXIS, logical)
            placed[GROUP] = {"table": data} | ({} if st is None else {"state": st})
        return _with_tables(state, placed)

    def abstract_state(self) -> dict:
        """The checkpoints' state as shapes and shardings (:meth:`to_model`'s form)."""
        replicated = NamedSharding(self.mesh, P())
        shaped = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated)
        dense = jax.eval_shape(lambda: dlrm.init_dense(self.cfg.dlrm, jax.random.key(0)))
        opt = jax.eval_shape(self.optimizer.init, dense)
        logical = {t.spec.name: logical_abstract(t.spec, t.optimizer, self.mesh, AXIS) for t in self.tables}
        return {"params": {"dense": jax.tree.map(shaped, dense),
                           "tables": {name: a["table"] for name, a in logical.items()}},
                "opt_state": {"dense": jax.tree.map(shaped, opt),
                              "tables": {name: a["state"] for name, a in logical.items() if "state" in a}},
                "step": shaped(jax.ShapeDtypeStruct((), jnp.int32))}

    def live_tables(self, state: dict) -> list[ShardedTable]:
        """The tables with their arrays from ``state`` (those not held in :attr:`group`)."""
        return [dataclasses.replace(t, data=state["params"]["tables"][t.spec.name],
                                    state=state["opt_state"]["tables"].get(t.spec.name))
                for i, t in enumerate(self.tables) if not self.grouped(i)]

    def host_tables(self, state: dict) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Each table ``[rows, dim]`` and its optimiser state (None for SGD) on the host, in table
        order, whatever its placement (on one process: what tests compare)."""
        model = self.to_model(state)
        out = []
        for t in self.tables:
            st = model["opt_state"]["tables"].get(t.spec.name)
            out.append((np.asarray(model["params"]["tables"][t.spec.name])[:t.spec.rows],
                        None if st is None else np.asarray(st)[:t.spec.rows]))
        return out

    def route(self, local: dict, pool: concurrent.futures.Executor | None = None) -> list:
        """Each feature's ids of this batch laid out for its table (on the host); with ``pool``,
        the features on its threads (numpy's sorts let go of the GIL)."""
        sparse = np.asarray(local["sparse"])
        process = (jax.process_index(), self.processes) if self.per_process else None

        def jagged(f: int) -> Jagged:
            ids = self._ids(sparse, f)
            return Jagged(ids.reshape(-1), np.full(len(ids), ids.shape[1], np.int32))

        def one(f: int):  # (its capacity is the most a device could send: no process can overflow it)
            if (self.fused_step is not None and self.tables[f].spec.placement == "data") or self.grouped(f):
                return None  # pooled by the step from the batch's own ids; routed with its group
            return route(self.tables[f].spec, jagged(f), "sum", self.tables[f].shards, capacity=self.capacities[f],
                         feature=f"f{f}", process=process)

        routed = list(pool.map(one, range(len(self.tables))) if pool is not None else map(one, range(len(self.tables))))
        if self.group is not None:  # the group's own samples: each sample's ids of each of its tables
            x = group_input(self.group, [jagged(f) for f in range(len(self.tables)) if self.grouped(f)])
            routed.append(route(self.group.spec, x, "sum", self.group.shards, capacity=self.capacities[-1],
                                feature="the table-wise features", process=process))
        return routed

    def batch_array(self, local: np.ndarray) -> jax.Array | np.ndarray:
        """This process's rows of a batch as the step takes them: on several processes, the global
        array split by samples, each process's rows its block."""
        if self.processes == 1:
            return local
        return jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(local))

    def _ids(self, sparse: np.ndarray, f: int) -> np.ndarray:
        """Feature ``f``'s ids of a batch's ``sparse`` columns: ``[samples, its ids a sample]``."""
        start = sum(self.cfg.dlrm.ids_per_sample[:f])
        return sparse[:, start:start + self.cfg.dlrm.ids_per_sample[f]]

    def _inputs(self, routed: list, local: dict) -> tuple:
        """Each table's routing as the fused programs take it (global arrays on several processes):
        the tables ``gathered`` on the devices take theirs packed as one array (:func:`pack_ids`),
        so that it travels as one, and the data-parallel ones their ids as the batch holds them
        (one array); neither has arrays of its own."""
        solo = [r for i, r in enumerate(routed[:len(self.tables)]) if not self.grouped(i)]
        routed = solo + ([routed[-1]] if self.group is not None else [])  # each array's, as self.arrays
        mine = [r for r, g in zip(routed, self.gathered) if g]
        packed = self.batch_array(pack_ids(mine)) if mine else None
        own = [t.spec.placement == "data" for t in self.arrays]
        ids = None
        if any(own):
            sparse = np.asarray(local["sparse"])
            ids = self.batch_array(np.concatenate([self._ids(sparse, f) for f, (a, _) in enumerate(self.features)
                                                   if own[a]], axis=1).astype(np.int32))
        return packed, [() if g or o else routed_inputs(t, r)
                        for t, r, g, o in zip(self.arrays, routed, self.gathered, own)], ids

    def _pooled(self, tables: list[ShardedTable], routed: list, zero: bool = False) -> list[jax.Array]:
        pooled = [lookup(t, r) for t, r in zip(tables, routed)]
        if zero:
            pooled = [jnp.zeros_like(p) for p in pooled]
        return [jax.device_put(p, self.batch_sharding) for p in pooled]

    def step(self, state: dict, local: dict) -> tuple[dict, dict]:
        routed = local[ROUTED] if ROUTED in local else self.route(local)
        if self.fused_step is not None:
            return self._fused(state, local, routed)
        tables = self.live_tables(state)
        pooled = self._pooled(tables, routed)
        x = jax.device_put(self.batch_array(local["dense"]), self.batch_sharding)
        y = jax.device_put(self.batch_array(local["labels"]), self.batch_sharding)
        dense, opt, grads, metrics = self.dense_step(state["params"]["dense"], state["opt_state"]["dense"],
                                                    state["step"], x, y, pooled)
        new_tables, new_state = {}, {}
        for t, r, g in zip(tables, routed, grads):
            where = pooled_sharding(t)
            lr = metrics["lr"] if t.spec.placement != "table" else jax.device_put(metrics["lr"], where)
            t = apply_gradients(t, r, jax.device_put(g, where), lr=lr, eps=self.cfg.dlrm.eps)
            new_tables[t.spec.name] = t.data
            if t.state is not None:
                new_state[t.spec.name] = t.state
        return ({"params": {"dense": dense, "tables": new_tables}, "opt_state": {"dense": opt, "tables": new_state},
                 "step": state["step"] + 1}, metrics)

    def _fused(self, state: dict, local: dict, routed: list) -> tuple[dict, dict]:
        names = self.names
        acc = state["opt_state"]["tables"]
        dense, opt, tables, accs, metrics = self.fused_step(
            state["params"]["dense"], state["opt_state"]["dense"], [state["params"]["tables"][n] for n in names],
            [acc.get(n, np.float32(0)) for n in names], state["step"], self.batch_array(local["dense"]),
            self.batch_array(local["labels"]), self._inputs(routed, local))
        return ({"params": {"dense": dense, "tables": dict(zip(names, tables))},
                 "opt_state": {"dense": opt, "tables": {n: a for n, a in zip(names, accs) if n in acc}},
                 "step": state["step"] + 1}, metrics)

    def predict(self, state: dict, local: dict, zero_tables: bool = False) -> jax.Array:
        """Click logits of a batch (``zero_tables``: with every pooled embedding zeroed, the ablation)."""
        routed = self.route(local)
        if self.fused_predict is not None:
            return self.fused_predict(state["params"]["dense"], [state["params"]["tables"][n] for n in self.names],
                                      self.batch_array(local["dense"]), self._inputs(routed, local), zero_tables)
        pooled = self._pooled(self.live_tables(state), routed, zero=zero_tables)
        x = jax.device_put(self.batch_array(local["dense"]), self.batch_sharding)
        return self.predict_fn(state["params"]["dense"], x, pooled)


def _with_tables(state: dict, tables: dict[str, dict]) -> dict:
    """``state`` with its tables and their optimiser state replaced by ``tables`` (by name: a
    ``table`` array and, where the optimiser keeps one, a ``state`` array)."""
    return {**state, "params": {**state["params"], "tables": {n: a["table"] for n, a in tables.items()}},
            "opt_state": {**state["opt_state"], "tables": {n: a["state"] for n, a in tables.items() if "state" in a}}}


GROUP = "_table_wise"  # the state's key of the table-wise tables held as one array (embed.batched)
ROUTED = "_routed"  # a batch's routing, done ahead (a leading "_": derived from the rows, not rows)


class RoutedAhead:
    """``batches`` (a Grain iterator) with each batch's routing (:meth:`DlrmTrainer.route`) under
    :data:`ROUTED`, the next batch read and routed on a thread while the caller runs this one, its
    features on as many threads as there are cores (up to one a feature).

    Its state is the inner iterator's after the last batch it returned (taken before the thread
    reads the next), as JSON bytes, so a checkpoint saves where the loop is, not where the thread
    is (Grain's checkpoint handler saves it as it saves a data loader's). A checkpoint is restored
    into the inner iterator, before it is wrapped (the loop does so): Grain's handler cannot
    restore into this one. After a read fails, each later ``next`` raises that error again."""

    def __init__(self, batches, trainer: DlrmTrainer):
        self.batches, self.trainer = batches, trainer
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dlrm-read")
        self.features = concurrent.futures.ThreadPoolExecutor(min(len(trainer.tables), os.cpu_count() or 1),
                                                              thread_name_prefix="dlrm-route")
        self.ahead: concurrent.futures.Future | None = None
        self.state = batches.get_state()

    def _read(self) -> dict:
        local = next(self.batches)
        return {**local, ROUTED: self.trainer.route(local, self.features)}

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        local = (self.ahead or self.pool.submit(self._read)).result()  # an error in reading raises here
        self.state = self.batches.get_state()  # the thread is idle: after this batch, before the next
        self.ahead = self.pool.submit(self._read)
        return local

    def _settle(self) -> None:
        if self.ahead is not None:
            try:
                self.ahead.result()
            except Exception:  # a read that failed ahead of a batch nobody asked for
                pass
            self.ahead = None

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()

    def set_state(self, state: bytes) -> None:
        self._settle()
        self.state = json.loads(state)
        self.batches.set_state(self.state)

    def close(self) -> None:
        self._settle()
        self.pool.shutdown()
        self.features.shutdown()


def make_dlrm_trainer(cfg: Config, mesh: Mesh, per_process: bool | None = None) -> DlrmTrainer:
    """The DLRM trainer of ``cfg`` on the one-axis ``mesh``; nothing is compiled until first called.
    ``per_process``: route per process, every table split (None: on several processes, where it
    must be; on one, the step's duplicates are found on the host, tables whole where they fit)."""
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(AXIS))
    processes = jax.process_count()
    per_process = processes > 1 if per_process is None else per_process
    if processes > 1 and not per_process:
        raise ValueError("on several processes the ids are routed per process")
    placed = place_tables(cfg, mesh, split_all=per_process)
    tables = [abstract_table(spec, mesh, AXIS, owner=owner) for spec, owner in placed]
    s, b = mesh.shape[AXIS], cfg.train.global_batch
    # Row-wise: the most ids one device could send one owner (all of its own); routed per process,
    # column-wise too (a device's ids); others: ignored but fixed.
    capacities = [-(-b // s) * hot for hot in cfg.dlrm.ids_per_sample]
    # Routed per process, the table-wise tables are held as one row-wise array (embed.batched), routed together.
    together = [i for i, t in enumerate(tables) if per_process and t.spec.placement == "table"]
    group = group_tables([tables[i].spec for i in together], [tables[i].owner for i in together], s) \
        if together else None
    if group is not None:
        capacities.append(-(-b // s) * sum(cfg.dlrm.ids_per_sample[i] for i in together))
    optimizer = dense_optimizer(cfg)
    lr = schedule(cfg.train)

    def dense_step(dense, opt, step, x, y, pooled):
        def loss_fn(dense, pooled):
            return jnp.mean(dlrm.bce_with_logits(dlrm.forward(dense, x, pooled), y))

        loss, (g_dense, g_pooled) = jax.value_and_grad(loss_fn, argnums=(0, 1))(dense, pooled)
        updates, opt = optimizer.update(g_dense, opt, dense)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(g_dense), "lr": jnp.asarray(lr(step), jnp.float32),
                   "samples": jnp.float32(y.shape[0])}
        return optax.apply_updates(dense, updates), opt, g_pooled, metrics

    n = len(tables)
    step_fn = jax.jit(dense_step, in_shardings=(replicated, replicated, replicated, batch_sharding, batch_sharding,
                                                [batch_sharding] * n),
                      out_shardings=(replicated, replicated, [batch_sharding] * n, replicated), donate_argnums=(0, 1))
    predict = jax.jit(lambda dense, x, pooled: dlrm.forward(dense, x, pooled),
                      in_shardings=(replicated, batch_sharding, [batch_sharding] * n), out_shardings=batch_sharding)
    trainer = DlrmTrainer(cfg, mesh, tables, {}, batch_sharding, optimizer, step_fn, predict, capacities,
                          processes=processes, per_process=per_process)
    trainer.state_shardings = jax.tree.map(lambda a: a.sharding, trainer.abstract_state())
    trainer.group = group
    solo = [i for i in range(len(tables)) if i not in together]
    trainer.arrays = [tables[i] for i in solo] + ([abstract_table(group.spec, mesh, AXIS)] if group else [])
    trainer.names = [tables[i].spec.name for i in solo] + ([GROUP] if group else [])
    trainer.features = [(len(solo), together.index(f)) if f in together else (solo.index(f), None)
                        for f in range(len(tables))]
    if s == 1 or all(t.spec.placement != "table" for t in trainer.arrays):  # one compiled step: see dlrm_fused
        trainer.fused_step, trainer.fused_predict, trainer.gathered = fused_programs(
            trainer.arrays, trainer.features, mesh, AXIS, b, [capacities[i] for i in solo] + capacities[len(tables):],
            list(cfg.dlrm.ids_per_sample), per_process, optimizer, lr, cfg.dlrm.eps)
    return trainer


class Recommender:
    """``task: dlrm``: the :class:`hypertron.train.task.Task` of DLRM-v2 (see the module's docstring)."""

    def check_inputs(self, cfg: Config) -> None:
        d = cfg.dlrm
        if cfg.train.init_from:
            raise ConfigError("train.init_from: task=dlrm starts from random weights or its own checkpoints only")
        if cfg.train.grad_accum != 1:
            raise ConfigError(f"train.grad_accum={cfg.train.grad_accum}: task=dlrm takes whole batches (1)")
        if d.source == "criteo":
            if any(h != 1 for h in d.ids_per_sample):
                raise ConfigError("dlrm.source=criteo: Criteo lines hold one id per feature; set "
                                  "dlrm.ids_per_sample to all 1")
            recsys_data.check_files(d.paths)
            if cfg.train.eval_every:
                recsys_data.check_files(d.eval_paths, "dlrm.eval_paths")

    def mesh(self, cfg: Config, devices: list) -> Mesh:
        check_dlrm_devices(cfg, len(devices), jax.process_count())
        return Mesh(np.array(devices), (AXIS,))

    def check_init_from(self, cfg: Config) -> None:
        pass  # refused in check_inputs

    def batches(self, cfg: Config, split: str = "train") -> Iterator[dict]:
        return recsys_data.make_batches(cfg.dlrm, batch_size=cfg.train.global_batch // jax.process_count(),
                                        seed=cfg.data.seed, split=split, process_index=jax.process_index(),
                                        process_count=jax.process_count(), shards=data_shards(cfg))

    def data_fingerprint(self, cfg: Config) -> dict[str, Any]:
        d = cfg.dlrm
        return {"task": "dlrm", "source": d.source, "paths": list(d.paths), "eval_paths": list(d.eval_paths),
                "seed": cfg.data.seed, "teacher_seed": d.teacher_seed, "teacher_scale": d.teacher_scale,
                "table_rows": list(d.table_rows), "ids_per_sample": list(d.ids_per_sample),
                "dense_features": d.dense_features, "global_batch": cfg.train.global_batch,
                "shards": data_shards(cfg)}  # not the process count: a global batch is the same on any

    def trainer(self, cfg: Config, mesh: Mesh) -> DlrmTrainer:
        return make_dlrm_trainer(cfg, mesh)

    def initial_state(self, cfg: Config, trainer: DlrmTrainer, console) -> dict:
        return trainer.init(jax.random.key(cfg.train.seed))

    def restored(self, cfg: Config, trainer: DlrmTrainer, state: dict, console) -> None:
        pass

    def ahead(self, trainer: DlrmTrainer, batches) -> RoutedAhead:
        """The loop's training batches, routed one ahead (:class:`RoutedAhead`)."""
        return RoutedAhead(batches, trainer)

    def step(self, trainer: DlrmTrainer, state: dict, local: dict) -> tuple[dict, dict]:
        return trainer.step(state, local)

    def evaluate(self, trainer: DlrmTrainer, state: dict, batches: Iterator[dict], count: int) -> dict[str, float]:
        """Log-loss and ROC AUC over ``count`` held-out batches."""
        logits, labels = evaluate_logits(trainer, state, batches, count)
        return {"loss": log_loss(logits, labels), "auc": auc(logits, labels), "samples": float(len(labels))}

    def throughput(self, cfg: Config) -> Throughput:
        b = cfg.train.global_batch
        return Throughput(b, dlrm.flops_per_sample(cfg.dlrm) * b, jax.device_count(),
                          device_peak_flops(cfg.train.peak_flops), unit="samples")

    def finish(self, cfg: Config, state: dict, console) -> None:
        pass  # the run's checkpoint is what it leaves


def data_shards(cfg: Config) -> int:
    """The synthetic global batch's blocks: ``data.shards``, or by default 8 (or the most of 4, 2, 1)
    that divides the batch and that the processes divide, so 1, 2, 4 and 8 processes read one stream."""
    return resolve_shards(cfg.data.shards, cfg.train.global_batch, jax.process_count())


def evaluate_logits(trainer: DlrmTrainer, state: dict, batches: Iterator[dict], count: int,
                    zero_tables: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Logits and labels of ``count`` batches (``zero_tables``: the ablation, every embedding zeroed)."""
    logits, labels = [], []
    for _ in range(count):
        local = next(batches)
        logits.append(trainer.predict(state, local, zero_tables))
        labels.append(trainer.batch_array(local["labels"]))
    if trainer.processes > 1:  # every process's samples, in process order
        from jax.experimental import multihost_utils

        logits, labels = ([multihost_utils.process_allgather(a, tiled=True) for a in arrays]
                          for arrays in (logits, labels))
    return np.concatenate(jax.device_get(logits)), np.concatenate(jax.device_get(labels))
