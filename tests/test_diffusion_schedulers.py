"""hypertron's diffusion schedulers against diffusers 0.42.1's torch ones, on tiny arrays and no model:
the schedule (timesteps, sigmas, init_noise_sigma) for 1, 4, 10 and 50 steps across spacings, shifts,
dynamic shifting and Karras; two consecutive steps per prediction type; a 10-step loop inside
``lax.scan`` with a fixed fake model; img2img's noising; and one-line errors for what is not
supported."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.diffusion import schedulers as S
from hypertron.diffusion.errors import DiffusionError

torch = pytest.importorskip("torch")


class _Diffusers:
    """diffusers' schedulers, imported at first use: the import costs seconds of CPU (it pulls in
    torch._dynamo), and every xdist worker collects this module, most never running it."""

    def __getattr__(self, name):
        if name.startswith("_"):  # pytest's collection asks each module attribute for __test__, _pytestfixturefunction...
            raise AttributeError(name)
        return getattr(pytest.importorskip("diffusers.schedulers"), name)


diffusers_schedulers = _Diffusers()

SD = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
# Stable Diffusion 1.5's scheduler_config.json (a PNDM config: DDIM reads its options, ignores the rest)
SD15 = {"_class_name": "PNDMScheduler", **SD, "num_train_timesteps": 1000, "set_alpha_to_one": False,
        "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None, "clip_sample": False}
SDXL = {**SD, "timestep_spacing": "leading", "steps_offset": 1, "interpolation_type": "linear",
        "use_karras_sigmas": False, "clip_sample": False, "sample_max_value": 1.0}
FLUX = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
        "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}
FLUX_SIGMAS = "flux"  # FluxPipeline's own sigmas, linspace(1, 1 / steps, steps)

# name: (class, config, image_seq_len, sigmas)
CASES = {
    "ddim-sd15": (S.DDIM, SD15, None, None),
    "ddim-trailing-zero-snr-v": (S.DDIM, {"timestep_spacing": "trailing", "rescale_betas_zero_snr": True,
                                          "prediction_type": "v_prediction"}, None, None),
    "ddim-linspace-cosine": (S.DDIM, {"beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "linspace"},
                             None, None),
    "euler-linspace": (S.EULER, SD, None, None),
    "euler-sdxl": (S.EULER, SDXL, None, None),
    "euler-trailing-zero-snr": (S.EULER, {**SD, "timestep_spacing": "trailing",
                                          "rescale_betas_zero_snr": True}, None, None),
    "euler-karras": (S.EULER, {**SD, "use_karras_sigmas": True}, None, None),
    "euler-karras-bounds": (S.EULER, {**SD, "use_karras_sigmas": True, "sigma_min": 0.1, "sigma_max": 10.0},
                            None, None),
    "euler-a-sdxl": (S.EULER_A, SDXL, None, None),
    "dpm-linspace": (S.DPM, SD, None, None),
    "dpm-leading": (S.DPM, {**SD, "timestep_spacing": "leading", "steps_offset": 1}, None, None),
    "dpm-trailing": (S.DPM, {"timestep_spacing": "trailing"}, None, None),
    "dpm-karras": (S.DPM, {**SD, "use_karras_sigmas": True}, None, None),
    "dpm-karras-cosine": (S.DPM, {"beta_schedule": "squaredcos_cap_v2", "use_karras_sigmas": True}, None,
                          None),
    "flow-sd3": (S.FLOW, {"shift": 3.0}, None, None),
    "flow-flux": (S.FLOW, FLUX, 1024, FLUX_SIGMAS),
    "flow-dynamic": (S.FLOW, {**FLUX, "max_image_seq_len": 8192}, 4096, None),
    "flow-karras": (S.FLOW, {"shift": 3.0, "use_karras_sigmas": True}, None, None),
}


def _flux_mu(cfg: dict, image_seq_len: int) -> float:
    """diffusers.pipelines.flux.pipeline_flux.calculate_shift, copied: importing it imports
    transformers' models (15 s)."""
    m = (cfg["max_shift"] - cfg["base_shift"]) / (cfg["max_image_seq_len"] - cfg["base_image_seq_len"])
    return image_seq_len * m + cfg["base_shift"] - m * cfg["base_image_seq_len"]


def _both(case: tuple, steps: int):
    """(hypertron's schedule, diffusers' scheduler after set_timesteps) for a case of CASES."""
    cls, config, seq_len, sigmas = case
    sigmas = np.linspace(1.0, 1 / steps, steps) if sigmas == FLUX_SIGMAS else None
    ours = S.make_schedule(S.parse_config(config, class_name=cls), steps, image_seq_len=seq_len,
                           sigmas=sigmas)
    theirs = getattr(diffusers_schedulers, cls).from_config(config)
    kwargs = {}
    if sigmas is not None:
        kwargs["sigmas"] = sigmas
    if seq_len is not None:
        kwargs["mu"] = _flux_mu(config, seq_len)
    theirs.set_timesteps(None if sigmas is not None else steps, **kwargs)
    return ours, theirs


