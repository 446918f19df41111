"""Diffusion training's objectives, timestep samplers, loss weights and EMA against diffusers 0.42.1
(torch): ``DDPMScheduler.add_noise`` / ``get_velocity``, ``compute_snr`` with ``train_text_to_image.py``'s
min-SNR weights, ``FlowMatchEulerDiscreteScheduler``'s training sigmas, ``compute_density_for_timestep_sampling``,
``compute_loss_weighting_for_sd3`` and ``EMAModel``. No model: seconds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler  # noqa: E402
from diffusers.training_utils import (  # noqa: E402
    EMAModel,
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
    compute_snr,
)

from hypertron.config import EmaConfig  # noqa: E402
from hypertron.diffusion import objectives as O  # noqa: E402
from hypertron.diffusion.errors import DiffusionError  # noqa: E402
from hypertron.diffusion.schedulers import parse_config  # noqa: E402
from hypertron.train import ema  # noqa: E402

SD = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
B = 6


def _close(got, want, tol):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=tol, atol=tol)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((B, 4, 4, 3)).astype(np.float32)  # channels last
    noise = rng.standard_normal((B, 4, 4, 3)).astype(np.float32)
    return x0, noise


def _nchw(x):
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, -1, 1)))


@pytest.mark.parametrize("beta_schedule", ["scaled_linear", "linear", "squaredcos_cap_v2"])
def test_noise_velocity_and_min_snr_weights_equal_ddpm_and_train_text_to_image(beta_schedule):
    config = {**SD, "beta_schedule": beta_schedule}
    theirs = DDPMScheduler(**config)
    ours_cfg = parse_config(config, class_name="DDIMScheduler")
    x0, noise = _batch()
    t = np.array([0, 1, 250, 500, 998, 999], np.int64)
    t_torch = torch.from_numpy(t)
    for objective in ("epsilon", "v_prediction"):
        sched = O.training_schedule(ours_cfg, objective)
        idx = jnp.asarray(t, jnp.int32)
        _close(np.moveaxis(O.add_noise(sched, x0, noise, idx), -1, 1),
               theirs.add_noise(_nchw(x0), _nchw(noise), t_torch), 1e-6)
        want_target = _nchw(noise) if objective == "epsilon" else theirs.get_velocity(_nchw(x0), _nchw(noise), t_torch)
        _close(np.moveaxis(O.target(sched, x0, noise, idx), -1, 1), want_target, 1e-6)
        snr = compute_snr(theirs, t_torch)
        _close(O.snr(sched, idx), snr, 1e-5)
        gamma = 5.0  # train_text_to_image.py with --snr_gamma 5
        weights = torch.stack([snr, gamma * torch.ones_like(t_torch)], dim=1).min(dim=1)[0]
        weights = weights / snr if objective == "epsilon" else weights / (snr + 1)
        _close(O.loss_weights(sched, idx, "min_snr", snr_gamma=gamma), weights, 1e-5)
        _close(O.loss_weights(sched, idx, "none"), np.ones(B), 0)


def test_the_weighted_loss_is_the_scripts_per_example_mean_times_its_weight():
    x0, noise = _batch(1)
    pred = np.random.default_rng(2).standard_normal(x0.shape).astype(np.float32)
    w = np.linspace(0.5, 2.0, B).astype(np.float32)
    loss = torch.nn.functional.mse_loss(torch.from_numpy(pred), torch.from_numpy(noise), reduction="none")
    want = (loss.mean(dim=list(range(1, loss.ndim))) * torch.from_numpy(w)).mean()
    _close(O.weighted_mse(pred, noise, jnp.asarray(w)), want, 1e-6)


@pytest.mark.parametrize("shift, dynamic", [(1.0, False), (3.0, False), (3.0, True)])
def test_flow_sigmas_noise_target_and_sd3_weights_equal_diffusers(shift, dynamic):
    theirs = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift, use_dynamic_shifting=dynamic)
    ours_cfg = parse_config({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": shift,
                             "use_dynamic_shifting": dynamic})
    sched = O.training_schedule(ours_cfg, "flow")
    _close(sched.s, theirs.sigmas, 1e-6)
    _close(sched.timesteps, theirs.timesteps, 1e-6)
    if dynamic:  # SD3's training shift asked for explicitly shifts a dynamic scheduler's sigmas too
        shifted = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
        _close(O.training_schedule(ours_cfg, "flow", shift=3.0).s, shifted.sigmas, 1e-6)
    x0, noise = _batch(3)
    idx = np.array([0, 1, 10, 500, 998, 999])
    sigma = theirs.sigmas[idx].reshape(-1, 1, 1, 1)  # the Flux / SD3 scripts' noisy input and target
    _close(np.moveaxis(O.add_noise(sched, x0, noise, jnp.asarray(idx)), -1, 1),
           (1.0 - sigma) * _nchw(x0) + sigma * _nchw(noise), 1e-6)
    _close(O.target(sched, x0, noise, jnp.asarray(idx)), noise - x0, 0)
    for scheme in ("sigma_sqrt", "cosmap", "none"):
        _close(O.loss_weights(sched, jnp.asarray(idx), scheme),
               compute_loss_weighting_for_sd3(scheme, theirs.sigmas[idx]), 1e-5)


def test_dynamic_shift_is_flux_pipelines_calculate_shift_and_time_shift():
    """``diffusion.dynamic_shift``: the training sigmas shifted by ``exp(mu)``, ``mu`` FluxPipeline's
    ``calculate_shift`` of the latents' packed tokens (4,096 at 1024 x 1024: 128 x 128 latents in 2 x 2
    patches), equal the scheduler's ``time_shift(mu, 1, sigma)`` (1e-6); the task takes that count."""
    import types

    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from hypertron.config import load_config
    from hypertron.diffusion.pipeline import FLUX
    from hypertron.diffusion.schedulers import dynamic_shift
    from hypertron.train.diffusion_task import training_shift

    config = {"shift": 3.0, "use_dynamic_shifting": True, "base_image_seq_len": 256, "max_image_seq_len": 4096,
              "base_shift": 0.5, "max_shift": 1.15}
    theirs = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **config)
    ours_cfg = parse_config({"_class_name": "FlowMatchEulerDiscreteScheduler", **config})
    for tokens in (256, 1024, 4096):
        mu = calculate_shift(tokens, 256, 4096, 0.5, 1.15)
        want = theirs.time_shift(mu, 1.0, theirs.sigmas)
        _close(O.training_schedule(ours_cfg, "flow", shift=dynamic_shift(ours_cfg, tokens)).s, want, 1e-6)
    spec = types.SimpleNamespace(class_name=FLUX, vae_scale_factor=8, scheduler=ours_cfg)
    cfg = load_config(None, ["task=diffusion", "data.source=imagefolder", "data.paths=[x]", "diffusion.dynamic_shift=true"])
    assert training_shift(cfg, spec, 1024) == pytest.approx(np.exp(calculate_shift(4096, 256, 4096, 0.5, 1.15)))


