"""Diffusion training (issue 44): ``task: diffusion`` on the shared loop, and the loss of a batch as
diffusers' training scripts compute it.

The losses: a UNet's (SD 1.x / 2.x, SDXL: :func:`unet_loss`) or a Flux transformer's
(:func:`flux_loss`) on a batch whose noise and timesteps are given; :func:`draw_noise` draws them.

The task (:class:`DiffusionTask`) trains the denoiser of ``diffusion.model``: a diffusers folder
(SD 1.x / 2.x so far; SDXL and Flux are refused in one line until their conditioning is fed), or a
preset trained from scratch (``shapes-unet``: :mod:`hypertron.diffusion.folders`, written to
``RUN/preset`` at the run's start). The text encoder and the VAE stay frozen: the trainer holds
them replicated, outside the checkpointed state, and reads them from the folder again on resume.
A step draws its caption dropout, noise and timesteps from ``fold_in(key(train.seed), step)`` over
the global batch, so a resumed run repeats an uninterrupted one's losses bit for bit, on any mesh.
The state is the loop's ``params`` (the denoiser's), ``opt_state``, ``step`` and, with
``diffusion.use_ema``, ``ema`` (float32, sharded as the parameters; its decay of each update is
computed on the host, :mod:`hypertron.train.ema`). The evaluation takes the held-out loss at
``diffusion.eval_timesteps`` fixed timesteps with fixed noise; ``finish`` writes ``RUN/model``: the
base folder with the trained (or EMA) denoiser in place of its own.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hypertron.config import Config, ConfigError
from hypertron.diffusion import flux as F
from hypertron.diffusion import objectives as O
from hypertron.diffusion import unet as U
from hypertron.diffusion import vae as V
from hypertron.diffusion.errors import DiffusionError
from hypertron.diffusion.pipeline import PIXEL, SD, PipelineSpec, read_pipeline
from hypertron.diffusion import lora as DL
from hypertron.models import lora as L
from hypertron.models import params as param_lib
from hypertron.parallel.mesh import make_mesh
from hypertron.parallel.rules import DEFAULT_RULES, mesh_axes, spec_for, use_rules
from hypertron.train import ema as E
from hypertron.train.metrics import Throughput
from hypertron.train.optimizer import make_optimizer, schedule


def _weighted_loss(schedule: O.TrainingSchedule, batch: dict, predict, *, weighting: str, snr_gamma: float = 5.0,
                   time_divisor: float = 1.0) -> jax.Array:
    """What both losses share: the noisy latents at the batch's indices, ``predict(noisy,
    timesteps)`` at the schedule's timesteps there (over ``time_divisor``), held to
    :func:`objectives.target` with :func:`objectives.loss_weights`."""
    x0, noise, index = batch["latents"], batch["noise"], batch["index"]
    noisy = O.add_noise(schedule, x0, noise, index).astype(x0.dtype)
    prediction = predict(noisy, jnp.asarray(schedule.timesteps)[index] / time_divisor)
    weights = O.loss_weights(schedule, index, weighting, snr_gamma=snr_gamma)
    return O.weighted_mse(prediction, O.target(schedule, x0, noise, index), weights)


def unet_loss(params: Any, cfg: U.UNetConfig, schedule: O.TrainingSchedule, batch: dict, *,
              weighting: str = "none", snr_gamma: float = 5.0) -> jax.Array:
    """The weighted mean squared error of the UNet's prediction at the batch's noisy latents, as
    ``train_text_to_image.py``.

    ``batch``: ``latents`` ``[b, h, w, c]`` (the clean ``x0``), ``noise`` of their shape, ``index``
    int ``[b]`` into ``schedule``, ``context`` ``[b, s, d]`` (the text encoder's hidden states),
    and for SDXL ``added`` (``text_embeds``, ``time_ids``)."""
    def predict(noisy, t):
        return U.apply(params, cfg, noisy, t, batch["context"], batch.get("added"))

    return _weighted_loss(schedule, batch, predict, weighting=weighting, snr_gamma=snr_gamma)


def draw_noise(key: jax.Array, latents: jax.Array, schedule: O.TrainingSchedule, sampler: str = "uniform", *,
               noise_offset: float = 0.0, **sampler_settings) -> tuple[jax.Array, jax.Array]:
    """``(noise, index)`` for a batch of ``latents``, from ``key`` (a step's: ``fold_in(key(seed),
    step)``): standard normal noise (plus :func:`objectives.offset_noise`) and timestep indices
    from ``sampler``."""
    k_noise, k_offset, k_t = jax.random.split(key, 3)
    noise = jax.random.normal(k_noise, latents.shape, latents.dtype)
    noise = O.offset_noise(k_offset, noise, noise_offset)
    return noise, O.draw(k_t, latents.shape[0], schedule, sampler, **sampler_settings)


def flux_loss(params: Any, cfg: F.FluxConfig, schedule: O.TrainingSchedule, batch: dict, *,
              weighting: str = "none") -> jax.Array:
    """The flow-matching loss of a Flux transformer, as diffusers' ``train_dreambooth_flux.py``.

    ``batch``: ``latents`` and ``noise`` packed ``[b, t, c]`` (:func:`flux.pack_latents`: the
    loss is a mean over every element, so packing first changes nothing), ``index`` int ``[b]``,
    ``context`` (T5's states), ``pooled`` (CLIP's), ``img_ids`` and ``txt_ids``, and ``guidance``
    ``[b]`` for a model with ``guidance_embeds``. The model is called at the schedule's timestep
    over 1000, as the pipeline and the script call it."""
    def predict(noisy, t):
        return F.apply(params, cfg, noisy, t, batch["context"], batch["pooled"], batch.get("guidance"),
                       batch["img_ids"], batch["txt_ids"])

    return _weighted_loss(schedule, batch, predict, weighting=weighting, time_divisor=1000)


# ---------------------------------------------------------------------------
# task: diffusion

TRAINABLE = (SD, PIXEL)  # the pipeline classes whose denoiser the task trains so far
PRESET_DIR = "preset"  # RUN/preset: a preset's folder, written at the run's start
EVAL_SEED = 7919  # the evaluation's noise (and the shapes source's held-out pictures) from seed + this


def base_folder(cfg: Config) -> Path:
    """Where ``diffusion.model``'s folder is: itself, or for a preset ``RUN/preset``."""
    from hypertron.diffusion.folders import PRESETS

    return Path(cfg.run_dir) / PRESET_DIR if cfg.diffusion.model in PRESETS else Path(cfg.diffusion.model)