def _close(ours, theirs, tol, what):
    np.testing.assert_allclose(np.asarray(ours, np.float64), np.asarray(theirs, np.float64),
                               rtol=tol, atol=tol, err_msg=what)


@pytest.mark.parametrize("name", CASES)
def test_schedule_equals_diffusers(name):
    for steps in (1, 4, 10, 50):
        ours, theirs = _both(CASES[name], steps)
        assert ours.num_steps == len(theirs.timesteps)
        _close(ours.timesteps, theirs.timesteps.numpy(), 1e-6, f"timesteps, {steps} steps")
        if ours.sigmas is not None:
            _close(ours.sigmas, theirs.sigmas.numpy(), 1e-6, f"sigmas, {steps} steps")
        init = float(getattr(theirs, "init_noise_sigma", 1.0))  # flow matching has none
        _close(ours.init_noise_sigma, init, 1e-6, f"init_noise_sigma, {steps} steps")


def _generator(theirs, generator) -> dict:
    """``step``'s generator argument, for the one scheduler that draws noise."""
    draws = isinstance(theirs, diffusers_schedulers.EulerAncestralDiscreteScheduler)
    return {"generator": generator} if draws else {}


def _diffusers_step(theirs, out, i, x, generator):
    t = theirs.timesteps[i]
    prev = theirs.step(torch.from_numpy(out), t, torch.from_numpy(x), **_generator(theirs, generator))
    return prev.prev_sample.numpy()


STEP_CASES = [(S.DDIM, p, clip) for p in ("epsilon", "v_prediction", "sample") for clip in (False, True)]
STEP_CASES += [(k, p, False) for k in (S.EULER, S.DPM) for p in ("epsilon", "v_prediction", "sample")]
STEP_CASES += [(S.EULER_A, "epsilon", False), (S.EULER_A, "v_prediction", False), (S.FLOW, None, False)]


@pytest.mark.parametrize("cls, prediction, clip", STEP_CASES)
def test_two_steps_equal_diffusers(cls, prediction, clip):
    """Steps 2 and 3 of 10 (DPM-Solver's first-order start, then its second-order update); Euler
    ancestral draws diffusers' generator's noise."""
    config = {**SD, "prediction_type": prediction, "clip_sample": clip} if prediction else {"shift": 3.0}
    ours = S.make_schedule(S.parse_config(config, class_name=cls), 10)
    theirs = getattr(diffusers_schedulers, cls).from_config(config)
    theirs.set_timesteps(10)
    if hasattr(theirs, "set_begin_index"):
        theirs.set_begin_index(2)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 4, 3, 3)) * 3).astype(np.float32)
    noise_gen, generator = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    state = ours.init_state(jnp.asarray(x))
    for i in (2, 3):
        out = rng.standard_normal(x.shape).astype(np.float32)
        noise = torch.randn(x.shape, generator=noise_gen, dtype=torch.float32).numpy()
        expected = _diffusers_step(theirs, out, i, x, generator)
        state, prev = ours.step(state, jnp.asarray(out), i, jnp.asarray(x), jnp.asarray(noise))
        _close(prev, expected, 1e-5, f"step {i}")
        x = expected


def _fake_model(x, t, cos):
    """A fixed stand-in for the denoiser, the same in torch and JAX."""
    return 0.1 * x + 0.05 * cos(t / 300.0)


@jax.jit
def _sample(schedule: S.Schedule, latents, noise):
    """The sampling loop as a pipeline writes it: one scan over the steps."""
    def body(carry, i):
        state, x = carry
        out = _fake_model(schedule.scale_model_input(x, i), schedule.timesteps[i], jnp.cos)
        return schedule.step(state, out, i, x, noise[i]), None

    x = latents * schedule.init_noise_sigma
    (_, x), _ = jax.lax.scan(body, (schedule.init_state(x), x), jnp.arange(schedule.num_steps))
    return x


_PROGRAMS: set = set()
LOOP_CASES = {name: CASES[name] for name in (
    "ddim-sd15", "ddim-trailing-zero-snr-v", "euler-sdxl", "euler-karras", "euler-trailing-zero-snr",
    "euler-a-sdxl", "dpm-linspace", "flow-flux")}
LOOP_CASES["dpm-karras-order-1-v"] = (S.DPM, {**SD, "use_karras_sigmas": True, "solver_order": 1,
                                              "prediction_type": "v_prediction"}, None, None)


