"""hypertron's UNet2DConditionModel against diffusers 0.42.1's, float32 on CPU: tiny random UNets
written with ``save_pretrained`` in the shapes of SD 1.x (conv projections, cross-attention and plain
blocks, two resnets per block), SD 2.x (linear projections, ``attention_head_dim`` a per-block list of
head counts, ``upcast_attention``, ``freq_shift``) and SDXL (``addition_embed_type="text_time"``,
``transformer_layers_per_block`` per block); a batch of 2 at different timesteps within 1e-4, and
one-line errors for an unsupported block type and a missing tensor."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from hypertron.diffusion import unet as U
from hypertron.diffusion.errors import DiffusionError
from support.diffusion_models import perturbed_folders, refuses_block_type, refuses_missing_tensor

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # tiny models: its thread pool spins for 10x the CPU of one thread (~6 s here)

TINY = {"block_out_channels": [16, 32], "norm_num_groups": 4, "sample_size": 8, "layers_per_block": 1}
CONFIGS = {
    "sd1": {"down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "layers_per_block": 2,
            "cross_attention_dim": 16, "attention_head_dim": 4},
    "sd2": {"down_block_types": ["CrossAttnDownBlock2D"] * 2, "up_block_types": ["CrossAttnUpBlock2D"] * 2,
            "cross_attention_dim": 24, "attention_head_dim": [2, 4], "use_linear_projection": True,
            "upcast_attention": True, "freq_shift": 1, "flip_sin_to_cos": False},
    "sdxl": {"down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
             "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "cross_attention_dim": 32,
             "attention_head_dim": [2, 4], "use_linear_projection": True, "transformer_layers_per_block": [1, 2],
             "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
             "projection_class_embeddings_input_dim": 12 + 6 * 8},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: (folder, diffusers model)}."""
    return perturbed_folders(tmp_path_factory, "UNet2DConditionModel", TINY, CONFIGS, "unet")


def _apply(params, cfg, *args):
    """``U.apply`` compiled with XLA's backend optimisation off: on this CPU the tiny UNets compile
    2-3x faster (8 s against 19 s for SD 2.x-tiny, 2 cores under load) and still match to 1e-4."""
    lowered = jax.jit(lambda p, *a: U.apply(p, cfg, *a)).lower(params, *args)
    return lowered.compile({"xla_backend_optimization_level": 0})(params, *args)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_unet_matches_diffusers(folders, name):
    folder, model = folders[name]
    cfg, params = U.load_unet(folder)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, 8, 8)).astype(np.float32)
    t = np.array([999.0, 37.0], np.float32)
    context = rng.normal(size=(2, 5, cfg.cross_attention_dim[0])).astype(np.float32)
    kwargs, added = {}, None
    if name == "sdxl":
        added = {"text_embeds": rng.normal(size=(2, 12)).astype(np.float32),
                 "time_ids": np.array([[64, 64, 0, 0, 64, 64], [32, 48, 4, 8, 64, 32]], np.float32)}
        kwargs["added_cond_kwargs"] = {k: torch.from_numpy(v) for k, v in added.items()}
    with torch.no_grad():
        want = model(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(context), **kwargs).sample.numpy()
    got = np.asarray(_apply(params, cfg, x.transpose(0, 2, 3, 1), t, context, added)).transpose(0, 3, 1, 2)
    assert got.shape == want.shape and np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_the_config_reads_sd2s_head_counts_and_sdxls_embedding(folders):
    cfg = U.load_unet(folders["sd2"][0])[0]
    assert cfg.attention_heads == (2, 4) and cfg.use_linear_projection and cfg.upcast_attention
    sdxl = U.unet_config(json.loads((folders["sdxl"][0] / "config.json").read_text()), "x")
    assert sdxl.transformer_layers_per_block == (1, 2) and sdxl.addition_time_embed_dim == 8
    hash(cfg)  # a jit static argument


def test_every_unet_weight_has_a_sharding_by_the_rules(folders):
    from jax.sharding import PartitionSpec as P

    from hypertron.config import MeshConfig
    from hypertron.models.params import abstract, logical_axes
    from hypertron.parallel.mesh import make_mesh
    from hypertron.parallel.rules import shardings_for

    cfg = U.load_unet(folders["sdxl"][0])[0]
    specs = U.declare_unet(cfg)
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2), jax.devices()[:8])
    shard = shardings_for(logical_axes(specs), abstract(specs, np.float32), mesh)
    block = shard["down"]["1"]["attention0"]["blocks"]["1"]
    assert block["attn2"]["wk"].spec == P("fsdp", "tensor", None)  # [context, heads, head_dim]
    assert block["ff"]["w_in"].spec == P("fsdp", None, "tensor")  # [c, value|gate, 4c]
    assert shard["up"]["0"]["resnet1"]["time_w"].spec == P(None, "fsdp")


# The published UNets' shapes (their config.json values that differ from diffusers' defaults).
PUBLISHED = {
    "sd-1.5": {"cross_attention_dim": 768},
    "sd-2.1": {"cross_attention_dim": 1024, "attention_head_dim": [5, 10, 20, 20], "use_linear_projection": True,
               "upcast_attention": True},
    "sdxl-1.0": {"block_out_channels": [320, 640, 1280], "cross_attention_dim": 2048,
                 "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                 "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                 "attention_head_dim": [5, 10, 20], "use_linear_projection": True,
                 "transformer_layers_per_block": [1, 2, 10], "addition_embed_type": "text_time",
                 "addition_time_embed_dim": 256, "projection_class_embeddings_input_dim": 2816},
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_declaration_is_the_published_unets_state_dict(name):
    """Every tensor name and shape of the full-size model (built on torch's meta device: no memory,
    under a second), so a block layout the tiny UNets do not reach (two resnets a block, ten-deep
    transformers) is still checked."""
    import diffusers

    from hypertron.models import hf
    from hypertron.models.params import leaves_with_paths

    with torch.device("meta"):
        model = diffusers.UNet2DConditionModel(**PUBLISHED[name])
    cfg = U.unet_config(json.loads(json.dumps(dict(model.config))), name)
    ours = {s.hf: hf._hf_shape(s.hf_layout, s.shape) for _, s in leaves_with_paths(U.declare_unet(cfg))}
    assert ours == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_a_missing_tensor_and_an_unsupported_block_are_one_line(folders, tmp_path):
    folder = refuses_missing_tensor(folders["sdxl"][0], tmp_path / "unet",
                                    "down_blocks.1.attentions.0.transformer_blocks.1.attn2.to_k.weight", U.load_unet)
    refuses_block_type(folder, "up_block_types", 0, "AttnUpBlock2D", U.load_unet)
    config = json.loads((folder / "config.json").read_text())
    for key, value in (("class_embed_type", "timestep"), ("addition_embed_type", "text")):
        with pytest.raises(DiffusionError, match=f"config.json: {key}=.* is not supported"):
            U.unet_config(config | {key: value, "up_block_types": CONFIGS["sdxl"]["up_block_types"]},
                          str(folder / "config.json"))