def base_spec(cfg: Config) -> PipelineSpec:
    """``diffusion.model``'s configs, no weights read: a preset's from memory, a folder's from it."""
    from hypertron.diffusion.folders import PRESETS, preset_spec

    name = cfg.diffusion.model
    if name in PRESETS:
        return preset_spec(name)
    if not Path(name).is_dir():
        raise DiffusionError(f"diffusion.model={name}: neither a diffusers folder nor a preset "
                             f"({', '.join(PRESETS)})")
    return read_pipeline(name)


def objective_of(cfg: Config, spec: PipelineSpec) -> str:
    """``diffusion.objective``; ``auto``: flow for a flow-matching scheduler, else its ``prediction_type``."""
    if cfg.diffusion.objective != "auto":
        return cfg.diffusion.objective
    return "flow" if spec.scheduler.class_name == "FlowMatchEulerDiscreteScheduler" else spec.scheduler.prediction_type


def resolution_of(cfg: Config, spec: PipelineSpec) -> int:
    """``data.resolution`` (0: the model's default side), checked against what the model takes."""
    from hypertron.diffusion import shapes

    side = cfg.data.resolution or spec.default_size()
    if cfg.data.source == "shapes" and side != shapes.SIZE:
        raise ConfigError(f"data.resolution={side}: the shapes source draws {shapes.SIZE} x {shapes.SIZE} pictures")
    multiple = spec.vae_scale_factor * U.unet_config(spec.denoiser_config, str(spec.folder)).size_multiple
    if side % multiple:
        raise ConfigError(f"data.resolution={side}: {spec.class_name} at {spec.folder} takes sides that are "
                          f"multiples of {multiple}")
    return side


