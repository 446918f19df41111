"""Training only LoRA adapters (``lora.rank`` > 0) over a frozen base: the train state is
``{"params": adapters, "base": the frozen weights, "opt_state": over the adapters only, "step"}``,
so no gradient, moment or master copy of the base exists. The step is pre-training's loss
(:func:`hypertron.train.step.loss_terms`) on the base with the adapters attached
(:func:`hypertron.models.lora.attach`), its gradients taken with respect to the adapters alone.

The base is ``train.init_from``'s parameters, held as ``lora.base_dtype`` says (:func:`hold_base`):
``auto`` in the parameter dtype, ``bfloat16`` its matmul weights in bfloat16, ``int8`` its matmul
weights int8 with a scale per output channel (the serving int8 weights, QLoRA-style; the einsum hook
adds the adapter to the int8 product). Norms stay float32. The trainer's ``init`` makes no base (not
even a random placeholder: at scale that would be a second copy while the real one is read); the
task reads it into :func:`abstract_base`'s shardings (``Trainer.external``). Checkpoints hold the
adapters, their moments and the step, not the base: a resumed run reads it from ``train.init_from``
again, refused if its files' digest differs from the one ``RUN/lora_base.json`` kept when the run
began (:class:`hypertron.train.task.LanguageModel`; while the files' names, sizes and times are
unchanged the digest is read back from ``RUN/files_digests.json``, not computed again).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hypertron.checkpoint import CheckpointError
from hypertron.config import Config
from hypertron.models import declare
from hypertron.models.lora import LoraSettings, adapter_axes, attach, held_base, init_adapters
from hypertron.models.params import is_spec
from hypertron.parallel.rules import DEFAULT_RULES, shardings_for, spec_for, use_rules
from hypertron.quant import QArray
from hypertron.train.optimizer import make_optimizer, schedule
from hypertron.train.step import Trainer, accumulate_grads, eval_totals, loss_terms, made_by_init, make_trainer


def lora_settings(cfg: Config) -> LoraSettings:
    return LoraSettings.of(cfg.lora)


def hold_base(cfg: Config, params):
    """The base as the train state holds it (``lora.base_dtype``; see the module docstring)."""
    return held_base(cfg.model, params, cfg.lora.base_dtype)


def abstract_base(cfg: Config, mesh: Mesh, rules=DEFAULT_RULES):
    """The held base's shapes, dtypes and shardings: each weight's by its declared axes (an int8
    weight's values and scales each by their own shape: a size-1 scale axis stays whole)."""
    from hypertron.models import params as param_lib
    from hypertron.models import resolve_dtype

    specs = declare(cfg.model)
    held = jax.eval_shape(lambda p: hold_base(cfg, p), param_lib.abstract(specs, resolve_dtype(cfg.model.param_dtype)))

    def put(spec, a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype,
                                    sharding=NamedSharding(mesh, spec_for(spec.axes, rules, mesh, tuple(a.shape))))

    return jax.tree.map(lambda spec, value: QArray(put(spec, value.values), put(spec, value.scales))
                        if isinstance(value, QArray) else put(spec, value), specs, held, is_leaf=is_spec)


def adapted_loss(adapters, batch, cfg: Config, histories=None, *, base, settings: LoraSettings):
    """:func:`loss_terms` of the base with ``adapters`` attached (differentiable in the adapters)."""
    return loss_terms(attach(base, adapters, settings), batch, cfg, histories)


def lora_step(state, batch, cfg: Config, optimizer: optax.GradientTransformation, settings: LoraSettings):
    """One optimiser step of the adapters; the base passes through unchanged."""
    loss_fn = functools.partial(adapted_loss, base=state["base"], settings=settings)
    grads, _, aux = accumulate_grads(state["params"], None, batch, cfg, loss_fn)
    weight = jnp.maximum(aux["weight"], 1.0)
    grads = jax.tree.map(lambda g, p: (g / weight).astype(p.dtype), grads, state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    metrics = {"loss": aux["nll_sum"] / weight, "z_loss": aux["z_sum"] / weight, "grad_norm": optax.global_norm(grads),
               "lr": schedule(cfg.train)(state["step"]), "tokens": aux["weight"]}
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
            "step": state["step"] + 1, "base": state["base"]}, metrics


def make_lora_trainer(cfg: Config, mesh: Mesh, rules=DEFAULT_RULES) -> Trainer:
    """The adapters' sharded init and step (see the module docstring); the base's shardings are
    pre-training's parameters'."""
    base = make_trainer(cfg, mesh, rules)
    settings = lora_settings(cfg)
    optimizer = make_optimizer(cfg.train)
    abstract = jax.eval_shape(lambda: init_adapters(cfg.model, settings, jax.random.key(0)))
    a_shard = shardings_for(adapter_axes(cfg.model, settings), abstract, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shard = optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, abstract), a_shard,
                                      transform_non_params=lambda _: replicated)
    held = abstract_base(cfg, mesh, rules)
    shardings = {"params": a_shard, "opt_state": opt_shard, "step": replicated,
                 "base": jax.tree.map(lambda a: a.sharding, held)}

    def init_fn(key):  # the base is train.init_from's, read in (Trainer.external)
        adapters = init_adapters(cfg.model, settings, jax.random.fold_in(key, 1))
        return {"params": adapters, "opt_state": optimizer.init(adapters), "step": jnp.zeros((), jnp.int32)}

    def step_fn(state, batch):
        with use_rules(mesh, rules):
            return lora_step(state, batch, cfg, optimizer, settings)

    step = jax.jit(step_fn, in_shardings=(shardings, base.batch_sharding), out_shardings=(shardings, replicated),
                   donate_argnums=0)
    def eval_fn(state, batch):  # the base with the adapters attached
        return eval_totals(attach(state["base"], state["params"], settings), batch, cfg, None, mesh, rules)

    external = {"base": held}
    evaluate = jax.jit(eval_fn, in_shardings=({k: shardings[k] for k in ("params", "base")}, base.batch_sharding),
                       out_shardings=replicated)
    return dataclasses.replace(base, optimizer=optimizer, state_shardings=shardings, external=external,
                               init=jax.jit(init_fn, out_shardings=made_by_init(shardings, external)), step=step,
                               eval=lambda state, batch: evaluate({k: state[k] for k in ("params", "base")}, batch))


