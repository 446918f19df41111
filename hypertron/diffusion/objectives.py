"""What a diffusion training step computes around the model: timesteps drawn for a batch, the noisy
input at them, the target the model learns, and each example's loss weight. The formulas are those of
diffusers' training scripts and ``diffusers.training_utils`` (0.42.1), which the tests hold them to.

Objectives (``OBJECTIVES``):

``epsilon`` and ``v_prediction``
    A DDPM training schedule of ``T`` steps (the folder's ``scheduler_config.json``: its betas,
    ``alpha_bar`` as diffusers rounds it, :func:`hypertron.diffusion.schedulers.train_alpha_bar`).
    Timestep ``t`` in ``[0, T)``; ``x_t = sqrt(alpha_bar_t) x0 + sqrt(1 - alpha_bar_t) eps``
    (``DDPMScheduler.add_noise``); the model learns ``eps``, or ``v = sqrt(alpha_bar_t) eps -
    sqrt(1 - alpha_bar_t) x0`` (``get_velocity``).
``flow``
    Rectified flow (SD3, Flux): the ``FlowMatchEulerDiscreteScheduler``'s training sigmas, ``T`` of
    them from 1 down to ``1 / T``, shifted by its ``shift`` (unless it shifts dynamically, as
    Flux's does); index ``i`` in ``[0, T)`` picks ``sigma_i``; ``x = (1 - sigma) x0 + sigma eps``,
    the model (called at timestep ``sigma T``) learns ``eps - x0``.

Timesteps (``TIMESTEP_SAMPLERS``) come from ``u`` in ``[0, 1)`` as ``floor(u T)``, as diffusers'
SD3 and Flux scripts index their schedule: ``uniform`` draws ``u`` uniformly; ``logit_normal`` is
``sigmoid(logit_mean + logit_std z)`` for a standard normal ``z``; ``mode`` is ``1 - u - mode_scale
(cos(pi u / 2)^2 - 1 + u)`` for a uniform ``u`` (``compute_density_for_timestep_sampling``).

Loss weights (``WEIGHTINGS``), per example, multiplying its mean squared error: ``min_snr`` is
``min(snr, gamma) / snr`` for ``epsilon`` and ``/ (snr + 1)`` for ``v_prediction`` (Hang et al.,
as ``train_text_to_image.py`` with ``--snr_gamma``; ``compute_snr``; with a zero terminal SNR the
last timestep's epsilon weight is 0 / 0, NaN, in both); ``sigma_sqrt`` is
``sigma^-2`` and ``cosmap`` ``2 / (pi (1 - 2 sigma + 2 sigma^2))`` for ``flow``
(``compute_loss_weighting_for_sd3``).

Nothing here draws implicitly: :func:`draw` takes a key, which a step derives from (seed, step) so
that a resumed run repeats its draws.
"""

from __future__ import annotations

import dataclasses
import math
import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config.schema import DiffusionObjective, TimestepSampler, Weighting, choices
from hypertron.diffusion.errors import DiffusionError
from hypertron.diffusion.schedulers import SchedulerConfig, flow_train_sigmas, train_alpha_bar

OBJECTIVES = choices(DiffusionObjective)
TIMESTEP_SAMPLERS = choices(TimestepSampler)
WEIGHTINGS = choices(Weighting)
# The timestep samplers' settings by default: diffusers' SD3 and Flux scripts' (--logit_mean,
# --logit_std, --mode_scale).
LOGIT_MEAN, LOGIT_STD, MODE_SCALE = 0.0, 1.0, 1.29
# The weightings each objective takes ("none" fits all).
_FITS = {"min_snr": ("epsilon", "v_prediction"), "sigma_sqrt": ("flow",), "cosmap": ("flow",)}


