"""LoRA on a diffusion denoiser (issue 44): adapters of a tiny SD UNet's attention, saved in
diffusers' file, load into diffusers' ``StableDiffusionPipeline`` with ``load_lora_weights`` and
give our UNet's output, through the einsum hook (training's path) and merged (``hypertron
diffuse --lora``'s); the file diffusers writes back reads as the same adapters; targets that match
no module are one line."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hypertron.config import ConfigError
from hypertron.diffusion import lora as DL
from hypertron.diffusion import unet as U
from hypertron.diffusion.pipeline import load_pipeline
from hypertron.models import lora as L
from support.diffusion_folders import tiny_sd  # tests/support


def test_our_lora_file_loads_into_diffusers_and_gives_our_unet_output(tmp_path):
    torch = pytest.importorskip("torch")
    peft_utils = pytest.importorskip("peft.utils")
    folder, pipe = tiny_sd(tmp_path)
    cfg, params = U.load_unet(folder / "unet")
    specs = U.declare_unet(cfg)
    settings = L.LoraSettings(rank=4, alpha=8.0, targets=(*DL.UNET_TARGETS, "ff.net.0.proj", "ff.net.2"))
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda a: (0.2 * rng.normal(size=a.shape)).astype(np.float32),  # B not zero
                            jax.eval_shape(lambda: L.init_adapters(specs, settings, jax.random.key(0))))
    DL.save_lora(tmp_path / "lora", adapters, settings, specs, "unet")

    pipe.load_lora_weights(str(tmp_path / "lora"))
    x = rng.normal(size=(2, 8, 8, 4)).astype(np.float32)
    t = np.array([3, 700], np.int32)
    context = rng.normal(size=(2, 5, 32)).astype(np.float32)
    with torch.no_grad():
        want = pipe.unet(torch.from_numpy(x).permute(0, 3, 1, 2), torch.from_numpy(t),
                         encoder_hidden_states=torch.from_numpy(context)).sample.permute(0, 2, 3, 1).numpy()
        pipe.disable_lora()
        base = pipe.unet(torch.from_numpy(x).permute(0, 3, 1, 2), torch.from_numpy(t),
                         encoder_hidden_states=torch.from_numpy(context)).sample.permute(0, 2, 3, 1).numpy()
        pipe.enable_lora()
    hooked, merged = jax.jit(lambda p, a: [U.apply(f(p, a, settings), cfg, x, t, context)
                                           for f in (L.attach, L.merge)])(params, adapters)
    scale = np.abs(want).max()
    assert np.abs(base - want).max() > 0.05 * scale  # the adapters change the output
    np.testing.assert_allclose(np.asarray(hooked), want, atol=1e-4 * scale, rtol=0)
    np.testing.assert_allclose(np.asarray(merged), want, atol=1e-4 * scale, rtol=0)

    # hypertron diffuse --lora FILE:0.5 merges half of it into the loaded pipeline's denoiser.
    half = DL.with_lora(load_pipeline(folder), tmp_path / "lora" / DL.LORA_FILE, 0.5).denoiser_params
    want_half = L.merge(params, adapters, L.LoraSettings(rank=4, alpha=4.0, targets=settings.targets))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6), half, want_half)

    # What diffusers writes of the adapters it loaded reads back as ours.
    name, config = next(iter(pipe.unet.peft_config.items()))
    pipe.save_lora_weights(str(tmp_path / "theirs"), unet_lora_adapter_metadata=config.to_dict(),
                           unet_lora_layers=peft_utils.get_peft_model_state_dict(pipe.unet, adapter_name=name))
    read, read_settings = DL.load_lora(tmp_path / "theirs", specs, "unet")
    assert (read_settings.rank, read_settings.alpha) == (4, 8.0)
    assert set(read_settings.targets) == set(settings.targets)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7), read, adapters)


def test_targets_that_match_no_module_and_other_components_are_one_line(tmp_path):
    cfg = U.unet_config({"block_out_channels": [32, 64], "layers_per_block": 1, "cross_attention_dim": 32,
                         "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
                         "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "attention_head_dim": 8,
                         "norm_num_groups": 8, "sample_size": 8}, "test")
    specs = U.declare_unet(cfg)
    with pytest.raises(ConfigError, match=r"the denoiser has no q_proj to adapt \(its projections: .*to_out.0"):
        L.targets(specs, ("q_proj",))
    from safetensors.numpy import save_file

    save_file({"text_encoder.x.lora_A.weight": np.zeros((4, 8), np.float32)}, tmp_path / DL.LORA_FILE)
    with pytest.raises(ConfigError, match="text_encoder.x.lora_A.weight is not the unet's"):
        DL.load_lora(tmp_path, specs, "unet")
