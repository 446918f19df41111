"""``task: dpo``'s train state and step: pre-training's, with a frozen reference and the pair objective.

With ``dpo.reference=frozen`` (or a model path) the state adds ``reference``: the starting parameters
(or that model's), sharded as the policy's, never optimised, checkpointed with the rest (a resumed
run scores against the same reference). With ``precomputed`` the state holds no reference: its
log-probabilities of every pair are computed once before step 1 (:func:`reference_logps`, as TRL's
``precompute_ref_log_probs``) and each batch carries its rows' (``reference_logps`` [rows, 2]), so a
step runs the policy's forward pass alone and the reference's memory is free. With LoRA
(``lora.rank``) the state is the adapters' (:mod:`hypertron.train.lora`) and the reference is the
base with the adapters off, as TRL's for PEFT models: nothing is added. Each row of a batch
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
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hypertron.config import Config
from hypertron.parallel.rules import DEFAULT_RULES, use_rules
from hypertron.train.optimizer import schedule
from hypertron.train.preference import dpo_terms, pair_logps
from hypertron.models.lora import attach
from hypertron.train.lora import lora_settings, make_lora_trainer
from hypertron.train.step import BATCH_KEYS, Trainer, accumulate_grads, made_by_init, make_trainer

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def pair_sums(params, batch, cfg: Config, histories=None, *, reference):
    """``(objective summed over the batch's pairs, aux)``: ``aux`` holds ``weight`` (the pairs),
    ``tokens`` (the completions' targets) and each metric summed over the pairs. ``reference``:
    the reference's parameters, or None to read its log-probabilities from ``batch["reference_logps"]``."""
    del histories  # fp8 training is not taken by task: dpo
    policy, lengths = pair_logps(params, batch, cfg.model)
    if reference is None:
        ref = batch["reference_logps"]
    else:
        ref, _ = pair_logps(reference, batch, cfg.model)
    ref = jax.lax.stop_gradient(ref)
    loss, metrics = dpo_terms(jnp.concatenate([policy[:, 0], policy[:, 1]]), jnp.concatenate([ref[:, 0], ref[:, 1]]),
                              jnp.concatenate([lengths[:, 0], lengths[:, 1]]), beta=cfg.dpo.beta,
                              loss_type=cfg.dpo.loss_type)
    aux = {k: jnp.sum(v) for k, v in metrics.items()}
    aux |= {"objective": jnp.sum(loss), "weight": jnp.asarray(loss.shape[0], jnp.float32), "tokens": jnp.sum(lengths)}
    return aux["objective"], aux


def adapted_pair_sums(adapters, batch, cfg: Config, histories=None, *, base, settings, reference):
    """:func:`pair_sums` of the base with LoRA ``adapters`` attached (differentiable in the adapters)."""
    return pair_sums(attach(base, adapters, settings), batch, cfg, histories, reference=reference)


def dpo_step(state, batch, cfg: Config, optimizer: optax.GradientTransformation, settings=None):
    """One optimiser step of the pair objective; returns the new state and device-side metrics.
    With LoRA ``settings`` the state's ``params`` are the adapters over its ``base``, and the
    reference (unless precomputed) is the base with the adapters off, as TRL's for PEFT models."""
    if settings is None:
        loss_fn = functools.partial(pair_sums, reference=state.get("reference"))
    else:
        loss_fn = functools.partial(adapted_pair_sums, base=state["base"], settings=settings,
                                    reference=None if precomputed(cfg) else state["base"])
    grads, _, aux = accumulate_grads(state["params"], None, batch, cfg, loss_fn)
    pairs = jnp.maximum(aux["weight"], 1.0)
    grads = jax.tree.map(lambda g, p: (g / pairs).astype(p.dtype), grads, state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": aux["objective"] / pairs, "grad_norm": optax.global_norm(grads),
               "lr": schedule(cfg.train)(state["step"]), "tokens": aux["tokens"], "pairs": aux["weight"],
               **{k: aux[k] / pairs for k in METRICS}}
    new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
    for frozen in ("reference", "base"):
        if frozen in state:
            new_state[frozen] = state[frozen]
    return new_state, metrics


def precomputed(cfg: Config) -> bool:
    """Whether the reference's log-probabilities come with the batches (``dpo.reference=precomputed``)."""
    return cfg.dpo.reference == "precomputed"


def reference_logps_sharding(trainer: Trainer) -> NamedSharding:
    """``reference_logps`` [rows, 2]: rows sharded as the batch's."""
    return NamedSharding(trainer.mesh, PartitionSpec(trainer.batch_sharding.spec[0], None))


def make_dpo_trainer(cfg: Config, mesh: Mesh, rules=DEFAULT_RULES) -> Trainer:
    """Pre-training's trainer (:func:`make_trainer`), or the adapters' (:func:`make_lora_trainer`,
    with ``lora.rank``), with :func:`dpo_step` as its step and, but with a precomputed reference or
    adapters, ``reference`` in the state (initialised as the parameters)."""
    settings = lora_settings(cfg) if cfg.lora.rank else None
    base = make_trainer(cfg, mesh, rules) if settings is None else make_lora_trainer(cfg, mesh, rules)
    shardings, batch_shardings = dict(base.state_shardings), base.batch_sharding
    held = not precomputed(cfg) and settings is None  # the reference in the state
    if precomputed(cfg):
        batch_shardings = {**{k: base.batch_sharding for k in BATCH_KEYS},
                           "reference_logps": reference_logps_sharding(base)}
    if held:
        shardings["reference"] = base.state_shardings["params"]

    def init_fn(key):
        state = base.init(key)
        return {**state, "reference": state["params"]} if held else state

    def step_fn(state, batch):
        with use_rules(mesh, rules):
            return dpo_step(state, batch, cfg, base.optimizer, settings)

    replicated = NamedSharding(mesh, PartitionSpec())
    step = jax.jit(step_fn, in_shardings=(shardings, batch_shardings), out_shardings=(shardings, replicated),
                   donate_argnums=0)
    return dataclasses.replace(base, state_shardings=shardings, step=step,
                               init=jax.jit(init_fn, out_shardings=made_by_init(shardings, base.external)))


def reference_logps(cfg: Config, trainer: Trainer, params, rows: dict[str, np.ndarray],
                    rules=DEFAULT_RULES) -> np.ndarray:
    """The log-probabilities [pairs, 2] (chosen, rejected) of ``rows`` (every pair's, as
    :func:`hypertron.data.finetune.dpo_rows` lays them out, on every process) under ``params``,
    in batches of a micro-batch's rows (``train.global_batch / train.grad_accum``), sharded as the
    train step's. The precomputed reference's one pass before step 1."""
    mesh = trainer.mesh
    chunk = cfg.train.global_batch // cfg.train.grad_accum

    def logps(p, batch):
        with use_rules(mesh, rules):
            return pair_logps(p, batch, cfg.model)[0]

    run = jax.jit(logps, out_shardings=NamedSharding(mesh, PartitionSpec()))  # as placed: the base's, with LoRA
    count = len(rows["inputs"])
    out = []
    for start in range(0, count, chunk):
        batch = {}
        for key in BATCH_KEYS:  # the last chunk padded with empty rows (segment 0: no log-probability)
            part = np.zeros((chunk, *rows[key].shape[1:]), rows[key].dtype)
            part[:min(chunk, count - start)] = rows[key][start:start + chunk]
            batch[key] = jax.make_array_from_callback(part.shape, trainer.batch_sharding, lambda i, a=part: a[i])
        out.append(np.asarray(jax.device_get(run(params, batch))))
    return np.concatenate(out)[:count].astype(np.float32)