def check_diffusion(cfg: Config) -> tuple[PipelineSpec, str, int]:
    """What needs the model's configs, before anything is compiled or written: the class, the
    objective and weighting against its scheduler, the resolution. ``(spec, objective, side)``."""
    f = cfg.diffusion
    spec = base_spec(cfg)
    if spec.class_name not in TRAINABLE:
        raise DiffusionError(f"diffusion.model={f.model}: training a {spec.class_name} is not built yet "
                             f"({', '.join(TRAINABLE)} are)")
    objective = objective_of(cfg, spec)
    O.check_objective(objective, spec.scheduler)
    O.check_weighting(f.weighting, objective)
    if f.shift and objective != "flow":
        raise ConfigError(f"diffusion.shift={f.shift}: a shift applies to the flow objective only, not {objective}")
    if cfg.lora.rank:  # targets the denoiser has
        L.targets(U.declare_unet(U.unet_config(spec.denoiser_config, f"{f.model}'s UNet")), lora_of(cfg).targets)
    return spec, objective, resolution_of(cfg, spec)


def lora_of(cfg: Config) -> L.LoraSettings | None:
    """The adapters ``lora.rank`` trains on the denoiser (None: the whole denoiser trains);
    ``all-linear``, the default, is diffusers' training scripts' attention projections."""
    lo = cfg.lora
    if not lo.rank:
        return None
    targets = DL.UNET_TARGETS if tuple(lo.targets) == ("all-linear",) else tuple(lo.targets)
    return L.LoraSettings(rank=lo.rank, alpha=lo.alpha, targets=targets, rslora=lo.rslora)


def _empty_context(text_cfg, tokenizer) -> np.ndarray:
    from hypertron.diffusion.text_encoders import prompt_ids

    return prompt_ids(tokenizer, [""], text_cfg.max_positions, bos=True)[0]


@dataclasses.dataclass
class DiffusionTrainer:
    """The denoiser's sharded state and its step; the frozen text encoder (and VAE) beside it."""

    cfg: Config
    mesh: Mesh
    spec: PipelineSpec
    folder: Path
    unet_cfg: Any
    specs: Any  # the denoiser's declarations
    schedule: O.TrainingSchedule
    frozen: dict  # {"text": CLIP's params, "vae": the VAE's or None} replicated; with LoRA "unet", sharded
    state_shardings: dict
    batch_shardings: dict
    initial_params: Any  # what trains (the folder's denoiser, or new adapters), numpy, until the first state is made
    lora: L.LoraSettings | None = None  # adapters train on the frozen denoiser (frozen["unet"])
    step_fn: Any = None
    eval_fn: Any = None
    init_fn: Any = None
    updates: int = 0  # the state's step, counted on the host

    def to_held(self, state: dict) -> dict:  # checkpoints hold the state as the step does
        return state

    to_model = to_held

    def abstract_state(self) -> dict:
        shapes = jax.eval_shape(self.init_fn, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                                           self.initial_params))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                            self.state_shardings)

    def initial(self) -> dict:
        params = (param_lib.place_params(self.specs, self.initial_params, self.mesh, DEFAULT_RULES) if self.lora is None
                  else jax.device_put(self.initial_params, self.state_shardings["params"]))
        self.updates = 0
        return self.init_fn(params)

    def batch(self, local: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(self.batch_shardings[k], np.asarray(local[k]))
                for k in self.batch_shardings}

    def step(self, state: dict, local: dict) -> tuple[dict, dict]:
        self.updates += 1  # which update this is, for the EMA's decay (the host's count: no sync)
        rate = E.rate(self.cfg.diffusion.ema, self.updates) if self.cfg.diffusion.use_ema else np.float32(0)
        return self.step_fn(state, self.frozen, self.batch(local), rate)


