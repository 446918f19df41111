"""One diffusion training step against diffusers' recipe (``train_text_to_image.py`` with diffusers
0.42.1, torch): a tiny SD-shaped UNet from a folder built here, the same latents, text embeddings,
noise and timesteps; the loss within 1e-5 relative and every gradient within 1e-5 of its tensor's
largest magnitude, for epsilon, v-prediction and epsilon with min-SNR weights; one AdamW step after
it as ``torch.optim.AdamW``'s."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hypertron.diffusion import objectives as O
from hypertron.diffusion import unet as U
from hypertron.diffusion.schedulers import parse_config
from hypertron.models.hf import declared_to_hf
from hypertron.train.diffusion import draw_noise, unet_loss
from support.diffusion_models import perturbed_folders

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

SD_SCHEDULE = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
TINY = {"block_out_channels": [16, 32], "norm_num_groups": 4, "sample_size": 8, "layers_per_block": 1,
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "cross_attention_dim": 16, "attention_head_dim": 4}


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    folder, model = perturbed_folders(tmp_path_factory, "UNet2DConditionModel", TINY, {"sd": {}}, "unet")["sd"]
    return folder, model


def _diffusers_step(model, objective, snr_gamma, x0, noise, t, context):
    """``train_text_to_image.py``'s loss and the UNet's gradients (by state-dict name)."""
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr

    scheduler = DDPMScheduler(**SD_SCHEDULE, prediction_type=objective)
    model.zero_grad()
    noisy = scheduler.add_noise(x0, noise, t)
    pred = model(noisy, t, context).sample
    target = noise if objective == "epsilon" else scheduler.get_velocity(x0, noise, t)
    if snr_gamma is None:
        loss = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="mean")
    else:
        snr = compute_snr(scheduler, t)
        weights = torch.stack([snr, snr_gamma * torch.ones_like(t)], dim=1).min(dim=1)[0]
        weights = weights / snr if objective == "epsilon" else weights / (snr + 1)
        loss = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="none")
        loss = (loss.mean(dim=list(range(1, loss.ndim))) * weights).mean()
    loss.backward()
    return loss.item(), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("objective, snr_gamma", [("epsilon", None), ("v_prediction", None), ("epsilon", 5.0)])
def test_one_unet_step_equals_train_text_to_image(unet, objective, snr_gamma):
    folder, model = unet
    rng = np.random.default_rng(0)
    x0, noise = (rng.standard_normal((3, 4, 8, 8)).astype(np.float32) for _ in range(2))
    context = rng.standard_normal((3, 5, 16)).astype(np.float32)
    t = np.array([3, 400, 999])
    want_loss, want_grads = _diffusers_step(model, objective, snr_gamma,
                                            *map(torch.from_numpy, (x0, noise, t, context)))

    cfg, params = U.load_unet(folder)
    schedule = O.training_schedule(parse_config(SD_SCHEDULE, class_name="DDIMScheduler"), objective)
    batch = {"latents": x0.transpose(0, 2, 3, 1), "noise": noise.transpose(0, 2, 3, 1), "index": t.astype(np.int32),
             "context": context}
    weighting = "none" if snr_gamma is None else "min_snr"
    step = jax.value_and_grad(lambda p, b: unet_loss(p, cfg, schedule, b, weighting=weighting,
                                                     snr_gamma=snr_gamma or 5.0))
    lowered = jax.jit(step).lower(params, batch)
    loss, grads = lowered.compile({"xla_backend_optimization_level": 0})(params, batch)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    got = declared_to_hf(U.declare_unet(cfg), grads, "unet")
    assert got.keys() == want_grads.keys()
    for name, want in want_grads.items():
        scale = np.abs(want).max()
        assert np.abs(got[name] - want).max() <= 1e-5 * scale + 1e-12, name
    if objective == "epsilon" and snr_gamma is None:
        _adamw_step_equals_torchs(model, params, want_grads, cfg)


def _adamw_step_equals_torchs(model, params, torch_grads, cfg):
    """One step of the loop's optimiser (AdamW, clipping at norm 1, as the script's defaults) from
    torch's gradients (ours differ by up to 1e-5 of a tensor's largest, which moves Adam's step of an
    element whose gradient is near its epsilon) equals ``torch.optim.AdamW`` after
    ``clip_grad_norm_`` within 1e-6."""
    from hypertron.config import TrainConfig
    from hypertron.models.hf import params_from_hf
    from hypertron.train.optimizer import make_optimizer

    grads = params_from_hf(U.declare_unet(cfg), torch_grads, np.float32, "torch's gradients")

    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    want = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    with torch.no_grad():  # the module's model is the other cases' too
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    optimizer = make_optimizer(TrainConfig(lr=1e-3, warmup_steps=0, schedule="constant", b1=0.9, b2=0.999,
                                           eps=1e-8, weight_decay=1e-2, clip_norm=1.0))
    updates, _ = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
    got = declared_to_hf(U.declare_unet(cfg), jax.tree.map(lambda p, u: p + u, params, updates), "unet")
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, atol=1e-6, rtol=0, err_msg=name)


def test_a_steps_draws_follow_its_key_and_sampler():
    schedule = O.training_schedule(parse_config({"_class_name": "FlowMatchEulerDiscreteScheduler"}), "flow")
    latents = np.zeros((4, 2, 2, 3), np.float32)
    key = jax.random.fold_in(jax.random.key(0), 7)
    a, b = draw_noise(key, latents, schedule, "logit_normal"), draw_noise(key, latents, schedule, "logit_normal")
    assert all(np.array_equal(x, y) for x, y in zip(a, b))  # a resumed step draws the same
    other = draw_noise(jax.random.fold_in(jax.random.key(0), 8), latents, schedule, "logit_normal")
    assert not np.array_equal(a[0], other[0])
    assert a[0].shape == latents.shape and a[1].dtype == np.int32 and a[1].shape == (4,)


FLUX = {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 16,
        "axes_dims_rope": [4, 6, 6], "guidance_embeds": True}


def test_one_flux_step_equals_train_dreambooth_flux(tmp_path_factory):
    """The flow objective on a tiny Flux-dev transformer: ``train_dreambooth_flux.py``'s noisy input,
    packing, timestep / 1000, guidance, cosmap weights and loss; the loss within 1e-5 relative, every
    gradient within 2e-4 of its tensor's largest (not the UNet's 1e-5: the embedders take sines of
    timestep and guidance times 1000, thousands of radians, which XLA and torch reduce differently
    in float32; the forward pass agrees to 1e-4 for the same reason, tests/test_diffusion_flux.py)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    from hypertron.diffusion import flux as F
    from hypertron.train.diffusion import flux_loss

    folder, model = perturbed_folders(tmp_path_factory, "FluxTransformer2DModel", FLUX, {"dev": {}}, "flux")["dev"]
    rng = np.random.default_rng(0)
    b, h, w = 2, 4, 6
    x0, noise = (rng.standard_normal((b, 4, h, w)).astype(np.float32) for _ in range(2))
    context = rng.standard_normal((b, 5, 32)).astype(np.float32)
    pooled = rng.standard_normal((b, 16)).astype(np.float32)
    index = np.array([20, 870])
    img_ids, txt_ids = F.latent_image_ids(h // 2, w // 2), F.text_ids(5)
    guidance = np.full(b, 3.5, np.float32)

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    timesteps = scheduler.timesteps[torch.from_numpy(index)]
    sigmas = scheduler.sigmas[torch.from_numpy(index)].reshape(-1, 1, 1, 1)
    x0_t, noise_t = torch.from_numpy(x0), torch.from_numpy(noise)
    noisy = (1.0 - sigmas) * x0_t + sigmas * noise_t
    model.zero_grad()
    pred = model(hidden_states=FluxPipeline._pack_latents(noisy, b, 4, h, w), timestep=timesteps / 1000,
                 guidance=torch.from_numpy(guidance), pooled_projections=torch.from_numpy(pooled),
                 encoder_hidden_states=torch.from_numpy(context), txt_ids=torch.from_numpy(txt_ids),
                 img_ids=torch.from_numpy(img_ids)).sample
    pred = FluxPipeline._unpack_latents(pred, h * 8, w * 8, 8)
    weighting = compute_loss_weighting_for_sd3("cosmap", sigmas)
    target = noise_t - x0_t
    loss = torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(b, -1), 1).mean()
    loss.backward()
    want_grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}

    cfg, params = F.load_flux(folder)
    schedule = O.training_schedule(parse_config({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}),
                                   "flow")
    batch = {"latents": F.pack_latents(x0), "noise": F.pack_latents(noise), "index": index.astype(np.int32),
             "context": context, "pooled": pooled, "img_ids": img_ids, "txt_ids": txt_ids, "guidance": guidance}
    step = jax.value_and_grad(lambda p, bt: flux_loss(p, cfg, schedule, bt, weighting="cosmap"))
    got_loss, grads = jax.jit(step).lower(params, batch).compile({"xla_backend_optimization_level": 0})(params, batch)
    np.testing.assert_allclose(float(got_loss), loss.item(), rtol=1e-5)
    got = declared_to_hf(F.declare_flux(cfg), grads, "flux")
    assert got.keys() == want_grads.keys()
    for name, want in want_grads.items():  # 1.1e-4 at worst: the guidance embedder's first layer
        assert np.abs(got[name] - want).max() <= 2e-4 * np.abs(want).max() + 1e-12, name
