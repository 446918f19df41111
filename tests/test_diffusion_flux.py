"""hypertron's FluxTransformer2DModel against diffusers 0.42.1's, float32 on CPU: tiny random models
written with ``save_pretrained`` (with and without guidance embedding), the prediction for a batch of
four with distinct timesteps, guidance, prompts and pooled embeddings within 1e-4, and the same placed
on (data=2, fsdp=2, tensor=2) within 1e-5; FluxPipeline's 2x2 packing and position ids; one-line
errors for a missing tensor and unsupported config values."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from hypertron.diffusion import flux as F
from hypertron.diffusion.errors import DiffusionError
from hypertron.models.params import logical_axes
from hypertron.parallel.rules import shardings_for, use_rules
from support.diffusion_models import perturbed_folders, refuses_missing_tensor

torch = pytest.importorskip("torch")

# Two double and two single blocks (the scans' carries cross a layer boundary), two heads of 16
# channels, RoPE axes of unequal widths.
TINY = {"patch_size": 1, "in_channels": 16, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 16,
        "axes_dims_rope": [4, 6, 6]}
CONFIGS = {"dev": {"guidance_embeds": True}, "schnell": {"guidance_embeds": False}}
LATENT_HW = (8, 6)  # latents [b, 4, 8, 6]: 12 packed tokens of a 4x3 patch grid
TEXT_TOKENS = 5
BATCH = 4  # rows over data x fsdp on the (2, 2, 2) mesh: the layout where XLA needed the AdaLN pinned


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: (folder, diffusers model)}."""
    return perturbed_folders(tmp_path_factory, "FluxTransformer2DModel", TINY, CONFIGS, "flux")


@functools.partial(jax.jit, static_argnums=1)
def _apply(params, cfg, latents, timesteps, context, pooled, guidance, img_ids, txt_ids):
    return F.apply(params, cfg, latents, timesteps, context, pooled, guidance, img_ids, txt_ids)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prediction_matches_diffusers(folders, name):
    folder, model = folders[name]
    cfg, params = F.load_flux(folder)
    assert cfg.guidance_embeds == (name == "dev") and cfg.width == 32 and cfg.axes_dims_rope == (4, 6, 6)
    rng = np.random.default_rng(0)
    h, w = LATENT_HW
    latents = F.pack_latents(rng.normal(size=(BATCH, 4, h, w)).astype(np.float32))
    context = rng.normal(size=(BATCH, TEXT_TOKENS, 32)).astype(np.float32)
    pooled = rng.normal(size=(BATCH, 16)).astype(np.float32)
    timesteps = np.array([0.93, 0.41, 0.07, 1.0], np.float32)  # as FluxPipeline passes them: t / 1000
    guidance = np.array([3.5, 1.25, 7.0, 0.0], np.float32) if cfg.guidance_embeds else None
    img_ids, txt_ids = F.latent_image_ids(h // 2, w // 2), F.text_ids(TEXT_TOKENS)
    with torch.no_grad():
        want = model(hidden_states=torch.from_numpy(latents), encoder_hidden_states=torch.from_numpy(context),
                     pooled_projections=torch.from_numpy(pooled), timestep=torch.from_numpy(timesteps),
                     img_ids=torch.from_numpy(img_ids), txt_ids=torch.from_numpy(txt_ids),
                     guidance=None if guidance is None else torch.from_numpy(guidance)).sample.numpy()
    got = np.asarray(_apply(params, cfg, latents, timesteps, context, pooled, guidance, img_ids, txt_ids))
    assert got.shape == want.shape == (BATCH, (h // 2) * (w // 2), 16)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # the rows differ (timestep, guidance, prompt): a batch mix-up would not pass
    assert np.abs(want[0] - want[1]).max() > 1e-2
    if name == "dev":  # placed by the rules on (data=2, fsdp=2, tensor=2), activations pinned: the same numbers
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
        placed = jax.device_put(params, shardings_for(logical_axes(F.declare_flux(cfg)), params, mesh))
        assert placed["double"]["img"]["q"]["w"].sharding.spec == P(None, "fsdp", "tensor", None)
        with use_rules(mesh):
            sharded = _apply(placed, cfg, latents, timesteps, context, pooled, guidance, img_ids, txt_ids)
        np.testing.assert_allclose(np.asarray(sharded), got, atol=1e-5, rtol=0)


def test_packing_and_ids_match_the_pipeline():
    from diffusers import FluxPipeline

    latents = np.random.default_rng(1).normal(size=(2, 4, 6, 10)).astype(np.float32)
    want = FluxPipeline._pack_latents(torch.from_numpy(latents), 2, 4, 6, 10).numpy()
    packed = F.pack_latents(latents)
    np.testing.assert_array_equal(packed, want)
    vae_scale = 8  # _unpack_latents takes the image size
    np.testing.assert_array_equal(F.unpack_latents(packed, 6, 10),
                                  FluxPipeline._unpack_latents(torch.from_numpy(want), 48, 80, vae_scale).numpy())
    np.testing.assert_array_equal(F.unpack_latents(packed, 6, 10), latents)
    np.testing.assert_array_equal(np.asarray(F.pack_latents(jax.numpy.asarray(latents))), want)
    ids = FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32).numpy()
    np.testing.assert_array_equal(F.latent_image_ids(3, 5), ids)
    assert F.latent_image_ids(3, 5).dtype == np.float32
    assert F.text_ids(7).shape == (7, 3) and not F.text_ids(7).any()


def test_traced_ids_give_the_host_rope():
    ids = np.concatenate([F.text_ids(3), F.latent_image_ids(5, 7)])
    host = F.rope(ids, (4, 6, 6))
    traced = jax.jit(lambda i: F.rope(i, (4, 6, 6)))(ids)
    for a, b in zip(host, traced):
        np.testing.assert_allclose(np.asarray(b), a, atol=1e-6)


def test_a_missing_tensor_and_unsupported_values_are_one_line(folders, tmp_path):
    folder = refuses_missing_tensor(folders["dev"][0], tmp_path / "transformer",
                                    "single_transformer_blocks.1.attn.norm_k.weight", F.load_flux)

    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    for key, value, reason in [("patch_size", 2, "is not supported (supported: 1)"),
                               ("axes_dims_rope", [4, 6, 8], "summing to attention_head_dim=16"),
                               ("guidance_embeds", "yes", "must be true or false")]:
        config_file.write_text(json.dumps(config | {key: value}))
        with pytest.raises(DiffusionError) as e:
            F.load_flux(folder)
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"{config_file}: {key}=") and reason in message