@dataclasses.dataclass(frozen=True)
class _Conditioning:
    """What turns a batch into the denoiser's inputs: the frozen text encoder's config, the empty
    caption's ids (caption dropout), the pipeline's VAE config (None: pixels)."""

    text_cfg: Any
    empty_ids: np.ndarray
    vae: Any

    def inputs(self, frozen: dict, batch: dict, key: jax.Array, dropout: float) -> tuple[jax.Array, jax.Array]:
        """The clean latents (the pixels, or the VAE's sampled latents) and the prompt embeddings,
        ``dropout`` of the captions emptied (the unconditional branch CFG needs)."""
        from hypertron.diffusion.text_encoders import clip_encode, sd_prompt_embeds

        k_drop, k_latent = jax.random.split(key)
        ids = batch["ids"]
        if dropout > 0:
            drop = jax.random.uniform(k_drop, (ids.shape[0],)) < dropout
            ids = jnp.where(drop[:, None], jnp.asarray(self.empty_ids)[None], ids)
        context = sd_prompt_embeds(clip_encode(frozen["text"], self.text_cfg, ids), frozen["text"], self.text_cfg)
        x0 = batch["pixels"]
        if self.vae is not None:
            mean, logvar = V.encode(frozen["vae"], self.vae, x0)
            x0 = V.vae_to_latents(self.vae, mean + jnp.exp(0.5 * logvar) * jax.random.normal(k_latent, mean.shape))
        return jax.lax.stop_gradient(x0), jax.lax.stop_gradient(context)


def _shardings(cfg: Config, mesh: Mesh, p_abstract: Any, axes: Any, optimizer, rules) -> tuple[dict, dict]:
    """The state's shardings (the trained tree's by its logical ``axes``, the optimiser's and the
    EMA's as those) and the batch's (rows over the rules' batch axes)."""
    from hypertron.parallel.rules import shardings_for

    replicated = NamedSharding(mesh, P())
    p_shard = shardings_for(axes, p_abstract, mesh, rules)
    opt_shard = optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, p_abstract), p_shard,
                                      transform_non_params=lambda _: replicated)
    state = {"params": p_shard, "opt_state": opt_shard, "step": replicated}
    if cfg.diffusion.use_ema:
        state["ema"] = p_shard
    rows = spec_for(("batch",), rules, mesh)[0]
    return state, {"pixels": NamedSharding(mesh, P(rows, None, None, None)), "ids": NamedSharding(mesh, P(rows, None))}


