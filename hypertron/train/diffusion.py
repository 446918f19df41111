"""Diffusion training (issue 44): the loss of a batch, as diffusers' training scripts compute it.

So far the loss of a UNet (SD 1.x / 2.x, SDXL: :func:`unet_loss`) or a Flux transformer
(:func:`flux_loss`) on a batch whose noise and timesteps are given, and a step's draws from its key
(:func:`draw_noise`); the ``diffusion`` task on the training loop, its data and its export are
still to come (docs/diffusion.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hypertron.diffusion import flux as F
from hypertron.diffusion import objectives as O
from hypertron.diffusion import unet as U


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