@dataclasses.dataclass(frozen=True, eq=False)
class TrainingSchedule:
    """The per-timestep scalars of one objective, float32 ``[T]`` host arrays: ``a`` and ``s`` with
    ``x_t = a x0 + s eps`` (``sqrt(alpha_bar)`` and ``sqrt(1 - alpha_bar)``; for flow ``1 - sigma``
    and ``sigma``), and ``timesteps``, what the model is called with at each index (``t`` itself;
    for flow ``sigma T``)."""

    objective: str
    a: np.ndarray
    s: np.ndarray
    timesteps: np.ndarray

    @property
    def num_train_timesteps(self) -> int:
        return int(self.a.shape[0])


def training_schedule(scheduler: SchedulerConfig, objective: str, *, shift: float | None = None) -> TrainingSchedule:
    """``objective``'s schedule from a folder's scheduler config; ``shift`` (flow only) overrides the
    config's (SD3 trains at 3.0)."""
    check_objective(objective, scheduler)
    if objective == "flow":
        sigmas = flow_train_sigmas(scheduler, shift=shift)
        return TrainingSchedule(objective, (1 - sigmas).astype(np.float32), sigmas,
                                (sigmas * np.float32(scheduler.num_train_timesteps)).astype(np.float32))
    if shift is not None:
        raise DiffusionError(f"a shift applies to the flow objective only, not {objective}")
    alpha_bar = train_alpha_bar(scheduler)
    return TrainingSchedule(objective, np.sqrt(alpha_bar), np.sqrt(np.float32(1) - alpha_bar),
                            np.arange(scheduler.num_train_timesteps, dtype=np.float32))