@pytest.mark.parametrize("name", LOOP_CASES)
def test_ten_step_loop_in_scan_equals_diffusers(name):
    """The whole loop, compiled once per scheduler kind (a schedule is an argument of the jitted
    loop, so the cases of one kind share a program): SD 1.5's DDIM (its last step to alpha_bar[0]) and
    a zero-terminal-SNR one (v-prediction, clipped, its last step to alpha_bar = 1); Euler in SDXL's config,
    with Karras sigmas and with a zero terminal SNR; Euler ancestral; DPM-Solver++ 2M and order 1
    (v-prediction, Karras); Flux's flow matching."""
    ours, theirs = _both(LOOP_CASES[name], 10)
    latents = np.random.default_rng(0).standard_normal((1, 4, 4, 4)).astype(np.float32)
    generator, noise_gen = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    # Euler ancestral's draws, one per step in diffusers' order (the others ignore them)
    noise = np.stack([torch.randn(latents.shape, generator=noise_gen).numpy() for _ in range(10)])
    x = torch.from_numpy(latents) * getattr(theirs, "init_noise_sigma", 1.0)
    for t in theirs.timesteps:
        out = _fake_model(theirs.scale_model_input(x, t) if hasattr(theirs, "scale_model_input") else x,
                          t.to(torch.float32), torch.cos)
        x = theirs.step(out, t, x, **_generator(theirs, generator)).prev_sample
    _close(_sample(ours, jnp.asarray(latents), jnp.asarray(noise)), x.numpy(), 1e-5, name)
    _PROGRAMS.add(jax.tree.structure(ours))  # the scheduler's kind, and DDIM's clipping
    assert _sample._cache_size() <= len(_PROGRAMS)  # one compiled loop for each


@pytest.mark.parametrize("name", ["ddim-sd15", "euler-sdxl", "dpm-karras", "flow-flux"])
def test_add_noise_equals_diffusers(name):
    ours, theirs = _both(CASES[name], 10)
    rng = np.random.default_rng(0)
    x, noise = (rng.standard_normal((1, 4, 2, 2)).astype(np.float32) for _ in range(2))
    t = theirs.timesteps[3:4]
    noised = (theirs.scale_noise if name.startswith("flow") else theirs.add_noise)
    expected = noised(torch.from_numpy(x), t, torch.from_numpy(noise)) if name.startswith("flow") else \
        noised(torch.from_numpy(x), torch.from_numpy(noise), t)
    _close(ours.add_noise(jnp.asarray(x), jnp.asarray(noise), 3), expected.numpy(), 1e-6, name)


@pytest.mark.parametrize("config, class_name, message", [
    ({"_class_name": "PNDMScheduler"}, None, "class 'PNDMScheduler' is not supported (supported: DDIMSch"),
    ({"_class_name": S.DDIM, "thresholding": True}, None, "DDIMScheduler: thresholding=True is not supp"),
    ({"trained_betas": [0.01] * 1000}, S.EULER, "trained_betas=[0.01, 0.01, 0.01, "),
    ({"algorithm_type": "sde-dpmsolver++"}, S.DPM, "algorithm_type='sde-dpmsolver++' is not supported"),
    ({"solver_order": 3}, S.DPM, "solver_order=3 is not supported (supported: 1, 2)"),
    ({"prediction_type": "flow_prediction"}, S.DPM, "prediction_type='flow_prediction' is not supported"),
    ({"timestep_spacing": "even\nlater"}, S.EULER, "timestep_spacing='even\\nlater' is not supported"),
    ({"prediction_type": "sample"}, S.EULER_A, "prediction_type='sample' is not supported"),
    ({"beta_start": "0.1"}, S.EULER, "beta_start: expected a number, got '0.1'"),
    ({"num_train_timesteps": 0}, S.DDIM, "num_train_timesteps: 0 must be above 0"),
    ({"use_karras_sigmas": 1}, S.EULER, "use_karras_sigmas=1 must be true or false"),
    ({"shift": float("nan")}, S.FLOW, "shift: nan is not a finite number"),
    ({"steps_offset": -1}, S.DDIM, "steps_offset: -1 is below 0"),
    ({"stochastic_sampling": True}, S.FLOW, "stochastic_sampling=True is not supported (only False)"),
    ([], S.FLOW, "must be a JSON object"),
])
def test_unsupported_config_is_one_line_naming_the_key(config, class_name, message):
    with pytest.raises(DiffusionError) as error:
        S.parse_config(config, source="scheduler/scheduler_config.json", class_name=class_name)
    assert str(error.value).startswith("scheduler/scheduler_config.json: ") and message in str(error.value)
    assert "\n" not in str(error.value) and len(str(error.value)) < 300


def test_bad_steps_and_missing_sequence_length_are_one_line():
    euler = S.parse_config({}, class_name=S.EULER)
    for steps, message in ((0, "steps=0: must be an integer of at least 1"), (1001, "steps=1001: more than")):
        with pytest.raises(DiffusionError, match=message):
            S.make_schedule(euler, steps)
    with pytest.raises(DiffusionError, match="use_dynamic_shifting needs the image's sequence length"):
        S.make_schedule(S.parse_config(FLUX, class_name=S.FLOW), 4)
