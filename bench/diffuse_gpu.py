"""The GPU campaign's diffusion rows (``t3.diffuse.*`` of ``bench/gpu_campaign.py``): SDXL-base and
Flux-dev at their published configs, random weights built in memory by both libraries (nothing is
downloaded or written), 1024x1024, bfloat16.

Each side runs in its own process, one after the other, so that each has the GPU's memory to itself
(a Flux-dev transformer is 24 GB in bf16; JAX takes 90 % of the card when it starts):

* diffusers (torch bf16, SDPA attention): the transformer / UNet, the VAE and the scheduler built from
  the config dicts below with torch's random init on the device; the pipeline called with random
  prompt embeddings, ``output_type="latent"`` (no decode), ``--steps`` steps, a warm-up call first;
  ``s_per_step`` is the call over the steps (median of two).
* hypertron: the parameters drawn on the device from the declarations (``models.params.initialize``
  of ``declare_unet`` / ``declare_flux`` / ``vae.declare`` of the same dicts); the sampling program
  of ``hypertron diffuse`` (the scan over the steps, then the VAE decode), compiled once, run with
  the same prompt-embedding shapes; ``s_per_step`` is the time to the program's mark after the last
  step, over the steps (median of two after a warm-up); ``decode_s`` the rest.

Only the denoising steps are timed: the text encoders (CLIP, T5-XXL) are not built. ``s_per_image_est``
extrapolates: (``steps_image`` x ``s_per_step`` + ``decode_s``) / batch, with 30 steps for SDXL and 28
for Flux-dev (the figures MaxDiffusion and diffusers publish), not a measured 28-step run.

    python bench/diffuse_gpu.py --side hypertron|diffusers --config sdxl|flux [--batch N]
        [--quantize none|fp8] [--steps N] [--smoke]

prints one JSON line (the row functions of the campaign run it so); ``--smoke`` runs the tests' tiny
configs at 16x16 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The published configs (config.json of stabilityai/stable-diffusion-xl-base-1.0 and black-forest-labs/FLUX.1-dev),
# the keys that differ from diffusers' defaults; each library builds its model from the same dict.
SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, block_out_channels=(320, 640, 1280), layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20), cross_attention_dim=2048, use_linear_projection=True, norm_num_groups=32,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816)
SDXL_VAE = dict(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4, norm_num_groups=32,
                sample_size=1024, scaling_factor=0.13025)
SDXL_SCHEDULER = dict(_class_name="EulerDiscreteScheduler", beta_start=0.00085, beta_end=0.012,
                      beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading")
FLUX_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                        guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX_VAE = dict(SDXL_VAE, latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                use_post_quant_conv=False)
FLUX_SCHEDULER = dict(_class_name="FlowMatchEulerDiscreteScheduler", shift=3.0, use_dynamic_shifting=True,
                      base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
# --smoke: the tests' tiny SDXL and Flux (tests/support/diffusion_folders.py), in memory
TINY_VAE = dict(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8)
TINY = {
    "sdxl": dict(sample_size=8, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8, norm_num_groups=8,
                 addition_embed_type="text_time", addition_time_embed_dim=8,
                 projection_class_embeddings_input_dim=6 * 8 + 24),
    "flux": dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=24, guidance_embeds=True,
                 axes_dims_rope=(4, 6, 6)),
}
# config -> (denoiser, vae, scheduler, steps of a published image, guidance, text tokens)
CONFIGS = {"sdxl": (SDXL_UNET, SDXL_VAE, SDXL_SCHEDULER, 30, 5.0, 77),
           "flux": (FLUX_TRANSFORMER, FLUX_VAE, FLUX_SCHEDULER, 28, 3.5, 512)}
FIELDS = ("config", "batch", "size", "dtype", "quantize", "steps_timed", "steps_image", "params_b", "compile_s",
          "s_per_step", "decode_s", "s_per_image_est", "peak_mem_gib", "diffusers_s_per_step", "diffusers_peak_mem_gib",
          "speedup")
FP8_FIELDS = ("config", "batch", "size", "quantize", "steps_timed", "compile_s", "s_per_step", "s_per_image_est",
              "peak_mem_gib", "bf16_s_per_step", "vs_bf16")


def configs(name: str, smoke: bool) -> tuple[dict, dict, dict, int, float, int, int]:
    """(denoiser, vae, scheduler dicts, steps_image, guidance, text tokens, image side) of ``name``."""
    denoiser, vae, scheduler, steps, guidance, tokens = CONFIGS[name]
    size = 1024
    if smoke:
        vae = dict(TINY_VAE, **{k: v for k, v in vae.items() if k in ("scaling_factor", "shift_factor",
                                                                      "use_quant_conv", "use_post_quant_conv")})
        denoiser, tokens, size = TINY[name], 8, 16
    as_json = lambda d: json.loads(json.dumps(d))  # noqa: E731  (lists, as a config.json holds them)
    return as_json(denoiser), as_json(vae), scheduler, steps, guidance, tokens, size


def _conditioning(name: str, denoiser: dict, batch: int, tokens: int, rng) -> dict:
    """Random prompt embeddings in the shapes the pipeline's encoders give (float32 numpy)."""
    if name == "flux":
        shapes = {"context": (batch, tokens, denoiser["joint_attention_dim"]),
                  "pooled": (batch, denoiser["pooled_projection_dim"])}
    else:
        pooled = denoiser["projection_class_embeddings_input_dim"] - 6 * denoiser["addition_time_embed_dim"]
        shapes = {k: (batch, tokens, denoiser["cross_attention_dim"]) if "context" in k else (batch, pooled)
                  for k in ("context", "negative_context", "pooled", "negative_pooled")}
    return {k: rng.normal(size=s).astype("float32") for k, s in shapes.items()}


