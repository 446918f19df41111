"""``hypertron diffuse``: text to PNGs with a diffusers pipeline folder (SD 1.x/2.x, SDXL, Flux), and
``hypertron diffusion cache``: a diffusion training config's encodings, once. The work is
:func:`hypertron.diffusion.generate.diffuse`'s and :mod:`hypertron.train.diffusion_cache`'s; this
module holds the flags."""

from __future__ import annotations

import argparse

from hypertron.cli.flags import (add_command, add_command_group, add_compile_cache, number_arg, recipe_config,
                                 use_compile_cache)
from hypertron.config.schema import DIFFUSION_DTYPE, DiffusionDtype, choices


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``diffuse`` and ``diffusion cache`` to ``sub``."""
    group = add_command_group(sub, "diffusion", help="diffusion training's data")
    c = add_command(group, "cache", cmd_diffusion_cache,
                    help="encode a diffusion training config's captions (and with diffusion.cache_latents its "
                         "images) once, into diffusion.cache_dir")
    c.add_argument("overrides", nargs="*", metavar="[RECIPE] key=value")
    c.add_argument("--overwrite", action="store_true", help="replace the cache diffusion.cache_dir holds")
    d = add_command(sub, "diffuse", cmd_diffuse, help="generate images from a diffusers pipeline folder")
    d.add_argument("--model", required=True, metavar="DIR", help="diffusers pipeline folder")
    d.add_argument("--prompt", required=True)
    d.add_argument("--out", required=True, metavar="FILE.png",
                   help="the image; with --batch N: STEM-0.png .. STEM-{N-1}.png")
    d.add_argument("--negative-prompt", default=None, help="CFG's unconditional prompt (UNet pipelines)")
    d.add_argument("--steps", type=number_arg(int, low=1), default=None, metavar="N")
    d.add_argument("--guidance", type=number_arg(float, low=0), default=None, metavar="G",
                   help="CFG scale (above 1: CFG on), or Flux-dev's embedded guidance")
    d.add_argument("--height", type=number_arg(int, low=1), default=None, metavar="PIXELS")
    d.add_argument("--width", type=number_arg(int, low=1), default=None, metavar="PIXELS")
    d.add_argument("--batch", type=number_arg(int, low=1), default=None, metavar="N", help="images (default 1)")
    d.add_argument("--seed", type=number_arg(int, low=0, high=2**32 - 1), default=0,
                   help="image i draws from fold_in(key(seed), i)")
    d.add_argument("--latents", default=None, metavar="FILE.npy",
                   help="initial latents in diffusers' layout ([b, c, h, w]; Flux: packed [b, tokens, c]), "
                        "before init_noise_sigma")
    d.add_argument("--save-latents", default=None, metavar="FILE.npy",
                   help="write the final latents (diffusers' layout)")
    d.add_argument("--scheduler", default=None, metavar="CLASS",
                   help="a scheduler class to run with the folder's scheduler options (e.g. EulerDiscreteScheduler)")
    d.add_argument("--dtype", default=DIFFUSION_DTYPE,
                   help=f"{' or '.join(choices(DiffusionDtype))}: the denoiser's and VAE's weights")
    d.add_argument("--quantize", default="none", metavar="MODE",
                   help="the denoiser's matmuls: none, int8 (int8 weights, per-channel scales) or fp8 (e4m3 operands)")
    d.add_argument("--text-encoder-quantize", default="none", metavar="MODE",
                   help="the text encoders' matmuls (CLIP, T5): none or int8 (int8 weights, about a quarter of "
                        "float32's bytes); they are freed once the prompts are encoded")
    d.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                   help="devices, e.g. data=2,fsdp=2: images over data, weights over fsdp/tensor by the sharding "
                        "rules (default: one device)")
    d.add_argument("--max-sequence-length", type=number_arg(int, low=1), default=512, metavar="N",
                   help="Flux: T5 tokens per prompt")
    d.add_argument("--lora", default=None, metavar="FILE[:SCALE]",
                   help="a diffusers LoRA file (pytorch_lora_weights.safetensors, or its folder) merged into the "
                        "denoiser, SCALE times (default 1)")
    add_compile_cache(d)


def cmd_diffuse(args: argparse.Namespace) -> int:
    """Generate images from text with a diffusers folder (model_index.json: StableDiffusionPipeline,
    StableDiffusionXLPipeline, FluxPipeline), the whole sampling loop and the VAE decode as one compiled
    program. Writes PNGs; never overwrites a file. Defaults (steps, guidance, size) are the diffusers
    pipeline's."""
    from hypertron.diffusion.generate import DiffuseRequest, diffuse

    names = ("model", "prompt", "out", "negative_prompt", "steps", "guidance", "height", "width", "batch", "seed",
             "latents", "save_latents", "scheduler", "dtype", "quantize", "text_encoder_quantize", "mesh",
             "max_sequence_length", "lora")
    request = DiffuseRequest(**{name: getattr(args, name) for name in names})
    use_compile_cache(args.compile_cache)
    diffuse(request)
    return 0


def cmd_diffusion_cache(args: argparse.Namespace) -> int:
    """Write the encodings a ``task: diffusion`` run reads with ``diffusion.cache_dir`` (the config's
    recipe and overrides, as ``hypertron train`` takes them): every caption's prompt embeddings, and
    with ``diffusion.cache_latents`` every image's VAE latents, in ArrayRecord shards."""
    from rich.console import Console

    from hypertron.train.diffusion_task import DiffusionTask

    cfg = recipe_config(args.overrides)
    DiffusionTask().write_cache(cfg, Console(stderr=True), overwrite=args.overwrite)
    return 0
