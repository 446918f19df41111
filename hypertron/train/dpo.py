"""``task: dpo``'s train state and step: pre-training's, with a frozen reference and the pair objective.

The state adds ``reference``: the starting parameters, sharded as the policy's, never optimised,
checkpointed with the rest (a resumed run scores against the same reference). Each row of a batch
holds one pair (:func:`hypertron.data.finetune.make_dpo_batches`); the step sums the objective of
:func:`hypertron.train.preference.dpo_terms` over the pairs of its micro-batches (so
``train.grad_accum`` and the mesh change nothing) and divides by the pairs: the loss is the mean
over the global batch's pairs, as TRL's. The metrics are TRL's names, means over the pairs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from hypertron.config import Config
from hypertron.parallel.rules import DEFAULT_RULES, use_rules
from hypertron.train.optimizer import schedule
from hypertron.train.preference import dpo_terms, pair_logps
from hypertron.train.step import Trainer, accumulate_grads, make_trainer

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def pair_sums(params, batch, cfg: Config, histories=None, *, reference):
    """``(objective summed over the batch's pairs, aux)``: ``aux`` holds ``weight`` (the pairs),
    ``tokens`` (the completions' targets) and each metric summed over the pairs."""
    del histories  # fp8 training is not taken by task: dpo
    policy, lengths = pair_logps(params, batch, cfg.model)
    ref, _ = pair_logps(reference, batch, cfg.model)
    ref = jax.lax.stop_gradient(ref)
    loss, metrics = dpo_terms(jnp.concatenate([policy[:, 0], policy[:, 1]]), jnp.concatenate([ref[:, 0], ref[:, 1]]),
                              jnp.concatenate([lengths[:, 0], lengths[:, 1]]), beta=cfg.dpo.beta,
                              loss_type=cfg.dpo.loss_type)
    aux = {k: jnp.sum(v) for k, v in metrics.items()}
    aux |= {"objective": jnp.sum(loss), "weight": jnp.asarray(loss.shape[0], jnp.float32), "tokens": jnp.sum(lengths)}
    return aux["objective"], aux


def dpo_step(state, batch, cfg: Config, optimizer: optax.GradientTransformation):
    """One optimiser step of the pair objective; returns the new state and device-side metrics."""
    loss_fn = functools.partial(pair_sums, reference=state["reference"])
    grads, _, aux = accumulate_grads(state["params"], None, batch, cfg, loss_fn)
    pairs = jnp.maximum(aux["weight"], 1.0)
    grads = jax.tree.map(lambda g, p: (g / pairs).astype(p.dtype), grads, state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": aux["objective"] / pairs, "grad_norm": optax.global_norm(grads),
               "lr": schedule(cfg.train)(state["step"]), "tokens": aux["tokens"], "pairs": aux["weight"],
               **{k: aux[k] / pairs for k in METRICS}}
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1,
            "reference": state["reference"]}, metrics


def make_dpo_trainer(cfg: Config, mesh: Mesh, rules=DEFAULT_RULES) -> Trainer:
    """Pre-training's trainer (:func:`make_trainer`) with ``reference`` in the state (initialised
    as the parameters) and :func:`dpo_step` as its step."""
    base = make_trainer(cfg, mesh, rules)
    shardings = {**base.state_shardings, "reference": base.state_shardings["params"]}

    def init_fn(key):
        state = base.init(key)
        return {**state, "reference": state["params"]}

    def step_fn(state, batch):
        with use_rules(mesh, rules):
            return dpo_step(state, batch, cfg, base.optimizer)

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    step = jax.jit(step_fn, in_shardings=(shardings, base.batch_sharding), out_shardings=(shardings, replicated),
                   donate_argnums=0)
    return dataclasses.replace(base, state_shardings=shardings, init=jax.jit(init_fn, out_shardings=shardings),
                               step=step)
