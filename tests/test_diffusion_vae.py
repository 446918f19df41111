"""hypertron's AutoencoderKL against diffusers 0.42.1's, float32 on CPU: tiny random VAEs written with
``save_pretrained`` (SD-style with quant convs, Flux-style with a shift factor and none), encode's
mean and log variance and decode within 1e-4, the image processor's uint8 conversion, and one-line
errors for a missing tensor and an unsupported block type."""

from __future__ import annotations

import functools
import shutil

import jax
import numpy as np
import pytest

from hypertron.diffusion import vae as V
from hypertron.diffusion.errors import DiffusionError
from support.diffusion_models import perturbed_folders, refuses_block_type, refuses_missing_tensor

torch = pytest.importorskip("torch")

TINY = {"block_out_channels": [8, 16], "layers_per_block": 1, "norm_num_groups": 4, "latent_channels": 4,
        "sample_size": 32, "down_block_types": ["DownEncoderBlock2D"] * 2,
        "up_block_types": ["UpDecoderBlock2D"] * 2}
CONFIGS = {
    "sd": {"scaling_factor": 0.18215},
    "flux": {"scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
             "use_post_quant_conv": False, "latent_channels": 8},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: (folder, diffusers model)}."""
    return perturbed_folders(tmp_path_factory, "AutoencoderKL", TINY, CONFIGS, "vae")


@functools.partial(jax.jit, static_argnums=3)
def _encode_decode(params, images_bhwc, z_bhwc, cfg):
    """Both directions in one program: one compile per config (two cost ~1.5 s more CPU)."""
    return V.encode(params, cfg, images_bhwc), V.decode(params, cfg, z_bhwc)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_encode_and_decode_match_diffusers(folders, name):
    folder, model = folders[name]
    cfg, params = V.load_vae(folder)
    assert cfg.use_quant_conv == (name == "sd") and cfg.shift_factor == CONFIGS[name].get("shift_factor", 0.0)
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (2, 3, 32, 32)).astype(np.float32)
    latents = rng.normal(size=(2, cfg.latent_channels, 8, 8)).astype(np.float32)
    with torch.no_grad():
        dist = model.encode(torch.from_numpy(images)).latent_dist
        want_images = model.decode(torch.from_numpy(latents)).sample.numpy()
    (mean, logvar), decoded = _encode_decode(params, V.from_nchw(images), V.from_nchw(latents), cfg)
    np.testing.assert_allclose(V.to_nchw(np.asarray(mean)), dist.mean.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(V.to_nchw(np.asarray(logvar)), dist.logvar.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(V.to_nchw(np.asarray(decoded)), want_images, atol=1e-4, rtol=0)
    # the pipelines' scaling: decode(latents / scale + shift), and its inverse on an encoded mean
    z = V.latents_to_vae(cfg, latents)
    np.testing.assert_allclose(z, latents / cfg.scaling_factor + cfg.shift_factor, rtol=1e-6)
    np.testing.assert_allclose(V.vae_to_latents(cfg, z), latents, atol=1e-5)


def test_to_uint8_matches_the_image_processor():
    from diffusers.image_processor import VaeImageProcessor

    images = np.random.default_rng(1).uniform(-1.3, 1.3, (2, 3, 16, 16)).astype(np.float32)
    want = VaeImageProcessor().postprocess(torch.from_numpy(images), output_type="np")
    want = np.round(want * 255).astype(np.int16)
    got = np.asarray(V.to_uint8(V.from_nchw(images)))
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.abs(got.astype(np.int16) - want).max() <= 1


def test_a_missing_tensor_and_an_unsupported_block_are_one_line(folders, tmp_path):
    folder = refuses_missing_tensor(folders["sd"][0], tmp_path / "vae", "decoder.mid_block.attentions.0.to_k.bias",
                                    V.load_vae)
    refuses_block_type(folder, "down_block_types", 1, "AttnDownEncoderBlock2D", V.load_vae)

    bin_only = tmp_path / "bin-only"
    bin_only.mkdir()
    shutil.copy(folders["sd"][0] / "config.json", bin_only)
    (bin_only / "diffusion_pytorch_model.bin").write_bytes(b"")
    with pytest.raises(DiffusionError, match=r"only \.bin weights.*save the model as safetensors$"):
        V.load_vae(bin_only)


def test_the_conv_layout_round_trips():
    from hypertron.models import hf

    w_oihw = np.arange(5 * 3 * 2 * 2, dtype=np.float32).reshape(5, 3, 2, 2)
    ours = hf._ours_from_hf("conv", w_oihw, (2, 2, 3, 5))
    assert ours.shape == (2, 2, 3, 5) and ours[1, 0, 2, 4] == w_oihw[4, 2, 1, 0]
    assert hf._hf_shape("conv", ours.shape) == w_oihw.shape
    np.testing.assert_array_equal(hf._hf_from_ours("conv", ours), w_oihw)