def _latent_shape(name: str, vae: dict, size: int) -> tuple[int, ...]:
    side = size // 2 ** (len(vae["block_out_channels"]) - 1)
    c = vae["latent_channels"]
    return ((side // 2) ** 2, 4 * c) if name == "flux" else (c, side, side)


def random_params(specs, dtype):
    """Parameters as declared (zeros, ones, or normal times the declared scale), on the device: every
    normal leaf a slice of one random buffer (one draw: ``params.initialize`` under one jit compiles a
    draw per leaf, minutes for SDXL's 1,700 on a CPU). Values only set the timing apart through
    overflow, which the declared scales keep away."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hypertron.models.params import is_spec

    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    size = max(int(np.prod(s.shape)) for s in leaves)
    buffer = jax.random.normal(jax.random.key(0), (size,), dtype)

    def one(s):
        if s.init in ("zeros", "ones"):
            return (jnp.zeros if s.init == "zeros" else jnp.ones)(s.shape, dtype)
        return (buffer[:int(np.prod(s.shape))] * jnp.asarray(s.scale, dtype)).reshape(s.shape)
    return jax.tree.unflatten(treedef, [one(s) for s in leaves])


def hypertron_side(name: str, batch: int, quantize: str, steps: int, smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hypertron.diffusion import flux as F
    from hypertron.diffusion import pipeline as P
    from hypertron.diffusion import sampling
    from hypertron.diffusion import schedulers as S
    from hypertron.diffusion import unet as U
    from hypertron.diffusion import vae as V
    from hypertron.models.params import count

    denoiser, vae, scheduler, steps_image, guidance, tokens, size = configs(name, smoke)
    flux = name == "flux"
    module, cfg = (F, F.flux_config(denoiser, name)) if flux else (U, U.unet_config(denoiser, name))
    specs = F.declare_flux(cfg) if flux else U.declare_unet(cfg)
    vae_cfg = V.vae_config(vae, name)
    dtype = jnp.bfloat16
    params, vae_params = random_params(specs, dtype), random_params(V.declare(vae_cfg), dtype)
    kind = P.FLUX if flux else P.SDXL
    spec = P.PipelineSpec(folder=Path("."), class_name=kind, kind=P.KINDS[kind], scheduler=S.parse_config(scheduler),
                          vae=vae_cfg, denoiser_config=denoiser, options={})
    pipe = P.Pipeline(spec=spec, text_encoders=(), tokenizers=(), denoiser_cfg=cfg, denoiser_params=params,
                      vae_params=vae_params, dtype=jnp.dtype(dtype), denoise=module.apply, quantize=quantize)
    rng = np.random.default_rng(0)
    cond = {k: jnp.asarray(v) for k, v in _conditioning(name, denoiser, batch, tokens, rng).items()}
    latents = jnp.asarray(rng.normal(size=(batch, *_latent_shape(name, vae, size))), jnp.float32)
    args = (sampling.weights(pipe), sampling.schedule_for(spec, steps, size, size), cond, latents,
            sampling.image_keys(0, batch), jnp.full((batch,), guidance, jnp.float32), jnp.zeros((batch,), jnp.float32))
    program = sampling.program(pipe, sampling.latent_hw(spec, size, size), timed=True)
    start = time.perf_counter()
    compiled = program.fn.lower(*args).compile()
    compile_s = time.perf_counter() - start
    per_step, decode = [], []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        end = time.perf_counter()
        per_step.append((program.marks[-1] - start) / steps)
        decode.append(end - program.marks[-1])
    s_per_step, decode_s = statistics.median(per_step[1:]), statistics.median(decode[1:])
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {"params_b": count(specs) / 1e9, "compile_s": compile_s, "s_per_step": s_per_step, "decode_s": decode_s,
            "s_per_image_est": (steps_image * s_per_step + decode_s) / batch, "peak_mem_gib": peak and peak / 2**30,
            "size": size, "steps_image": steps_image}


def diffusers_side(name: str, batch: int, steps: int, smoke: bool) -> dict:
    import diffusers
    import numpy as np
    import torch

    denoiser, vae, scheduler, _, guidance, tokens, size = configs(name, smoke)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        model = (diffusers.FluxTransformer2DModel if name == "flux" else diffusers.UNet2DConditionModel)(**denoiser)
        autoencoder = diffusers.AutoencoderKL(**vae)
        torch.set_default_dtype(torch.float32)
    sched = getattr(diffusers, scheduler["_class_name"]).from_config(
        {k: v for k, v in scheduler.items() if k != "_class_name"})
    if name == "flux":
        pipe = diffusers.FluxPipeline(scheduler=sched, vae=autoencoder, transformer=model, text_encoder=None,
                                      tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    else:
        pipe = diffusers.StableDiffusionXLPipeline(vae=autoencoder, text_encoder=None, text_encoder_2=None,
                                                   tokenizer=None, tokenizer_2=None, unet=model, scheduler=sched,
                                                   add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(0)
    names = {"context": "prompt_embeds", "negative_context": "negative_prompt_embeds",
             "pooled": "pooled_prompt_embeds", "negative_pooled": "negative_pooled_prompt_embeds"}
    kwargs = {names[k]: torch.from_numpy(v).to(device, torch.bfloat16)
              for k, v in _conditioning(name, denoiser, batch, tokens, rng).items()}
    latents = torch.from_numpy(rng.normal(size=(batch, *_latent_shape(name, vae, size))).astype("float32"))
    kwargs.update(latents=latents.to(device, torch.bfloat16), height=size, width=size, num_inference_steps=steps,
                  guidance_scale=guidance, output_type="latent")
    times = []
    with torch.no_grad():
        for _ in range(3):
            start = time.perf_counter()
            pipe(**kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / steps)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return {"diffusers_s_per_step": statistics.median(times[1:]), "diffusers_peak_mem_gib": peak and peak / 2**30}


def in_child(side: str, name: str, batch: int, steps: int, smoke: bool, quantize: str = "none") -> dict:
    """One side of a row in its own process (its own GPU memory), as a dict."""
    cmd = [sys.executable, __file__, "--side", side, "--config", name, "--batch", str(batch), "--steps", str(steps),
           "--quantize", quantize, *(["--smoke"] if smoke else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{side} side of {name} failed: {tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gpu_is_free() -> None:
    """The rows need the card to themselves: a process that has started JAX on the GPU holds 90 % of it."""
    jax = sys.modules.get("jax")
    if jax is None:
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized() and jax.default_backend() == "gpu":
        raise RuntimeError("this process already holds the GPU (JAX started): run the t3.diffuse rows in a "
                           "campaign call of their own (--only t3.diffuse)")


def diffuse_row(name: str, batch: int = 1):
    """The campaign row of ``name`` (sdxl, flux) in bf16: hypertron and diffusers, one process each."""
    def run(ctx):
        _gpu_is_free()
        steps = 2 if ctx.smoke else 4
        theirs = in_child("diffusers", name, batch, steps, ctx.smoke)
        ours = in_child("hypertron", name, batch, steps, ctx.smoke)
        ctx.keep[f"diffuse.{name}.b{batch}"] = ours["s_per_step"]
        return {"config": name, "batch": batch, "size": ours["size"], "dtype": "bfloat16", "quantize": "none",
                "steps_timed": steps, **{k: ours[k] for k in ("steps_image", "params_b", "compile_s", "s_per_step",
                                                              "decode_s", "s_per_image_est", "peak_mem_gib")},
                **theirs, "speedup": theirs["diffusers_s_per_step"] / ours["s_per_step"]}
    return run


def diffuse_fp8_row(name: str, batch: int = 1):
    """hypertron alone with fp8 matmuls (diffusers has none), against the bf16 row's s/step when it ran
    (else measured here)."""
    def run(ctx):
        _gpu_is_free()
        steps = 2 if ctx.smoke else 4
        ours = in_child("hypertron", name, batch, steps, ctx.smoke, "fp8")
        bf16 = ctx.keep.get(f"diffuse.{name}.b{batch}") or in_child("hypertron", name, batch, steps,
                                                                    ctx.smoke)["s_per_step"]
        return {"config": name, "batch": batch, "size": ours["size"], "quantize": "fp8", "steps_timed": steps,
                **{k: ours[k] for k in ("compile_s", "s_per_step", "s_per_image_est", "peak_mem_gib")},
                "bf16_s_per_step": bf16, "vs_bf16": bf16 / ours["s_per_step"]}
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=("hypertron", "diffusers"), required=True)
    p.add_argument("--config", choices=tuple(CONFIGS), required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--quantize", choices=("none", "fp8"), default="none")
    p.add_argument("--smoke", action="store_true", help="the tiny configs at 16x16 (CPU)")
    a = p.parse_args(argv)
    if a.side == "hypertron":
        row = hypertron_side(a.config, a.batch, a.quantize, a.steps, a.smoke)
    else:
        row = diffusers_side(a.config, a.batch, a.steps, a.smoke)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