def is_adapter(path: str) -> bool:
    """Whether ``path`` is a PEFT adapter directory (``train.init_from`` then continues it)."""
    from hypertron.models.lora import CONFIG_FILE

    return bool(path) and (Path(path) / CONFIG_FILE).is_file()


def lora_base(cfg: Config) -> str:
    """Where the frozen base is read from: ``train.init_from``, or, for an adapter there, its
    ``base_model_name_or_path``."""
    if not is_adapter(cfg.train.init_from):
        return cfg.train.init_from
    from hypertron.models.lora import peft_config

    return str(peft_config(cfg.train.init_from).get("base_model_name_or_path") or "")


def check_adapter(cfg: Config) -> None:
    """``train.init_from`` names an adapter: ``lora.*`` must be its settings, and it must name its base."""
    from hypertron.models.lora import load_peft

    where = f"train.init_from={cfg.train.init_from}"
    if not cfg.lora.rank:
        raise CheckpointError(f"{where} is a LoRA adapter: set lora.rank (and lora.alpha, lora.targets) to its "
                              "settings to train it further, or merge it into its base first "
                              "(hypertron convert --lora)")
    _, theirs = load_peft(cfg.train.init_from, cfg.model)
    ours = lora_settings(cfg)
    from hypertron.models.lora import targets

    for name, a, b in (("rank", theirs.rank, ours.rank), ("alpha", theirs.alpha, ours.alpha),
                       ("rslora", theirs.rslora, ours.rslora),
                       ("targets", sorted(t.module for t in targets(cfg.model, theirs.targets)),
                        sorted(t.module for t in targets(cfg.model, ours.targets)))):
        if a != b:
            raise CheckpointError(f"{where}: its adapter has {name} {a}, not lora.{name}={b}")
    if not lora_base(cfg):
        raise CheckpointError(f"{where}: its adapter_config.json names no base_model_name_or_path")