def check_objective(objective: str, scheduler: SchedulerConfig) -> None:
    """One line naming the problem when ``objective`` does not fit the scheduler: flow needs a
    flow-matching scheduler (Flux's, SD3's), and the others one of noise levels."""
    if objective not in OBJECTIVES:
        raise DiffusionError(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
    flow_scheduler = scheduler.class_name == "FlowMatchEulerDiscreteScheduler"
    if (objective == "flow") != flow_scheduler:
        raise DiffusionError(f"objective {objective} does not fit the model's {scheduler.class_name} "
                             f"({'flow' if flow_scheduler else 'epsilon or v_prediction'} does)")


def check_weighting(weighting: str, objective: str) -> None:
    """One line when ``weighting`` is unknown or does not fit ``objective``."""
    if weighting not in WEIGHTINGS:
        raise DiffusionError(f"weighting must be one of {', '.join(WEIGHTINGS)}, not {weighting!r}")
    if weighting in _FITS and objective not in _FITS[weighting]:
        raise DiffusionError(f"weighting {weighting} does not fit objective {objective} "
                             f"(it fits {', '.join(_FITS[weighting])})")


def u_from_draws(sampler: str, draws: jax.Array, *, logit_mean: float = LOGIT_MEAN,
                 logit_std: float = LOGIT_STD, mode_scale: float = MODE_SCALE) -> jax.Array:
    """``u`` in ``[0, 1)`` from ``draws``: standard normals for ``logit_normal``, uniforms in
    ``[0, 1)`` for the others (``compute_density_for_timestep_sampling``'s transforms)."""
    if sampler == "logit_normal":
        return jax.nn.sigmoid(logit_mean + logit_std * draws)
    if sampler == "mode":
        return 1 - draws - mode_scale * (jnp.cos(math.pi * draws / 2) ** 2 - 1 + draws)
    if sampler == "uniform":
        return draws
    raise DiffusionError(f"timesteps must be one of {', '.join(TIMESTEP_SAMPLERS)}, not {sampler!r}")


def indices_from_u(u: jax.Array, num_train_timesteps: int) -> jax.Array:
    """``floor(u T)`` as int32, clipped into ``[0, T)`` (``u`` of exactly 1, which ``mode`` can give
    for ``u = 0``, takes the last index rather than one past it)."""
    return jnp.clip(jnp.floor(u * num_train_timesteps), 0, num_train_timesteps - 1).astype(jnp.int32)


def draw(key: jax.Array, batch: int, schedule: TrainingSchedule, sampler: str = "uniform", *,
         logit_mean: float = LOGIT_MEAN, logit_std: float = LOGIT_STD,
         mode_scale: float = MODE_SCALE) -> jax.Array:
    """``batch`` timestep indices into ``schedule``, int32, from ``key``."""
    if sampler == "logit_normal":
        draws = jax.random.normal(key, (batch,), jnp.float32)
    else:
        draws = jax.random.uniform(key, (batch,), jnp.float32)
    u = u_from_draws(sampler, draws, logit_mean=logit_mean, logit_std=logit_std, mode_scale=mode_scale)
    return indices_from_u(u, schedule.num_train_timesteps)


def _per_example(table: np.ndarray, index_b: jax.Array, ndim: int) -> jax.Array:
    """``table[index]`` shaped to broadcast over an example's other ``ndim - 1`` axes."""
    return jnp.asarray(table)[index_b].reshape((-1,) + (1,) * (ndim - 1))


def add_noise(schedule: TrainingSchedule, x0: jax.Array, noise: jax.Array, index_b: jax.Array) -> jax.Array:
    """``a x0 + s noise`` at each example's index (float32)."""
    a, s = (_per_example(t, index_b, x0.ndim) for t in (schedule.a, schedule.s))
    return a * x0.astype(jnp.float32) + s * noise.astype(jnp.float32)


def target(schedule: TrainingSchedule, x0: jax.Array, noise: jax.Array, index_b: jax.Array) -> jax.Array:
    """What the model learns to output: ``noise``, the velocity ``a noise - s x0``, or ``noise - x0``."""
    x0, noise = x0.astype(jnp.float32), noise.astype(jnp.float32)
    if schedule.objective == "epsilon":
        return noise
    if schedule.objective == "flow":
        return noise - x0
    a, s = (_per_example(t, index_b, x0.ndim) for t in (schedule.a, schedule.s))
    return a * noise - s * x0


def snr(schedule: TrainingSchedule, index_b: jax.Array) -> jax.Array:
    """``(a / s)^2`` at each index (``compute_snr``; for flow ``((1 - sigma) / sigma)^2``)."""
    a, s = (jnp.asarray(t)[index_b] for t in (schedule.a, schedule.s))
    return (a / s) ** 2


def loss_weights(schedule: TrainingSchedule, index_b: jax.Array, weighting: str = "none", *,
                 snr_gamma: float = 5.0) -> jax.Array:
    """Each example's weight ``[batch]`` float32 (see the module's docstring)."""
    check_weighting(weighting, schedule.objective)
    if weighting == "min_snr":
        r = snr(schedule, index_b)
        clipped = jnp.minimum(r, snr_gamma)
        return clipped / (r if schedule.objective == "epsilon" else r + 1)
    sigma = jnp.asarray(schedule.s)[index_b]
    if weighting == "sigma_sqrt":
        return sigma ** -2.0
    if weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigma + 2 * sigma ** 2))
    return jnp.ones_like(sigma)


def weighted_mse(prediction: jax.Array, target_: jax.Array, weights_b: jax.Array) -> jax.Array:
    """The batch's loss: each example's mean squared error times its weight, averaged (float32)."""
    err = (prediction.astype(jnp.float32) - target_.astype(jnp.float32)) ** 2
    per_example = jnp.mean(err.reshape(err.shape[0], -1), axis=1)
    return jnp.mean(per_example * weights_b)


def offset_noise(key: jax.Array, noise: jax.Array, offset: float) -> jax.Array:
    """``noise`` plus ``offset`` times one normal draw per example and channel (the last axis,
    channels-last), as diffusers' ``--noise_offset``; 0 returns ``noise``."""
    if offset == 0:
        return noise
    shape = (noise.shape[0],) + (1,) * (noise.ndim - 2) + (noise.shape[-1],)
    return noise + offset * jax.random.normal(key, shape, noise.dtype)