@pytest.mark.parametrize("sampler", ["logit_normal", "mode", "uniform"])
def test_timestep_samplers_give_compute_density_for_timestep_sampling_s_indices(sampler):
    """From the same draws (torch's generator, read back), the same ``u`` and the same schedule
    indices ``(u * T).long()`` as diffusers' SD3 and Flux scripts take."""
    n, settings = 4096, {"logit_mean": 0.3, "logit_std": 1.2, "mode_scale": 1.29}
    u_torch = compute_density_for_timestep_sampling(sampler, n, generator=torch.Generator().manual_seed(7), **settings)
    gen = torch.Generator().manual_seed(7)
    if sampler == "logit_normal":
        draws = torch.normal(mean=0.0, std=1.0, size=(n,), generator=gen)
    else:
        draws = torch.rand(size=(n,), generator=gen)
    u = O.u_from_draws(sampler, jnp.asarray(draws.numpy()), **settings)
    _close(u, u_torch, 1e-6)
    want = (u_torch * 1000).long().clamp(max=999).numpy()
    assert (np.asarray(O.indices_from_u(u, 1000)) == want).mean() > 0.999  # a u at an index's edge may round apart
    drawn = O.draw(jax.random.key(0), n, O.TrainingSchedule("flow", *(np.zeros(1000, np.float32),) * 3), sampler,
                   **settings)
    assert drawn.dtype == jnp.int32 and int(drawn.min()) >= 0 and int(drawn.max()) <= 999


def test_offset_noise_adds_one_draw_per_example_and_channel():
    noise = jnp.zeros((2, 3, 3, 4))
    got = O.offset_noise(jax.random.key(1), noise, 0.1)
    assert np.ptp(np.asarray(got), axis=(1, 2)).max() == 0  # constant over the image
    assert np.asarray(got)[:, 0, 0].std() > 0
    assert O.offset_noise(jax.random.key(1), noise, 0.0) is noise


def test_bad_objectives_and_weightings_are_one_line():
    flow = parse_config({"_class_name": "FlowMatchEulerDiscreteScheduler"})
    ddim = parse_config(SD, class_name="DDIMScheduler")
    for call, words in [
        (lambda: O.training_schedule(flow, "epsilon"), "objective epsilon does not fit the model's FlowMatch"),
        (lambda: O.training_schedule(ddim, "flow"), "objective flow does not fit the model's DDIMScheduler"),
        (lambda: O.training_schedule(ddim, "x0"), "objective must be one of epsilon, v_prediction, flow"),
        (lambda: O.training_schedule(ddim, "epsilon", shift=3.0), "a shift applies to the flow objective only"),
        (lambda: O.check_weighting("min_snr", "flow"), "weighting min_snr does not fit objective flow"),
        (lambda: O.check_weighting("cosmap", "epsilon"), "weighting cosmap does not fit objective epsilon"),
        (lambda: O.u_from_draws("beta", jnp.zeros(2)), "timesteps must be one of uniform, logit_normal, mode"),
    ]:
        with pytest.raises(DiffusionError) as e:
            call()
        assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("config", [
    EmaConfig(decay=0.9),
    EmaConfig(decay=0.999, update_after_step=2, min_decay=0.3),
    EmaConfig(decay=0.9999, warmup=True, inv_gamma=1.0, power=3 / 4),
    EmaConfig(decay=0.5, warmup=True, inv_gamma=2.0, power=2 / 3, update_after_step=1),
])
def test_ema_follows_emamodel_over_five_updates(config):
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (5,)]
    theirs_params = [torch.nn.Parameter(torch.from_numpy(rng.standard_normal(s).astype(np.float32))) for s in shapes]
    theirs = EMAModel(theirs_params, decay=config.decay, min_decay=config.min_decay,
                      update_after_step=config.update_after_step, use_ema_warmup=config.warmup,
                      inv_gamma=config.inv_gamma, power=config.power)
    ours = ema.init([jnp.asarray(p.detach().numpy()) for p in theirs_params])
    update = jax.jit(ema.update)
    for n in range(1, 6):
        with torch.no_grad():
            for p in theirs_params:
                p.add_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32)))
        theirs.step(theirs_params)
        ours = update(ours, [jnp.asarray(p.detach().numpy()) for p in theirs_params], ema.rate(config, n))
        assert ema.decay(config, n) == theirs.cur_decay_value
        for got, want in zip(ours, theirs.shadow_params):
            _close(got, want.numpy(), 1e-7)
