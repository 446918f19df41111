"""The training step: loss, gradient accumulation, the optimiser update, all sharded by the rules.

The train state is a plain dict ``{"params", "opt_state", "step"}``, plus ``"quant"`` with fp8
delayed scaling (the amax histories, :mod:`hypertron.quant.fp8`, replicated). Its
shardings come from the parameter declarations through the logical-axis
rules; the optimiser state mirrors the parameters' shardings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hypertron.config import Config
from hypertron.data.pipeline import balance_rows
from hypertron.models import declare, forward, fp8_histories, resolve_dtype
from hypertron.models import params as param_lib
from hypertron.models.pipeline import use_schedule
from hypertron.parallel.rules import DEFAULT_RULES, mesh_axes, shardings_for, spec_for, use_rules
from hypertron.quant import fp8
from hypertron.train.optimizer import make_optimizer, schedule

State = dict[str, Any]
Batch = dict[str, jax.Array]

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_weights")


def uses_histories(cfg: Config) -> bool:
    """Whether the train state carries fp8 amax histories (fp8 with delayed scaling)."""
    return cfg.model.quantization == "fp8" and cfg.model.fp8_scaling == "delayed"


def init_histories(cfg: Config) -> dict:
    return fp8_histories(cfg.model)


def loss_terms(params, batch: Batch, cfg: Config, histories=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Summed (not averaged) token losses of one micro-batch, so micro-batches add up exactly.

    Returns ``(objective_sum, aux)`` where ``aux`` holds ``nll_sum``,
    ``z_sum`` and ``weight`` (the number of target tokens counted). ``histories``: fp8
    delayed-scaling state, attached to the weights it belongs to.
    """
    if histories is not None:
        params = fp8.attach(params, histories)
    # Synthetic rows are one document each: no segment mask, so GPU attention
    # takes the plain causal flash path.
    segment_ids = None if cfg.data.source == "synthetic" else batch["segment_ids"]
    with use_schedule(cfg.train.pipeline_microbatches, cfg.train.pipeline_repeats):  # with mesh.stage
        fwd = forward(params, batch["inputs"], cfg.model, positions=batch["positions"], segment_ids=segment_ids,
                      stats=True)
    logits_btv, stats = fwd.logits, fwd.stats
    logz_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    target_logit_bt = jnp.take_along_axis(logits_btv, batch["targets"][..., None], axis=-1)[..., 0]
    w_bt = batch["loss_weights"].astype(jnp.float32)
    weight = jnp.sum(w_bt)
    nll_sum = jnp.sum((logz_bt - target_logit_bt) * w_bt)
    z_sum = jnp.sum(jnp.square(logz_bt) * w_bt)
    objective = nll_sum + cfg.train.z_loss * z_sum
    aux = {"nll_sum": nll_sum, "z_sum": z_sum, "weight": weight}
    if cfg.model.moe is not None:
        # Router losses are per-token means (averaged over layers); scaled by the tokens counted
        # they add up over micro-batches like the NLL.
        moe = cfg.model.moe
        aux["moe_lb_sum"] = jnp.mean(stats["load_balance"]) * weight
        aux["moe_z_sum"] = jnp.mean(stats["router_z"]) * weight
        aux["moe_dropped_sum"] = jnp.mean(stats["dropped"]) * weight
        aux["expert_load"] = jnp.sum(stats["load"], axis=0)  # copies per expert, summed over layers
        objective += moe.load_balance_weight * aux["moe_lb_sum"] + moe.router_z_weight * aux["moe_z_sum"]
    return objective, aux


def accumulate_grads(params, histories, batch: Batch, cfg: Config, loss_fn=loss_terms):
    """Gradients of the summed objective over ``grad_accum`` micro-batches (a scan), and the
    fp8 histories updated by them (None without). ``loss_fn(params, batch, cfg, histories) ->
    (objective_sum, aux)`` (:func:`loss_terms`; ``task: dpo``'s pair objective): sums, so that
    micro-batches add up exactly."""
    grad_fn = jax.grad(loss_fn, argnums=(0, 3), has_aux=True)
    n = cfg.train.grad_accum
    if n == 1:
        (grads, new_histories), aux = grad_fn(params, batch, cfg, histories)
        return grads, new_histories, aux

    # Micro-batch i takes rows i, i+n, i+2n...: every device keeps its own rows
    # (a plain [n, b/n] split would move rows between devices each micro-step).
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1), batch)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    # The aux tree's shapes from the forward alone (tracing the gradient twice would double trace time).
    aux0 = jax.eval_shape(lambda: loss_fn(params, jax.tree.map(lambda x: x[0], micro), cfg, histories)[1])
    aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux0)

    def body(carry, mb):
        g_acc, h_acc, a_acc = carry
        (g, h), a = grad_fn(params, mb, cfg, histories)
        g_acc = jax.tree.map(lambda x, y: x + y.astype(jnp.float32), g_acc, g)
        h_acc = None if h is None else fp8.combine(h_acc, h)
        a_acc = jax.tree.map(jnp.add, a_acc, a)
        return (g_acc, h_acc, a_acc), None

    # Histories start from zeros (not the old ones): each micro-batch's is the old one pushed
    # back with its own amax in front, and their maximum is the answer.
    h0 = None if histories is None else jax.tree.map(jnp.zeros_like, histories)
    (grads, new_histories, aux), _ = jax.lax.scan(body, (zeros, h0, aux0), micro)
    return grads, new_histories, aux


