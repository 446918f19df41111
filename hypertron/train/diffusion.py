"""Diffusion training (issue 44): the loss of a batch as diffusers' training scripts compute it, and
the trainer of ``task: diffusion`` (:mod:`hypertron.train.diffusion_task` is the task).

The losses: a UNet's (SD 1.x / 2.x, SDXL: :func:`unet_loss`) or a Flux transformer's
(:func:`flux_loss`) on a batch whose noise and timesteps are given; :func:`draw_noise` draws them.

The trainer (:func:`make_diffusion_trainer`) trains a pipeline folder's denoiser (or LoRA adapters
on it). The text encoder and the VAE stay frozen: the trainer holds them replicated, outside the
checkpointed state, and reads them from the folder again on resume; with cached encodings
(:class:`Cached`, :mod:`hypertron.train.diffusion_cache`) it loads neither the text encoder nor,
with cached latents, the VAE. A step draws its caption dropout, noise and timesteps from
``fold_in(key(train.seed), step)`` over the global batch, so a resumed run repeats an
uninterrupted one's losses bit for bit, on any mesh, cached or not. The state is the loop's
``params`` (the denoiser's), ``opt_state``, ``step`` and, with ``diffusion.use_ema``, ``ema``
(float32, sharded as the parameters; its decay of each update is computed on the host,
:mod:`hypertron.train.ema`). The evaluation takes the held-out loss at ``diffusion.eval_timesteps``
fixed timesteps with fixed noise.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hypertron.config import Config
from hypertron.diffusion import flux as F
from hypertron.diffusion import objectives as O
from hypertron.diffusion import unet as U
from hypertron.diffusion import vae as V
from hypertron.diffusion.pipeline import (FLUX, SDXL, PipelineSpec, declare_denoiser, load_denoiser, read_config,
                                         read_pipeline)
from hypertron.diffusion import lora as DL
from hypertron.models import lora as L
from hypertron.models import params as param_lib
from hypertron.parallel.rules import DEFAULT_RULES, spec_for, use_rules
from hypertron.train import ema as E
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


def denoiser_loss(pipeline: str, cfg: Any, schedule: O.TrainingSchedule, params: Any, x0: jax.Array,
                  noise: jax.Array, index: jax.Array, cond: dict, *, weighting: str = "none", snr_gamma: float = 5.0,
                  guidance: float = 3.5) -> jax.Array:
    """The loss of ``pipeline``'s denoiser at clean latents ``x0`` [b, h, w, c] with ``noise`` of
    their shape at schedule ``index`` [b], conditioned by ``cond`` (:meth:`Conditioning.inputs`):
    a UNet's (:func:`unet_loss`), or a Flux transformer's (:func:`flux_loss`) over the latents and
    noise packed as FluxPipeline packs them, with its image and text ids and, for a model with
    ``guidance_embeds``, ``guidance`` on every row (``train_dreambooth_flux.py``'s ``guidance_scale``)."""
    if pipeline != FLUX:
        return unet_loss(params, cfg, schedule, {"latents": x0, "noise": noise, "index": index, **cond},
                         weighting=weighting, snr_gamma=snr_gamma)
    b, h, w, _ = x0.shape
    packed = {k: F.pack_latents(x.transpose(0, 3, 1, 2)) for k, x in (("latents", x0), ("noise", noise))}
    batch = {**packed, "index": index, "context": cond["context"], "pooled": cond["pooled"],
             "img_ids": F.latent_image_ids(h // 2, w // 2), "txt_ids": F.text_ids(cond["context"].shape[1]),
             "guidance": jnp.full((b,), guidance, jnp.float32) if cfg.guidance_embeds else None}
    return flux_loss(params, cfg, schedule, batch, weighting=weighting)


EVAL_SEED = 7919  # the evaluation's noise (and the shapes source's held-out pictures) from seed + this


def lora_of(cfg: Config) -> L.LoraSettings | None:
    """The adapters ``lora.rank`` trains on the denoiser (None: the whole denoiser trains);
    ``all-linear``, the default, is diffusers' training scripts' attention projections."""
    lo = cfg.lora
    if not lo.rank:
        return None
    targets = DL.UNET_TARGETS if tuple(lo.targets) == ("all-linear",) else tuple(lo.targets)
    return L.LoraSettings(rank=lo.rank, alpha=lo.alpha, targets=targets, rslora=lo.rslora)


@dataclasses.dataclass
class DiffusionTrainer:
    """The denoiser's sharded state and its step; the frozen text encoder (and VAE) beside it."""

    cfg: Config
    mesh: Mesh
    spec: PipelineSpec
    folder: Path
    denoiser_cfg: Any  # its module's config (UNetConfig, FluxConfig)
    specs: Any  # the denoiser's declarations
    schedule: O.TrainingSchedule
    frozen: dict  # {"text"(, "text_2"), "vae"} replicated, what is not cached; LoRA's base "denoiser", sharded
    state_shardings: dict
    batch_shardings: dict
    initial_params: Any  # what trains (the folder's denoiser, or new adapters), numpy, until the first state is made
    cond: Conditioning
    cached: Cached | None = None  # the batches hold cached encodings (train.diffusion_cache)
    lora: L.LoraSettings | None = None  # adapters train on the frozen denoiser (frozen["denoiser"])
    step_fn: Any = None
    grads_fn: Any = None  # (params, frozen, batch, step) -> (the step's loss, its gradient)
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

    def gradients(self, params: Any, local: dict, step: int = 0) -> tuple[jax.Array, Any]:
        """What step ``step`` would compute from ``params`` and a batch: ``(loss, gradient)``."""
        return self.grads_fn(params, self.frozen, self.batch(local), np.int32(step))

    def example_shapes(self, side: int) -> dict[str, tuple[int, ...]]:
        """Each batch array's shape for one example at ``side`` x ``side`` pixels."""
        shapes = {"pixels": (side, side, 3), "time_ids": (6,)}
        shapes |= {key: (n,) for key, n in zip(IDS, self.cond.lengths)}
        shapes |= {k: tuple(v.shape) for k, v in (self.cond.empty or {}).items()}
        if self.spec.vae is not None:
            latent = side // self.spec.vae_scale_factor
            shapes["mean"] = shapes["logvar"] = (latent, latent, self.spec.vae.latent_channels)
        return {k: shapes[k] for k in self.batch_shardings}

    def step(self, state: dict, local: dict) -> tuple[dict, dict]:
        self.updates += 1  # which update this is, for the EMA's decay (the host's count: no sync)
        rate = E.rate(self.cfg.diffusion.ema, self.updates) if self.cfg.diffusion.use_ema else np.float32(0)
        return self.step_fn(state, self.frozen, self.batch(local), rate)


@dataclasses.dataclass(frozen=True)
class Cached:
    """What a run reads from cached encodings (:mod:`hypertron.train.diffusion_cache`) in place of
    encoding each batch: the prompt embeddings always (``context`` [s, d] an example, and SDXL's and
    Flux's ``pooled`` [p]), and with ``latents`` the image's too (the VAE's ``mean`` and ``logvar``, or a
    pixel model's ``pixels``). ``empty``: the empty caption's embeddings, which caption dropout
    puts in."""

    empty: dict[str, np.ndarray]
    latents: bool


IDS = ("ids", "ids_2")  # a batch's token ids, one array per text encoder (frozen "text", "text_2")
TEXTS = ("text", "text_2")


@dataclasses.dataclass(frozen=True)
class Conditioning:
    """What turns a batch into the denoiser's inputs: the pipeline's class, the frozen text
    encoders' configs (SDXL and Flux have two), each one's tokens a caption and whether they start
    with bos (CLIP's do, T5's not), the empty caption's ids per encoder (caption dropout) or,
    cached, its embeddings; the pipeline's VAE config (None: pixels). A batch holds ``ids``
    (``ids_2``) or cached ``context`` (``pooled``), ``pixels`` or cached ``mean`` and ``logvar``,
    and for SDXL ``time_ids`` (its micro-conditioning: original size, crop corner, target size):
    either way the same key draws the same dropout and latents."""

    pipeline: str
    text_cfgs: tuple
    lengths: tuple[int, ...]
    bos: tuple[bool, ...]
    empty_ids: tuple | None
    vae: Any
    empty: dict | None = None

    def text(self, frozen: dict, ids: tuple) -> dict[str, jax.Array]:
        """The prompt embeddings of each encoder's ids [b, t], as diffusers' training scripts encode
        them: ``context`` (SD 1.x / 2.x: CLIP's last hidden state; SDXL: both CLIPs' penultimate
        states side by side; Flux: T5's last state) and SDXL's and Flux's ``pooled`` (SDXL: the
        second CLIP's projection; Flux: CLIP's pooled output)."""
        from hypertron.diffusion.text_encoders import clip_encode, sd_prompt_embeds, sdxl_prompt_embeds, t5_encode

        if self.pipeline == FLUX:
            return {"context": t5_encode(frozen["text_2"], self.text_cfgs[1], ids[1]),
                    "pooled": clip_encode(frozen["text"], self.text_cfgs[0], ids[0]).pooled_bd}
        outs = [clip_encode(frozen[name], c, i) for name, c, i in zip(TEXTS, self.text_cfgs, ids)]
        if self.pipeline == SDXL:
            context, pooled = sdxl_prompt_embeds(*outs)
            return {"context": context, "pooled": pooled}
        return {"context": sd_prompt_embeds(outs[0], frozen["text"], self.text_cfgs[0])}

    def moments(self, frozen: dict, pixels: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The VAE posterior's ``(mean, logvar)`` of ``pixels`` [b, h, w, 3] in [-1, 1]."""
        return V.encode(frozen["vae"], self.vae, pixels)

    def inputs(self, frozen: dict, batch: dict, key: jax.Array, dropout: float) -> tuple[jax.Array, dict]:
        """The clean latents (the pixels, or latents sampled from the VAE's posterior) and the
        denoiser's conditioning (``context``; SDXL's ``added``, Flux's ``pooled``), ``dropout`` of
        the captions emptied (the unconditional branch CFG needs)."""
        k_drop, k_latent = jax.random.split(key)
        cached = "context" in batch
        rows = (batch["context"] if cached else batch["ids"]).shape[0]
        drop = jax.random.uniform(k_drop, (rows,)) < dropout if dropout > 0 else None

        def dropped(x, empty):
            if drop is None:
                return x
            return jnp.where(drop.reshape(-1, *[1] * (x.ndim - 1)), jnp.asarray(empty)[None], x)

        if cached:
            text = {k: dropped(batch[k], v) for k, v in self.empty.items()}
        else:
            text = self.text(frozen, tuple(dropped(batch[k], e) for k, e in zip(IDS, self.empty_ids)))
        if "mean" in batch:
            mean, logvar = batch["mean"], batch["logvar"]
        elif self.vae is not None:
            mean, logvar = self.moments(frozen, batch["pixels"])
        if self.vae is None:
            x0 = batch["pixels"]
        else:
            x0 = V.vae_to_latents(self.vae, mean + jnp.exp(0.5 * logvar) * jax.random.normal(k_latent, mean.shape))
        cond = dict(text)
        if self.pipeline == SDXL:
            cond = {"context": text["context"], "added": {"text_embeds": text["pooled"], "time_ids": batch["time_ids"]}}
        return jax.lax.stop_gradient(x0), jax.lax.stop_gradient(cond)


def batch_ranks(cached: Cached | None, spec: PipelineSpec) -> dict[str, int]:
    """A batch's arrays and their ranks: ``ids`` (``ids_2``) or cached ``context`` (``pooled``);
    ``pixels``, or cached latents' ``mean`` and ``logvar`` (a pixel model's cached latents are its
    ``pixels``); SDXL's ``time_ids``."""
    sdxl = spec.class_name == SDXL
    text = ({k: 2 for k in IDS[:len(spec.kind.text_encoders)]} if cached is None
            else {"context": 3} | ({"pooled": 2} if spec.class_name in (SDXL, FLUX) else {}))
    image = ({"mean": 4, "logvar": 4} if cached is not None and cached.latents and spec.vae is not None
             else {"pixels": 4})
    return text | image | ({"time_ids": 2} if sdxl else {})


def _shardings(cfg: Config, mesh: Mesh, p_abstract: Any, axes: Any, optimizer, rules, ranks: dict[str, int]
               ) -> tuple[dict, dict]:
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
    return state, {k: NamedSharding(mesh, P(rows, *[None] * (rank - 1))) for k, rank in ranks.items()}


def _init_state(optimizer, use_ema: bool, params: Any) -> dict:
    """A first state of ``params``: the optimiser's, step 0, and with ``use_ema`` the average."""
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    if use_ema:
        state["ema"] = E.init(params)
    return state


def token_layout(folder: Path, spec: PipelineSpec, t5_length: int) -> tuple[tuple, tuple[int, ...], tuple[bool, ...]]:
    """Each text encoder's config (read from its ``config.json``), tokens a caption (CLIP's
    positions, T5's ``t5_length``) and whether its ids start with bos (CLIP's do, T5's not)."""
    from hypertron.diffusion.text_encoders import T5EncoderConfig, text_config

    cfgs = tuple(text_config(read_config(folder / name / "config.json"), str(folder / name))
                 for name in spec.kind.text_encoders)
    t5 = tuple(isinstance(c, T5EncoderConfig) for c in cfgs)
    return cfgs, tuple(t5_length if is_t5 else c.max_positions for c, is_t5 in zip(cfgs, t5)), tuple(not x for x in t5)


def frozen_encoders(folder: Path, spec: PipelineSpec, cached: Cached | None, t5_length: int
                    ) -> tuple[dict, Conditioning]:
    """The frozen encoders a run loads (``text``, ``text_2``, ``vae``: what is not cached) and the
    conditioning over them; ``t5_length``: T5's tokens a caption (Flux)."""
    from hypertron.diffusion.text_encoders import load_text_encoder, prompt_ids
    from hypertron.tokenizer import get_tokenizer

    frozen: dict = {}
    if cached is None:
        encoders = [load_text_encoder(folder / name) for name in spec.kind.text_encoders]
        frozen |= {key: e.params for key, e in zip(TEXTS, encoders)}
    cfgs, lengths, bos = token_layout(folder, spec, t5_length)
    empty = None if cached is not None else tuple(
        prompt_ids(get_tokenizer(str(folder / name)), [""], n, bos=b)[0]
        for name, n, b in zip(spec.kind.tokenizers, lengths, bos))
    cond = Conditioning(spec.class_name, cfgs, lengths, bos, empty, spec.vae, cached.empty if cached else None)
    if spec.vae is not None and not (cached is not None and cached.latents):
        frozen["vae"] = V.load_vae(folder / "vae")[1]
    return frozen, cond


def make_diffusion_trainer(cfg: Config, mesh: Mesh, folder: Path, objective: str, rules=DEFAULT_RULES,
                           cached: Cached | None = None, shift: float | None = None) -> DiffusionTrainer:
    """The trainer of ``folder``'s denoiser (see the module's docstring); nothing compiled yet.
    ``cached``: the batches hold cached encodings, so the text encoder (and, with cached latents,
    the VAE) is not loaded. ``shift``: the flow objective's (None: ``diffusion.shift``, or the
    scheduler's)."""
    f, spec = cfg.diffusion, read_pipeline(folder)
    _, denoiser_cfg, initial = load_denoiser(spec)
    specs = declare_denoiser(spec, denoiser_cfg)
    replicated = NamedSharding(mesh, P())
    frozen, cond = frozen_encoders(folder, spec, cached, f.max_sequence_length)
    guidance = f.guidance or spec.kind.guidance
    frozen = jax.device_put(frozen, replicated)
    frozen_shardings = {k: replicated for k in frozen}
    ranks = batch_ranks(cached, spec)
    sched = O.training_schedule(spec.scheduler, objective, shift=shift or f.shift or None)
    optimizer, lr = make_optimizer(cfg.train), schedule(cfg.train)
    settings = lora_of(cfg)
    if settings is None:
        state_shardings, batch_shardings = _shardings(cfg, mesh, param_lib.abstract(specs, jnp.float32),
                                                      param_lib.logical_axes(specs), optimizer, rules, ranks)
        denoiser = lambda params, frozen: params  # noqa: E731
    else:  # the folder's denoiser frozen beside the text encoder, sharded as it would train
        held = L.held_base(specs, initial, cfg.lora.base_dtype)  # as read, or bfloat16, int8, fp8 matmul weights
        frozen["denoiser"] = param_lib.place_params(specs, held, mesh, rules)
        frozen_shardings["denoiser"] = jax.tree.map(lambda a: a.sharding, frozen["denoiser"])
        initial = jax.device_get(L.init_adapters(specs, settings, jax.random.key(cfg.train.seed)))
        state_shardings, batch_shardings = _shardings(cfg, mesh, jax.eval_shape(lambda: initial),
                                                      L.adapter_axes(specs, settings), optimizer, rules, ranks)
        denoiser = lambda params, frozen: L.attach(frozen["denoiser"], params, settings)  # noqa: E731

    def loss_and_grads(params, frozen, batch, step):
        """The step's loss and the gradient of what trains, its draws from (seed, step)."""
        with use_rules(mesh, rules):
            k_inputs, k_noise = jax.random.split(jax.random.fold_in(jax.random.key(cfg.train.seed), step))
            x0, conditioning = cond.inputs(frozen, batch, k_inputs, f.cond_dropout)
            noise, index = draw_noise(k_noise, x0, sched, f.timesteps, noise_offset=f.noise_offset,
                                      logit_mean=f.logit_mean, logit_std=f.logit_std, mode_scale=f.mode_scale)
            return jax.value_and_grad(lambda p: denoiser_loss(
                spec.class_name, denoiser_cfg, sched, denoiser(p, frozen), x0, noise, index, conditioning,
                weighting=f.weighting, snr_gamma=f.snr_gamma, guidance=guidance))(params)

    def step(state, frozen, batch, rate):
        loss, grads = loss_and_grads(state["params"], frozen, batch, state["step"])
        with use_rules(mesh, rules):
            updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        if f.use_ema:
            new["ema"] = E.update(state["ema"], params, rate)
        return new, {"loss": loss, "grad_norm": optax.global_norm(grads), "lr": lr(state["step"]),
                     "images": jnp.float32(jax.tree.leaves(batch)[0].shape[0])}

    eval_index = np.round(np.linspace(0, sched.num_train_timesteps - 1, f.eval_timesteps)).astype(np.int32)

    def evaluate(params, frozen, batch, j):
        """The mean loss of a held-out batch over the fixed timesteps, noise from (seed, batch j)."""
        with use_rules(mesh, rules):
            key = jax.random.fold_in(jax.random.key(cfg.train.seed + EVAL_SEED), j)
            x0, conditioning = cond.inputs(frozen, batch, key, 0.0)

            def at(i):
                noise = jax.random.normal(jax.random.fold_in(key, i + 1), x0.shape, x0.dtype)
                index = jnp.full((x0.shape[0],), jnp.asarray(eval_index)[i])
                return denoiser_loss(spec.class_name, denoiser_cfg, sched, denoiser(params, frozen), x0, noise,
                                     index, conditioning, weighting="none", guidance=guidance)

            return jnp.mean(jax.lax.map(at, jnp.arange(len(eval_index))))

    trainer = DiffusionTrainer(cfg, mesh, spec, folder, denoiser_cfg, specs, sched, frozen, state_shardings,
                               batch_shardings, initial, cond, cached, settings)
    trainer.init_fn = jax.jit(functools.partial(_init_state, optimizer, f.use_ema), out_shardings=state_shardings)
    trainer.step_fn = jax.jit(step, in_shardings=(state_shardings, frozen_shardings, batch_shardings, replicated),
                              out_shardings=(state_shardings, replicated), donate_argnums=0)
    trainer.grads_fn = jax.jit(loss_and_grads, in_shardings=(state_shardings["params"], frozen_shardings,
                                                             batch_shardings, replicated),
                               out_shardings=(replicated, state_shardings["params"]))
    trainer.eval_fn = jax.jit(evaluate, in_shardings=(state_shardings["params"], frozen_shardings, batch_shardings,
                                                      replicated), out_shardings=replicated)
    return trainer