def make_diffusion_trainer(cfg: Config, mesh: Mesh, folder: Path, objective: str, rules=DEFAULT_RULES
                           ) -> DiffusionTrainer:
    """The trainer of ``folder``'s denoiser (see the module's docstring); nothing compiled yet."""
    from hypertron.diffusion.text_encoders import load_text_encoder
    from hypertron.tokenizer import get_tokenizer

    f, spec = cfg.diffusion, read_pipeline(folder)
    unet_cfg, initial = U.load_unet(folder / "unet")
    specs = U.declare_unet(unet_cfg)
    text = load_text_encoder(folder / "text_encoder")
    cond = _Conditioning(text.cfg, _empty_context(text.cfg, get_tokenizer(str(folder / "tokenizer"))), spec.vae)
    replicated = NamedSharding(mesh, P())
    frozen = jax.device_put({"text": text.params,
                             "vae": V.load_vae(folder / "vae")[1] if spec.vae is not None else None}, replicated)
    frozen_shardings = {"text": replicated, "vae": replicated}
    sched = O.training_schedule(spec.scheduler, objective, shift=f.shift or None)
    optimizer, lr = make_optimizer(cfg.train), schedule(cfg.train)
    settings = lora_of(cfg)
    if settings is None:
        state_shardings, batch_shardings = _shardings(cfg, mesh, param_lib.abstract(specs, jnp.float32),
                                                      param_lib.logical_axes(specs), optimizer, rules)
        denoiser = lambda params, frozen: params  # noqa: E731
    else:  # the folder's denoiser frozen beside the text encoder, sharded as it would train
        frozen["unet"] = param_lib.place_params(specs, initial, mesh, rules)
        frozen_shardings["unet"] = jax.tree.map(lambda a: a.sharding, frozen["unet"])
        initial = jax.device_get(L.init_adapters(specs, settings, jax.random.key(cfg.train.seed)))
        state_shardings, batch_shardings = _shardings(cfg, mesh, jax.eval_shape(lambda: initial),
                                                      L.adapter_axes(specs, settings), optimizer, rules)
        denoiser = lambda params, frozen: L.attach(frozen["unet"], params, settings)  # noqa: E731

    def init(params):
        state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
        if f.use_ema:
            state["ema"] = E.init(params)
        return state

    def step(state, frozen, batch, rate):
        with use_rules(mesh, rules):
            k_inputs, k_noise = jax.random.split(jax.random.fold_in(jax.random.key(cfg.train.seed), state["step"]))
            x0, context = cond.inputs(frozen, batch, k_inputs, f.cond_dropout)
            noise, index = draw_noise(k_noise, x0, sched, f.timesteps, noise_offset=f.noise_offset,
                                      logit_mean=f.logit_mean, logit_std=f.logit_std, mode_scale=f.mode_scale)
            loss, grads = jax.value_and_grad(lambda p: unet_loss(
                denoiser(p, frozen), unet_cfg, sched, {"latents": x0, "noise": noise, "index": index,
                                                       "context": context},
                weighting=f.weighting, snr_gamma=f.snr_gamma))(state["params"])
            updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        if f.use_ema:
            new["ema"] = E.update(state["ema"], params, rate)
        return new, {"loss": loss, "grad_norm": optax.global_norm(grads), "lr": lr(state["step"]),
                     "images": jnp.float32(x0.shape[0])}

    eval_index = np.round(np.linspace(0, sched.num_train_timesteps - 1, f.eval_timesteps)).astype(np.int32)

    def evaluate(params, frozen, batch, j):
        """The mean loss of a held-out batch over the fixed timesteps, noise from (seed, batch j)."""
        with use_rules(mesh, rules):
            key = jax.random.fold_in(jax.random.key(cfg.train.seed + EVAL_SEED), j)
            x0, context = cond.inputs(frozen, batch, key, 0.0)

            def at(i):
                noise = jax.random.normal(jax.random.fold_in(key, i + 1), x0.shape, x0.dtype)
                index = jnp.full((x0.shape[0],), jnp.asarray(eval_index)[i])
                return unet_loss(denoiser(params, frozen), unet_cfg, sched, {"latents": x0, "noise": noise,
                                                                             "index": index, "context": context})

            return jnp.mean(jax.lax.map(at, jnp.arange(len(eval_index))))

    trainer = DiffusionTrainer(cfg, mesh, spec, folder, unet_cfg, specs, sched, frozen, state_shardings,
                               batch_shardings, initial, settings)
    trainer.init_fn = jax.jit(init, out_shardings=state_shardings)
    trainer.step_fn = jax.jit(step, in_shardings=(state_shardings, frozen_shardings, batch_shardings, replicated),
                              out_shardings=(state_shardings, replicated), donate_argnums=0)
    trainer.eval_fn = jax.jit(evaluate, in_shardings=(state_shardings["params"], frozen_shardings, batch_shardings,
                                                      replicated), out_shardings=replicated)
    return trainer