def train_step(state: State, batch: Batch, cfg: Config, optimizer: optax.GradientTransformation):
    """One optimiser step on a global batch; returns the new state and device-side metrics."""
    grads, histories, aux = accumulate_grads(state["params"], state.get("quant"), batch, cfg)
    weight = jnp.maximum(aux["weight"], 1.0)
    grads = jax.tree.map(lambda g, p: (g / weight).astype(p.dtype), grads, state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {
        "loss": aux["nll_sum"] / weight,
        "z_loss": aux["z_sum"] / weight,
        "grad_norm": optax.global_norm(grads),
        "lr": schedule(cfg.train)(state["step"]),
        "tokens": aux["weight"],
    }
    if cfg.model.moe is not None:
        metrics["moe_load_balance"] = aux["moe_lb_sum"] / weight
        metrics["moe_router_z"] = aux["moe_z_sum"] / weight
        metrics["moe_dropped"] = aux["moe_dropped_sum"] / weight
        # Tokens per expert, as a fraction of all routed copies (1/num_experts each when balanced).
        metrics["expert_load"] = aux["expert_load"] / jnp.maximum(jnp.sum(aux["expert_load"]), 1.0)
    new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
    if histories is not None:
        new_state["quant"] = histories
    return new_state, metrics


@dataclass
class Trainer:
    """Jitted, sharded init and step for one config on one mesh."""

    cfg: Config
    mesh: Mesh
    optimizer: optax.GradientTransformation
    state_shardings: State
    batch_sharding: NamedSharding
    init: Callable[[jax.Array], State]
    step: Callable[[State, Batch], tuple[State, dict]]
    eval: Callable[..., dict]  # (state, batch) -> {"nll_sum", "weight"}: the loss sums of held-out batches
    # Entries of the state that ``init`` does not make, read from files instead (LoRA's frozen
    # base): name -> its tree of ShapeDtypeStructs with shardings. No random placeholder is made
    # (or compiled) for them only to be replaced.
    external: dict[str, Any] = field(default_factory=dict)
    # A state (or some of its entries) with the stacked layers moved from the model's order into
    # the one ``init`` and the step hold (donating its arrays), and back: identities but for a
    # circular pipeline (``train.pipeline_repeats`` > 1: :func:`hypertron.models.pipeline.held_order`).
    # Checkpoints and bundles hold the model's order.
    to_held: Callable[[State], State] = lambda state: state
    to_model: Callable[[State], State] = lambda state: state

    def batch(self, local: dict) -> Batch:
        """This process's rows as the step takes them (:func:`global_batch`); where the rules
        split each row's tokens over context devices and ``model.context_load_balance`` is on,
        the tokens in :func:`hypertron.data.pipeline.balanced_order` first."""
        context = seq_shards(self.batch_sharding)
        if context > 1 and self.cfg.model.context_load_balance:
            local = balance_rows({k: local[k] for k in BATCH_KEYS}, context)
        return global_batch(local, self.batch_sharding)

    def abstract_state(self) -> State:
        """Shapes, dtypes and shardings of the train state (for restoring a checkpoint), ``external``'s too."""
        shapes = jax.eval_shape(self.init, jax.random.key(0))
        made = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                            made_by_init(self.state_shardings, self.external))
        return {**made, **self.external}


def made_by_init(state_shardings: dict, external: dict) -> dict:
    """The shardings of the state entries a trainer's ``init`` makes: all but ``external``'s."""
    return {k: v for k, v in state_shardings.items() if k not in external}


def layer_orders(cfg: Config, mesh: Mesh, state_shardings: State,
                 rules=DEFAULT_RULES) -> tuple[Callable, Callable] | None:
    """``(to_held, to_model)`` for the states of a circular pipeline on ``mesh`` (None without
    one): each stacked-layer leaf (sharded over the axes the rules put ``layers`` on) reordered
    along its first axis, the others left as they are. Both are a reshape into blocks and a
    transpose of their first two axes (``[R, S, ...]`` and ``[S, R, ...]``)."""
    axes = mesh_axes(spec_for(("layers",), rules, mesh)[0])
    stages, repeats = int(np.prod([mesh.shape[a] for a in axes])), cfg.train.pipeline_repeats
    if stages == 1 or repeats == 1:
        return None

    def mover(first: int, second: int, donate: bool) -> Callable[[State], State]:
        compiled = {}

        def swap(x):  # blocks [first, second, ...] -> [second, first, ...]
            return x.reshape(first, second, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)

        def move(state: State) -> State:
            leaves, tree = jax.tree.flatten(state)
            shardings = jax.tree.leaves({k: state_shardings[k] for k in state})
            layered = tuple(bool(sh.spec) and mesh_axes(sh.spec[0]) == axes for sh in shardings)
            if (tree, layered) not in compiled:
                compiled[tree, layered] = jax.jit(lambda xs: [swap(x) for x in xs], donate_argnums=0 if donate else (),
                                                  out_shardings=[sh for sh, m in zip(shardings, layered) if m])
            moved = iter(compiled[tree, layered]([a for a, m in zip(leaves, layered, strict=True) if m]))
            return jax.tree.unflatten(tree, [next(moved) if m else a for a, m in zip(leaves, layered)])

        return move

    return mover(repeats, stages, True), mover(stages, repeats, False)


