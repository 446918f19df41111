"""The samplers of a diffusers ``scheduler_config.json``: DDIM, Euler, Euler ancestral, DPM-Solver++
(multistep, order 1 or 2) and flow-match Euler, equal to diffusers 0.42.1's.

Two halves. On the host, :func:`make_schedule` turns a checked :class:`SchedulerConfig` and a step
count into a :class:`Schedule`: the denoiser's timesteps and every per-step scalar the update needs,
computed in numpy (float64, then cast to float32 once) and cached per (config, steps). On the device,
:meth:`Schedule.step` is a pure JAX function of a traced step index, made to run inside ``lax.scan``::

    state, prev_sample = schedule.step(state, model_output, index, sample, noise)

DPM-Solver++ keeps its previous prediction of the clean sample in ``state`` (start it with
:meth:`Schedule.init_state`; its first step is first order, at whatever index it starts). Euler
ancestral takes its fresh Gaussian ``noise`` from the caller, so the caller owns the randomness
(``noise`` is ignored by the others and may be ``None``).

Notation. ``alpha_bar[t]`` is the training schedule's cumulative product of ``1 - beta``. A noisy
sample is ``x = a x0 + s eps``: DDIM and DPM-Solver work on ``a = sqrt(alpha_bar)``, ``s = sqrt(1 -
alpha_bar)`` ("variance preserving"); the Euler samplers on ``x / a``, so ``a = 1`` and ``s = sigma =
sqrt((1 - alpha_bar) / alpha_bar)`` (k-diffusion's sigma); flow matching on ``a = 1 - sigma``, ``s =
sigma``. The model predicts ``eps``, ``x0`` (``sample``) or ``v = (a eps - s x0) / sqrt(a^2 + s^2)``;
every one of them is linear in (x, model output), so the host turns the prediction type into four
coefficients per step and the device does two multiply-adds.

The training schedule is computed with diffusers' float32 roundings (betas and ``alpha_bar`` in
float32, the cumulative product accumulated in float64 as torch does on CPU): near ``t = 0``,
``1 - alpha_bar`` in float32 moves sigma by 1e-5 of itself, so a float64 schedule would not match.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config.numbers import check_number, shown
from hypertron.diffusion.errors import DiffusionError

DDIM, EULER, EULER_A, DPM, FLOW = (
    "DDIMScheduler",
    "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler",
    "DPMSolverMultistepScheduler",
    "FlowMatchEulerDiscreteScheduler",
)
CLASSES = (DDIM, EULER, EULER_A, DPM, FLOW)

_F32 = np.float32
_BETA_OPTIONS = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "prediction_type",
                 "timestep_spacing", "steps_offset", "rescale_betas_zero_snr")
# The options hypertron honours, per class (its other keys are another class's, ignored as diffusers'
# from_config ignores them, so an SD folder's PNDM config can drive DDIM)
_OPTIONS = {
    DDIM: (*_BETA_OPTIONS, "clip_sample", "clip_sample_range", "set_alpha_to_one"),
    EULER: (*_BETA_OPTIONS, "use_karras_sigmas", "sigma_min", "sigma_max"),
    EULER_A: _BETA_OPTIONS,
    DPM: (*_BETA_OPTIONS, "solver_order", "lower_order_final", "use_karras_sigmas"),
    FLOW: ("num_train_timesteps", "shift", "use_dynamic_shifting", "base_shift", "max_shift",
           "base_image_seq_len", "max_image_seq_len", "use_karras_sigmas"),
}
# The class's other options: only diffusers' default is supported, any other value is refused
_FIXED: dict[str, dict[str, Any]] = {
    DDIM: {"trained_betas": None, "thresholding": False},
    EULER: {"trained_betas": None, "interpolation_type": "linear", "use_exponential_sigmas": False,
            "use_beta_sigmas": False, "timestep_type": "discrete", "final_sigmas_type": "zero"},
    EULER_A: {"trained_betas": None},
    DPM: {"trained_betas": None, "algorithm_type": "dpmsolver++", "solver_type": "midpoint",
          "thresholding": False, "euler_at_final": False, "use_exponential_sigmas": False,
          "use_beta_sigmas": False, "use_lu_lambdas": False, "use_flow_sigmas": False,
          "final_sigmas_type": "zero", "lambda_min_clipped": -math.inf, "variance_type": None,
          "use_dynamic_shifting": False},
    FLOW: {"invert_sigmas": False, "shift_terminal": None, "use_exponential_sigmas": False,
           "use_beta_sigmas": False, "time_shift_type": "exponential", "stochastic_sampling": False},
}
_CHOICES: dict[str, tuple] = {
    "beta_schedule": ("linear", "scaled_linear", "squaredcos_cap_v2"),
    "prediction_type": ("epsilon", "v_prediction", "sample"),
    "timestep_spacing": ("leading", "trailing", "linspace"),
    "solver_order": (1, 2),
}
# diffusers' defaults where a class departs from the dataclass's
_CLASS_DEFAULTS = {DDIM: {"timestep_spacing": "leading", "clip_sample": True}}
_POSITIVE = ("num_train_timesteps", "beta_start", "beta_end", "clip_sample_range", "shift",
             "base_image_seq_len", "max_image_seq_len", "sigma_min", "sigma_max")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """A ``scheduler_config.json``, checked: the class and every option hypertron honours, diffusers'
    defaults filled in. Options of other classes keep these defaults and are never read."""

    class_name: str
    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    prediction_type: str = "epsilon"
    timestep_spacing: str = "linspace"
    steps_offset: int = 0
    rescale_betas_zero_snr: bool = False
    clip_sample: bool = False  # DDIM's default is True (_CLASS_DEFAULTS)
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    use_karras_sigmas: bool = False
    sigma_min: float | None = None
    sigma_max: float | None = None
    solver_order: int = 2
    lower_order_final: bool = True
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096


def _checked(key: str, value: Any, default: Any, where: str) -> Any:
    """``value`` if it has the JSON type of ``default`` and is allowed, else :class:`DiffusionError`.
    Numbers go through the one number reader (finite, in range); ``sigma_min``/``sigma_max`` may be null."""
    if isinstance(default, (bool, str)):
        if type(value) is not type(default):
            wanted = "true or false" if isinstance(default, bool) else "a string"
            raise DiffusionError(f"{where}: {key}={shown(value)} must be {wanted}")
    elif not (value is None and default is None):
        kind = int if isinstance(default, int) else float
        if isinstance(value, str):  # JSON's own numbers only (a flag's string would be read)
            number, reason = None, f"expected a number, got {shown(value)}"
        else:
            number, reason = check_number(value, kind, low=0 if key == "steps_offset" else None,
                                          above=0 if key in _POSITIVE else None)
        if number is None:
            raise DiffusionError(f"{where}: {key}: {reason}")
        value = number
    if key in _CHOICES and value not in _CHOICES[key]:
        allowed = ", ".join(map(str, _CHOICES[key]))
        raise DiffusionError(f"{where}: {key}={shown(value)} is not supported (supported: {allowed})")
    return value


def parse_config(config: Mapping[str, Any], *, source: str = "scheduler_config.json",
                 class_name: str | None = None) -> SchedulerConfig:
    """Check a ``scheduler_config.json`` dict as ``class_name`` (default: its ``_class_name``).

    An unsupported class, or an option of the class with a value hypertron does not implement, is a
    :class:`DiffusionError` naming ``source``, the key and the value. Keys that are not options of the
    class (another scheduler's, ``_diffusers_version``) are ignored, as diffusers' ``from_config`` does."""
    if not isinstance(config, Mapping):
        raise DiffusionError(f"{source}: must be a JSON object, not {type(config).__name__}")
    name = class_name or config.get("_class_name")
    where = f"{source}: {name}"
    if name not in CLASSES:
        raise DiffusionError(f"{source}: scheduler class {shown(name)} is not supported "
                             f"(supported: {', '.join(CLASSES)})")
    defaults = SchedulerConfig(class_name=name)
    values = dict(_CLASS_DEFAULTS.get(name, {}))
    for key, value in config.items():
        if key in _FIXED[name] and value != _FIXED[name][key]:
            raise DiffusionError(f"{where}: {key}={shown(value)} is not supported "
                                 f"(only {_FIXED[name][key]!r})")
        if key in _OPTIONS[name]:
            values[key] = _checked(key, value, getattr(defaults, key), where)
    if name == EULER_A and values.get("prediction_type") == "sample":  # nor does diffusers
        raise DiffusionError(f"{where}: prediction_type='sample' is not supported "
                             "(supported: epsilon, v_prediction)")
    if values.get("max_image_seq_len", 4096) <= values.get("base_image_seq_len", 256):
        raise DiffusionError(f"{where}: max_image_seq_len must be greater than base_image_seq_len")
    return dataclasses.replace(defaults, **values)


# ---------------------------------------------------------------------------------------------------
# The device half: a schedule and its step


@functools.partial(jax.tree_util.register_dataclass, meta_fields=["kind", "clip"],
                   data_fields=["timesteps", "sigmas", "table", "init_noise_sigma"])
@dataclasses.dataclass(frozen=True)
class Schedule:
    """One sampler run of ``n`` steps: what the denoiser is given and what each update reads.

    ``timesteps`` [n]: the denoiser's timestep at step i (diffusers' ``scheduler.timesteps``, float32).
    ``sigmas`` [n + 1]: the noise level at each step and after the last (diffusers' ``sigmas``; DDIM has
    none: its ``alpha_bar`` is in the table). ``table``: float32 [n] per-step scalars of the update.
    ``init_noise_sigma``: what unit Gaussian initial latents are multiplied by. A pytree whose arrays
    are leaves, so a jitted loop can take it as an argument and serve any config of the same kind."""

    timesteps: Any
    sigmas: Any
    table: dict[str, Any]
    init_noise_sigma: Any  # a float on the host
    kind: str
    clip: float | None

    @property
    def num_steps(self) -> int:
        return int(np.shape(self.timesteps)[0])

    @property
    def needs_noise(self) -> bool:
        """Whether :meth:`step` draws on its ``noise`` argument (Euler ancestral)."""
        return self.kind == EULER_A

    def _at(self, index, dtype) -> dict[str, jax.Array]:
        return {k: jnp.asarray(v, dtype)[index] for k, v in self.table.items()}

    def init_state(self, sample: jax.Array) -> Any:
        """The step's first state: DPM-Solver's previous clean-sample prediction and whether there is
        one (its first step, at any index, is first order, as diffusers'), nothing for the others."""
        if self.kind != DPM:
            return ()
        return jnp.zeros(sample.shape, _compute_dtype(sample)), jnp.zeros((), bool)

    def scale_model_input(self, sample: jax.Array, index) -> jax.Array:
        """The denoiser's input at step ``index``: the Euler samplers divide by ``sqrt(sigma^2 + 1)``,
        back to the variance-preserving scale the model was trained on; the others pass it through."""
        if self.kind not in (EULER, EULER_A):
            return sample
        return (sample / self._at(index, _compute_dtype(sample))["input_divisor"]).astype(sample.dtype)

    def add_noise(self, original: jax.Array, noise: jax.Array, index) -> jax.Array:
        """``original`` (clean latents) noised to step ``index``'s level, as diffusers' ``add_noise``
        (``scale_noise`` for flow matching) at ``timesteps[index]``: img2img's starting point."""
        c = self._at(index, _compute_dtype(original))
        return (c["noised_x0"] * original + c["noised_eps"] * noise).astype(original.dtype)

    def step(self, state: Any, model_output: jax.Array, index, sample: jax.Array,
             noise: jax.Array | None = None) -> tuple[Any, jax.Array]:
        """One update from step ``index`` (traced int) to the next: ``(state, prev_sample)``, the
        sample's shape and dtype. Computed in at least float32."""
        if self.kind == EULER_A and noise is None:
            raise ValueError("EulerAncestralDiscreteScheduler's step needs noise")
        dtype = _compute_dtype(sample)
        c = self._at(index, dtype)
        x, out = sample.astype(dtype), model_output.astype(dtype)
        noise = None if noise is None else noise.astype(dtype)
        state, prev = _STEPS[self.kind](self, c, state, x, out, noise)
        return state, prev.astype(sample.dtype)


def _compute_dtype(x: jax.Array):
    return jnp.promote_types(x.dtype, jnp.float32)


def _x0(c, x, out):
    return c["x0_x"] * x + c["x0_out"] * out


def _ddim_step(s: Schedule, c, state, x, out, noise):
    """DDIM (eta = 0): x0 and eps from the prediction, x0 clipped if asked, then
    ``x_prev = sqrt(alpha_bar_prev) x0 + sqrt(1 - alpha_bar_prev) eps``."""
    x0 = _x0(c, x, out)
    if s.clip is not None:
        x0 = jnp.clip(x0, -s.clip, s.clip)
    eps = c["eps_x"] * x + c["eps_out"] * out
    return state, c["a_prev"] * x0 + c["s_prev"] * eps


def _euler_step(s: Schedule, c, state, x, out, noise):
    """Euler on the probability-flow ODE ``dx/dsigma = (x - x0) / sigma``."""
    derivative = (x - _x0(c, x, out)) / c["sigma"]
    return state, x + derivative * c["dt"]


def _euler_ancestral_step(s: Schedule, c, state, x, out, noise):
    """Euler down to ``sigma_down``, then fresh noise up to the next sigma: ``sigma_up^2 + sigma_down^2
    = sigma_next^2``."""
    derivative = (x - _x0(c, x, out)) / c["sigma"]
    return state, x + derivative * c["dt"] + noise * c["sigma_up"]


def _dpm_step(s: Schedule, c, state, x, out, noise):
    """DPM-Solver++ (2M): ``x_prev = (s_t / s_s) x - a_t (e^-h - 1) (D0 + D1 / 2)`` with ``D0`` this
    step's x0 and ``D1 = (x0 - x0_prev) / r``; first order (``D1 = 0``) on the first step taken and
    the last. The host folds it into coefficients of x, x0 and ``x0 - x0_prev`` (``d1``)."""
    x0_prev, started = state
    x0 = _x0(c, x, out)
    d1 = jnp.where(started, c["d1"], 0)
    return (x0, jnp.ones((), bool)), c["x_x"] * x + c["x_x0"] * x0 + d1 * (x0 - x0_prev)


def _flow_step(s: Schedule, c, state, x, out, noise):
    """Euler on the flow ``dx/dsigma = v`` (the model's output)."""
    return state, x + c["dt"] * out


_STEPS = {DDIM: _ddim_step, EULER: _euler_step, EULER_A: _euler_ancestral_step, DPM: _dpm_step,
          FLOW: _flow_step}


# ---------------------------------------------------------------------------------------------------
# The host half: the schedule


def make_schedule(config: SchedulerConfig, steps: int, *, image_seq_len: int | None = None,
                  sigmas: Sequence[float] | None = None) -> Schedule:
    """The :class:`Schedule` of ``steps`` steps (diffusers' ``set_timesteps``), cached.

    ``image_seq_len``: the latent's token count, which sets flow matching's shift when
    ``use_dynamic_shifting``. ``sigmas``: flow matching's own sigmas before the shift (FluxPipeline
    passes ``linspace(1, 1 / steps, steps)``)."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise DiffusionError(f"steps={shown(steps)}: must be an integer of at least 1")
    steps = int(steps)
    image_seq_len = None if image_seq_len is None else int(image_seq_len)
    if config.class_name != FLOW and steps > config.num_train_timesteps:
        raise DiffusionError(f"steps={steps}: more than the scheduler's num_train_timesteps "
                             f"({config.num_train_timesteps})")
    if sigmas is not None and config.class_name != FLOW:
        raise DiffusionError(f"{config.class_name}: custom sigmas are supported by {FLOW} only")
    return _make_schedule(config, steps, image_seq_len, None if sigmas is None else tuple(map(float, sigmas)))


@functools.lru_cache(maxsize=64)
def _make_schedule(config: SchedulerConfig, steps: int, image_seq_len: int | None,
                   sigmas: tuple[float, ...] | None) -> Schedule:
    if config.class_name == FLOW:
        schedule = _flow_schedule(config, steps, image_seq_len, sigmas)
    else:
        schedule = _SCHEDULES[config.class_name](config, steps)
    for leaf in jax.tree.leaves(schedule):  # cached, so shared: read-only
        if isinstance(leaf, np.ndarray):
            leaf.flags.writeable = False
    return schedule


def _betas(cfg: SchedulerConfig) -> np.ndarray:
    """The training betas [T], float32 as diffusers keeps them."""
    n = cfg.num_train_timesteps
    if cfg.beta_schedule == "linear":
        betas = np.linspace(cfg.beta_start, cfg.beta_end, n).astype(_F32)
    elif cfg.beta_schedule == "scaled_linear":  # linear in sqrt(beta), squared in float32
        betas = np.square(np.linspace(cfg.beta_start**0.5, cfg.beta_end**0.5, n).astype(_F32))
    else:  # squaredcos_cap_v2: Nichol & Dhariwal's cosine alpha_bar, betas capped at 0.999
        t = np.arange(n + 1) / n
        alpha_bar = np.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
        betas = np.minimum(1 - alpha_bar[1:] / alpha_bar[:-1], 0.999).astype(_F32)
    if cfg.rescale_betas_zero_snr:  # Lin et al. 2023, algorithm 1: sqrt(alpha_bar) shifted to end at 0
        root = np.sqrt(np.cumprod(1 - betas, dtype=np.float64).astype(_F32))  # in float32, as diffusers
        root = (root - root[-1]) * (root[0] / (root[0] - root[-1]))
        alpha_bar = root**2
        betas = 1 - np.concatenate([alpha_bar[:1], alpha_bar[1:] / alpha_bar[:-1]])
    return betas


def _alpha_bar(cfg: SchedulerConfig, *, zero_snr_floor: bool) -> np.ndarray:
    """``alpha_bar`` [T] float32 (a float64 running product of float32 alphas, as torch's CPU cumprod).
    With a zero terminal SNR the sigma samplers floor its last value at 2^-24 (sigma stays finite)."""
    alpha_bar = np.cumprod(1 - _betas(cfg), dtype=np.float64).astype(_F32)
    if cfg.rescale_betas_zero_snr and zero_snr_floor:
        alpha_bar[-1] = 2.0**-24
    return alpha_bar


def train_alpha_bar(cfg: SchedulerConfig) -> np.ndarray:
    """The training schedule's ``alpha_bar`` [T] float32, as a ``DDPMScheduler`` of this config holds
    its ``alphas_cumprod`` (a zero terminal SNR left at 0)."""
    return _alpha_bar(cfg, zero_snr_floor=False)


def flow_train_sigmas(cfg: SchedulerConfig, *, shift: float | None = None) -> np.ndarray:
    """A flow-matching scheduler's training sigmas [T] float32, as ``FlowMatchEulerDiscreteScheduler``
    holds them before ``set_timesteps``: ``T`` down to 1 over ``T``, shifted by ``cfg.shift`` unless
    it shifts dynamically (``shift``: by that, whatever the config says)."""
    total = cfg.num_train_timesteps
    sigma = np.linspace(1, total, total, dtype=_F32)[::-1] / _F32(total)
    if shift is not None:
        return _shifted(sigma, shift).astype(_F32)
    return sigma if cfg.use_dynamic_shifting else _shifted(sigma, cfg.shift).astype(_F32)


def _spaced_timesteps(cfg: SchedulerConfig, steps: int) -> np.ndarray:
    """The inference timesteps, descending (diffusers' ``timestep_spacing``). DPM-Solver spaces
    ``steps + 1`` points and drops the last; the Euler samplers do not round ``linspace``."""
    total, kind = cfg.num_train_timesteps, cfg.class_name
    if cfg.timestep_spacing == "trailing":
        return np.round(np.arange(total, 0, -total / steps)) - 1
    points = steps + 1 if kind == DPM else steps
    if cfg.timestep_spacing == "leading":
        t = np.arange(points) * (total // points) + cfg.steps_offset
    else:
        t = np.linspace(0, total - 1, points)
        t = t.astype(_F32) if kind in (EULER, EULER_A) else np.round(t)
    return t[::-1][:steps].astype(np.float64)


def _karras(sigma_min: float, sigma_max: float, steps: int) -> np.ndarray:
    """Karras et al. 2022's sigmas: uniform in ``sigma^(1/7)`` from sigma_max down to sigma_min."""
    ramp = np.linspace(0, 1, steps)
    return (sigma_max ** (1 / 7) + ramp * (sigma_min ** (1 / 7) - sigma_max ** (1 / 7))) ** 7


def _sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """The fractional training timestep of each sigma: linear interpolation in log sigma."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    low = np.minimum(np.sum(log_sigma[None, :] >= log_sigmas[:, None], axis=0) - 1, len(log_sigmas) - 2)
    low = np.maximum(low, 0)
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1]), 0, 1)
    return (1 - w) * low + w * (low + 1)


def _prediction_coefficients(prediction: str, a: np.ndarray, s: np.ndarray) -> dict[str, np.ndarray]:
    """x0 and eps as ``c_x x + c_out out`` from the model output on ``x = a x0 + s eps``."""
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero-SNR step divides by a = 0
        if prediction == "epsilon":
            return {"x0_x": 1 / a, "x0_out": -s / a, "eps_x": 0 * a, "eps_out": 1 + 0 * a}
        if prediction == "sample":
            return {"x0_x": 0 * a, "x0_out": 1 + 0 * a, "eps_x": 1 / s, "eps_out": -a / s}
    norm = np.sqrt(a**2 + s**2)  # v = (a eps - s x0) / norm
    return {"x0_x": a / norm**2, "x0_out": -s / norm, "eps_x": s / norm**2, "eps_out": a / norm}


def _table(**columns: np.ndarray) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.float64).astype(_F32) for k, v in columns.items()}


def _ddim_schedule(cfg: SchedulerConfig, steps: int) -> Schedule:
    """DDIM: integer timesteps; the previous step is ``t - T // steps`` whatever the spacing (as
    diffusers), its ``alpha_bar`` 1 past the end with ``set_alpha_to_one`` (else ``alpha_bar[0]``)."""
    alpha_bar = _alpha_bar(cfg, zero_snr_floor=False).astype(np.float64)
    t = _spaced_timesteps(cfg, steps).astype(np.int64)
    if t.max() >= cfg.num_train_timesteps:
        raise DiffusionError(f"{DDIM}: steps={steps} with steps_offset={cfg.steps_offset} reaches "
                             f"timestep {t.max()}, past num_train_timesteps ({cfg.num_train_timesteps})")
    prev = t - cfg.num_train_timesteps // steps
    final = 1.0 if cfg.set_alpha_to_one else alpha_bar[0]
    a_prev = np.where(prev >= 0, alpha_bar[np.maximum(prev, 0)], final)
    a, s = np.sqrt(alpha_bar[t]), np.sqrt(1 - alpha_bar[t])
    table = _table(**_prediction_coefficients(cfg.prediction_type, a, s), a_prev=np.sqrt(a_prev),
                   s_prev=np.sqrt(1 - a_prev), noised_x0=a, noised_eps=s)
    clip = float(cfg.clip_sample_range) if cfg.clip_sample else None
    return Schedule(t.astype(_F32), None, table, 1.0, DDIM, clip)


def _train_sigmas(cfg: SchedulerConfig) -> np.ndarray:
    """k-diffusion's sigma of every training timestep [T], float32 as diffusers computes it."""
    alpha_bar = _alpha_bar(cfg, zero_snr_floor=True)
    return np.sqrt((1 - alpha_bar) / alpha_bar)


def _euler_schedule(cfg: SchedulerConfig, steps: int) -> Schedule:
    """Euler and Euler ancestral: sigmas interpolated at the (fractional) timesteps, or Karras's."""
    train = _train_sigmas(cfg)
    t = _spaced_timesteps(cfg, steps)
    sigma = np.interp(t, np.arange(len(train)), train)
    if cfg.use_karras_sigmas:
        lo = cfg.sigma_min if cfg.sigma_min is not None else sigma[-1]
        hi = cfg.sigma_max if cfg.sigma_max is not None else sigma[0]
        sigma = _karras(lo, hi, len(t))
        t = _sigma_to_t(sigma, np.log(train))
    sigmas = np.append(sigma, 0.0).astype(_F32)
    s, s_next = sigmas[:-1].astype(np.float64), sigmas[1:].astype(np.float64)
    coefficients = _prediction_coefficients(cfg.prediction_type, np.ones_like(s), s)
    columns = dict(sigma=s, input_divisor=np.sqrt(np.square(sigmas[:-1]) + _F32(1)),
                   noised_x0=np.ones_like(s), noised_eps=s)
    if cfg.class_name == EULER_A:
        up = np.sqrt(s_next**2 * (s**2 - s_next**2) / s**2)
        columns.update(dt=np.sqrt(s_next**2 - up**2) - s, sigma_up=up)
    else:
        columns.update(dt=s_next - s)
    top = sigmas.max()
    init = top if cfg.timestep_spacing in ("linspace", "trailing") else np.sqrt(top * top + _F32(1))
    table = _table(**coefficients, **columns)
    return Schedule(t.astype(_F32), sigmas, table, float(init), cfg.class_name, None)


def _dpm_schedule(cfg: SchedulerConfig, steps: int) -> Schedule:
    """DPM-Solver++ (multistep, midpoint, order 1 or 2) in log-SNR ``lambda = log(a / s)``, step size
    ``h = lambda_next - lambda``; the final sigma is 0, so the last step is first order and returns x0."""
    train = _train_sigmas(cfg)
    t = _spaced_timesteps(cfg, steps)
    if cfg.use_karras_sigmas:
        sigma = _karras(float(train[0]), float(train[-1]), steps)
        t = _sigma_to_t(sigma, np.log(train))
        t = t if cfg.beta_schedule == "squaredcos_cap_v2" else np.round(t)
    else:
        sigma = np.interp(t, np.arange(len(train)), train)
    t = t.astype(np.int64)  # diffusers' int64 timesteps truncate
    sigmas = np.append(sigma, 0.0).astype(_F32).astype(np.float64)
    a = 1 / np.sqrt(sigmas**2 + 1)
    s = sigmas * a
    n = len(t)
    with np.errstate(divide="ignore", invalid="ignore"):  # lambda = +inf after the last step
        lam = np.log(a) - np.log(s)
        h = lam[1:] - lam[:-1]
        h_last = np.concatenate([[np.nan], h[:-1]])  # the previous step's h
        phi = np.exp(-h) - 1
        second = (np.arange(n) > 0) & (np.arange(n) < n - 1) & (cfg.solver_order == 2)
        d1 = np.where(second, -0.5 * a[1:] * phi * h / h_last, 0.0)  # coefficient of x0 - x0_prev
        x_x = s[1:] / s[:-1]
    coefficients = _prediction_coefficients(cfg.prediction_type, a[:-1], s[:-1])
    table = _table(**coefficients, x_x=x_x, x_x0=-a[1:] * phi, d1=d1, noised_x0=a[:-1], noised_eps=s[:-1])
    return Schedule(t.astype(_F32), sigmas.astype(_F32), table, 1.0, DPM, None)


def _flow_schedule(cfg: SchedulerConfig, steps: int, image_seq_len: int | None,
                   custom: tuple[float, ...] | None) -> Schedule:
    """Flow-match Euler: sigmas from 1 down (or ``custom``), shifted by ``shift`` or, with dynamic
    shifting, by ``mu`` linear in the image's sequence length; timesteps = sigma * T."""
    total = cfg.num_train_timesteps
    if custom is not None:
        if len(custom) != steps:
            raise DiffusionError(f"{FLOW}: {len(custom)} custom sigmas for {steps} steps")
        sigma = np.asarray(custom, _F32)  # and shifted in float32, as diffusers
    else:  # from the largest training sigma to the smallest, both already shifted unless dynamic
        lowest = _F32(1) / _F32(total)
        ends = np.array([1, lowest], _F32)
        top, bottom = ends if cfg.use_dynamic_shifting else _shifted(ends, cfg.shift)
        sigma = np.linspace(float(top) * total, float(bottom) * total, steps) / total
    if cfg.use_dynamic_shifting:
        if image_seq_len is None or image_seq_len < 1:
            raise DiffusionError(f"{FLOW}: use_dynamic_shifting needs the image's sequence length, "
                                 f"not {image_seq_len!r}")
        shift = dynamic_shift(cfg, image_seq_len)
        sigma = shift / (shift + (1 / sigma - 1))
    else:
        sigma = _shifted(sigma, cfg.shift)
    if cfg.use_karras_sigmas:
        sigma = _karras(sigma[-1], sigma[0], steps)
    sigma = sigma.astype(_F32)
    sigmas = np.append(sigma, _F32(0))
    s = sigmas.astype(np.float64)
    table = _table(dt=s[1:] - s[:-1], noised_x0=1 - s[:-1], noised_eps=s[:-1])
    return Schedule(sigma * _F32(total), sigmas, table, 1.0, FLOW, None)


def dynamic_shift(cfg: SchedulerConfig, image_seq_len: int) -> float:
    """Flux's resolution-dependent shift ``exp(mu)``, ``mu`` linear in the image's sequence length
    from ``base_shift`` at ``base_image_seq_len`` to ``max_shift`` at ``max_image_seq_len``
    (FluxPipeline's ``calculate_shift``); shifting sigma by it is diffusers' ``time_shift``
    (``e^mu / (e^mu + 1 / sigma - 1)``, the same as :func:`_shifted` by ``e^mu``)."""
    slope = (cfg.max_shift - cfg.base_shift) / (cfg.max_image_seq_len - cfg.base_image_seq_len)
    return math.exp(image_seq_len * slope + cfg.base_shift - slope * cfg.base_image_seq_len)


def _shifted(sigma: np.ndarray, shift: float) -> np.ndarray:
    """SD3's resolution shift: ``shift s / (1 + (shift - 1) s)``, in the input's dtype."""
    return shift * sigma / (1 + (shift - 1) * sigma)


_SCHEDULES = {DDIM: _ddim_schedule, EULER: _euler_schedule, EULER_A: _euler_schedule, DPM: _dpm_schedule}