class DiffusionTask:
    """``task: diffusion``: the :class:`hypertron.train.task.Task` of a denoiser (see the module's docstring)."""

    def __init__(self):
        self._checked: tuple[PipelineSpec, str, int] | None = None
        self._flops: float = 0.0
        self._written = False  # the preset's folder, once per run
        self._skipped = None  # the training reader's count of undecodable images (data.images.Skipped)

    def _check(self, cfg: Config) -> tuple[PipelineSpec, str, int]:
        if self._checked is None:
            self._checked = check_diffusion(cfg)
        return self._checked

    def check_inputs(self, cfg: Config) -> None:
        self._check(cfg)
        if cfg.data.source != "shapes":  # every record listed and checked (before the backend starts)
            self._records(cfg, "train", 0, 1)

    def mesh(self, cfg: Config, devices: list) -> Mesh:
        mesh = make_mesh(cfg.mesh, devices)
        rows = int(np.prod([mesh.shape[a] for a in mesh_axes(spec_for(("batch",), DEFAULT_RULES, mesh)[0])]))
        if cfg.train.global_batch % max(rows, jax.process_count()):
            raise ConfigError(f"train.global_batch={cfg.train.global_batch}: must divide over the {rows} batch "
                              f"shards of mesh {dict(mesh.shape)} and the {jax.process_count()} processes")
        return mesh

    def check_init_from(self, cfg: Config) -> None:
        pass  # validate_diffusion refuses train.init_from: diffusion.model is the start

    def folder(self, cfg: Config) -> Path:
        """The base pipeline folder: ``diffusion.model``, or a preset's in ``RUN/preset``, written
        by process 0 the first time a run asks (the same bytes each time: seeded by ``train.seed``),
        every process waiting for it."""
        from hypertron.diffusion.folders import PRESETS, write_preset

        folder = base_folder(cfg)
        if cfg.diffusion.model in PRESETS and not self._written:
            if jax.process_index() == 0 and not folder.exists():
                write_preset(folder, PRESETS[cfg.diffusion.model], cfg.train.seed)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("hypertron diffusion preset")
            self._written = True
        return folder

    def _records(self, cfg: Config, split: str, process_index: int, process_count: int) -> list:
        from hypertron.data.images import image_records

        d = cfg.data
        records = image_records(d.source, d.paths, image_field=d.image_field, text_field=d.text_field,
                                process_index=process_index, process_count=process_count)
        held = int(len(records) * d.eval_fraction)
        return records[len(records) - held:] if split == "eval" else records[:len(records) - held]

    def batches(self, cfg: Config, split: str = "train") -> Iterator[dict]:
        from hypertron.diffusion import shapes
        from hypertron.diffusion.text_encoders import prompt_ids, text_config
        from hypertron.data.images import Skipped, image_dataset
        from hypertron.tokenizer import get_tokenizer

        d, t = cfg.data, cfg.train
        _, _, side = self._check(cfg)
        folder = self.folder(cfg)
        where = folder / "text_encoder" / "config.json"
        length = text_config(read_json_dict(where), str(where)).max_positions
        tokenizer = get_tokenizer(str(folder / "tokenizer"))
        seed = d.seed + (EVAL_SEED if split == "eval" else 0)
        if d.source == "shapes":
            ds = shapes.dataset(seed)[jax.process_index()::jax.process_count()]
        else:
            records = self._records(cfg, split, jax.process_index(), jax.process_count())
            skipped = Skipped()
            if split == "train":
                self._skipped = skipped
            ds = image_dataset(records, side, center_crop=d.center_crop, random_flip=d.random_flip, seed=seed,
                               skipped=skipped)
            if d.shuffle and split == "train":
                ds = ds.shuffle(seed=seed)
            ds = ds.repeat()

        def tokenized(x: dict) -> dict:
            return {"pixels": np.asarray(x["pixels"], np.float32),
                    "ids": prompt_ids(tokenizer, [x["caption"]], length, bos=True)[0]}

        per_process = t.global_batch // jax.process_count()
        # to an IterDataset before batching: the image sources' filter (undecodable images) may drop elements
        return iter(ds.map(tokenized).to_iter_dataset().batch(per_process, drop_remainder=True))

    def data_fingerprint(self, cfg: Config) -> dict[str, Any]:
        d = cfg.data
        return {"source": d.source, "paths": list(d.paths), "image_field": d.image_field, "text_field": d.text_field,
                "resolution": d.resolution, "center_crop": d.center_crop, "random_flip": d.random_flip,
                "shuffle": d.shuffle, "seed": d.seed, "eval_fraction": d.eval_fraction,
                "global_batch": cfg.train.global_batch, "process_count": jax.process_count(),
                "model": cfg.diffusion.model}

    def trainer(self, cfg: Config, mesh: Mesh) -> DiffusionTrainer:
        _, objective, side = self._check(cfg)
        trainer = make_diffusion_trainer(cfg, mesh, self.folder(cfg), objective)
        self._flops = _step_flops(trainer, cfg, side)
        return trainer

    def initial_state(self, cfg: Config, trainer: DiffusionTrainer, console) -> dict:
        console.print(f"training the {trainer.spec.class_name} denoiser of {trainer.folder} "
                      f"({param_lib.count(trainer.specs) / 1e6:.2f}M parameters)", highlight=False)
        return trainer.initial()

    def restored(self, cfg: Config, trainer: DiffusionTrainer, state: dict, console) -> None:
        """The frozen text encoder and VAE are the trainer's (read from the folder); the host's
        count of updates takes the restored step."""
        trainer.updates = int(jax.device_get(state["step"]))

    def step(self, trainer: DiffusionTrainer, state: dict, local: dict) -> tuple[dict, dict]:
        """The trainer's step; with image files, ``data_skipped``: the undecodable images this
        process's reader has met so far (it reads ahead of the step)."""
        state, metrics = trainer.step(state, local)
        return state, metrics if self._skipped is None else {**metrics, "data_skipped": self._skipped.count}

    def evaluate(self, trainer: DiffusionTrainer, state: dict, batches: Iterator[dict], count: int
                 ) -> dict[str, float]:
        """The held-out loss at the fixed timesteps (of the EMA weights with ``diffusion.use_ema``)."""
        params = state["ema"] if "ema" in state else state["params"]
        losses = [trainer.eval_fn(params, trainer.frozen, trainer.batch(next(batches)), np.int32(j))
                  for j in range(count)]
        return {"loss": float(np.mean(jax.device_get(losses))), "images": float(count * trainer.cfg.train.global_batch)}

    def throughput(self, cfg: Config) -> Throughput:
        from hypertron.models.flops import device_peak_flops

        return Throughput(cfg.train.global_batch, self._flops, jax.device_count(),
                          device_peak_flops(cfg.train.peak_flops), unit="images")

    def finish(self, cfg: Config, state: dict, console) -> None:
        """``RUN/model``: the base folder with the trained denoiser (the EMA's with ``use_ema``); with
        ``lora.rank``, the adapters in ``RUN/lora/pytorch_lora_weights.safetensors`` and merged
        into ``RUN/model``'s UNet."""
        from hypertron.diffusion.folders import write_component

        params = state["ema"] if "ema" in state else state["params"]
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            params = multihost_utils.process_allgather(params, tiled=True)
        if jax.process_index() != 0:
            return
        base = base_folder(cfg)  # written already; process 0 alone is here: no waiting for the others
        out = Path(cfg.run_dir) / "model"
        tmp = out.with_name("model.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        unet = (base / "unet").resolve()
        # every component as the base has it, but the UNet's weights (the VAE's keep theirs)
        shutil.copytree(base, tmp, ignore=lambda d, names: [n for n in names if Path(d).resolve() == unet
                                                             and n.startswith("diffusion_pytorch_model")])
        hf = read_json_dict(base / "unet" / "config.json")
        specs = U.declare_unet(U.unet_config(hf, str(base / "unet" / "config.json")))
        settings = lora_of(cfg)
        if settings is not None:  # the adapters in diffusers' file, and merged into the folder's UNet
            saved = DL.save_lora(Path(cfg.run_dir) / "lora", params, settings, specs, "unet")
            console.print(f"wrote the LoRA file {saved}", highlight=False)
            params = L.merge(U.load_unet(base / "unet")[1], params, settings)
        write_component(tmp / "unet", hf, specs, params)
        if out.exists():
            shutil.rmtree(out)
        tmp.replace(out)
        console.print(f"wrote the diffusers folder {out}" + (" (the EMA weights)" if "ema" in state else ""),
                      highlight=False)


def read_json_dict(path: Path) -> dict:
    from hypertron.config.loading import read_json

    return read_json(path, DiffusionError, f"{path}: not found", lambda reason: f"{path}: invalid JSON ({reason})")


def _step_flops(trainer: DiffusionTrainer, cfg: Config, side: int) -> float:
    """The training step's FLOPs, from XLA's cost analysis of the lowered step (the forward and
    backward of the denoiser and the frozen encoders' forwards), 0 where it gives none."""
    state, b = trainer.abstract_state(), cfg.train.global_batch
    batch = {"pixels": jax.ShapeDtypeStruct((b, side, side, 3), jnp.float32, sharding=trainer.batch_shardings["pixels"]),
             "ids": jax.ShapeDtypeStruct((b, _text_length(trainer)), jnp.int32, sharding=trainer.batch_shardings["ids"])}
    try:
        cost = trainer.step_fn.lower(state, trainer.frozen, batch, np.float32(0)).cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis: no FLOPs, no MFU
        return 0.0
    cost = cost[0] if isinstance(cost, list) else cost
    return float((cost or {}).get("flops", 0.0))


def _text_length(trainer: DiffusionTrainer) -> int:
    return int(trainer.frozen["text"]["position_embed"].shape[0])