def param_shardings(cfg: Config, mesh: Mesh, rules=DEFAULT_RULES):
    specs = declare(cfg.model)
    abstract = param_lib.abstract(specs, resolve_dtype(cfg.model.param_dtype))
    return shardings_for(param_lib.logical_axes(specs), abstract, mesh, rules), abstract


def make_trainer(cfg: Config, mesh: Mesh, rules=DEFAULT_RULES) -> Trainer:
    """Build the sharded init and step functions. Nothing is compiled until first called."""
    optimizer = make_optimizer(cfg.train)
    p_shard, p_abstract = param_shardings(cfg, mesh, rules)
    replicated = NamedSharding(mesh, P())
    opt_abstract = jax.eval_shape(optimizer.init, p_abstract)
    opt_shard = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_abstract, p_shard, transform_non_params=lambda _: replicated
    )
    state_shardings = {"params": p_shard, "opt_state": opt_shard, "step": replicated}
    if uses_histories(cfg):
        state_shardings["quant"] = jax.tree.map(lambda _: replicated, jax.eval_shape(lambda: init_histories(cfg)))
    specs = declare(cfg.model)
    dtype = resolve_dtype(cfg.model.param_dtype)

    def init_fn(key):
        params = param_lib.initialize(specs, key, dtype)
        state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
        if uses_histories(cfg):
            state["quant"] = init_histories(cfg)
        return state

    def step_fn(state, batch):
        with use_rules(mesh, rules):
            return train_step(state, batch, cfg, optimizer)

    def eval_fn(state, batch):
        return eval_totals(state["params"], batch, cfg, state.get("quant"), mesh, rules)

    batch_sharding = NamedSharding(mesh, spec_for(("batch", "seq"), rules, mesh))
    made = jax.jit(init_fn, out_shardings=state_shardings)
    orders = layer_orders(cfg, mesh, state_shardings, rules)
    # A circular pipeline's state is drawn in the model's order (the parameters of any other mesh), held in the step's.
    init = made if orders is None else lambda key: orders[0](made(key))
    step = jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    read = [k for k in ("params", "quant") if k in state_shardings]  # what the evaluation reads of a state
    evaluate = jax.jit(eval_fn, in_shardings=({k: state_shardings[k] for k in read}, batch_sharding),
                       out_shardings=replicated)
    trainer = Trainer(cfg, mesh, optimizer, state_shardings, batch_sharding, init, step,
                      lambda state, batch: evaluate({k: state[k] for k in read}, batch))
    if orders is not None:
        trainer.to_held, trainer.to_model = orders
    return trainer


def eval_totals(params, batch: Batch, cfg: Config, histories, mesh: Mesh, rules=DEFAULT_RULES) -> dict:
    """The loss sums ``{"nll_sum", "weight"}`` of a held-out batch, in the train step's
    micro-batches (a batch that needs grad_accum to fit does here too)."""
    n = cfg.train.grad_accum
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1), batch)

    def body(total, mb):
        with use_rules(mesh, rules):
            _, aux = loss_terms(params, mb, cfg, histories)
        return {k: total[k] + aux[k] for k in total}, None

    zeros = {"nll_sum": jnp.zeros((), jnp.float32), "weight": jnp.zeros((), jnp.float32)}
    return jax.lax.scan(body, zeros, micro)[0]


def row_array(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A field of one value (or vector) a row, [rows, ...], of this process's rows as a global
    array whose rows are sharded as the batch's (``sharding``)."""
    spec = P(sharding.spec[0], *([None] * (local.ndim - 1)))
    return jax.make_array_from_process_local_data(NamedSharding(sharding.mesh, spec), local)


def seq_shards(sharding: NamedSharding) -> int:
    """How many parts a batch ``sharding`` splits each row's tokens into (``mesh.context``)."""
    entry = sharding.spec[1] if len(sharding.spec) > 1 else None
    return int(np.prod([sharding.mesh.shape[a] for a in mesh_axes(entry)]))


def global_batch(local: dict, sharding: NamedSharding) -> Batch:
    """Assemble this process's rows into global arrays laid out as ``sharding``."""
    return {k: jax.make_array_from_process_local_data(sharding, local[k]) for k in BATCH_KEYS}
