"""hypertron's diffusion sampling against diffusers' (torch), on the same folder (issue 39, point 10).

    python bench/diffuse.py [--configs tiny-sd,tiny-sdxl,tiny-flux,small-sd] [--steps 10] [--repeats 3]
                            [--output FILE.json]

Each config is a diffusers pipeline folder written with random weights by
``tests/support/diffusion_folders.py`` (the tests' tiny SD, SDXL and Flux, and a small SD: UNet
channels 64/128/256, 64x64 latents, 128x128 images). Both libraries run it in float32 on this
machine's CPU, one image, the same prompt, initial latents, steps and guidance (the pipeline's
default: 7.5 SD, 5.0 SDXL, 3.5 Flux embedded; Flux's T5 at 512 tokens, both libraries' default).

* ``hypertron_s_per_step``: the compiled program's time to the end of its last step (the VAE decode
  after it left out, read from the program's own mark), over the steps; median of ``--repeats``
  after a warm-up run. Prompts are encoded before the clock starts.
* ``diffusers_s_per_step``: the diffusers pipeline's call with the same prompt embeddings given
  (``prompt_embeds=`` ..., encoding left out) and ``output_type="latent"`` (no decode), over the
  steps; median of ``--repeats`` after a warm-up call, each run beside one of hypertron's (interleaved,
  so both see the same machine load).
* ``speedup``: diffusers' s/step over hypertron's.
* ``first_image_cold_s``: a fresh Python process (imports done before its clock) with an empty
  persistent JAX compilation cache: ``load_pipeline``, prompt encoding, compile and the first
  image, as ``hypertron diffuse`` does them.
* ``first_image_warm_s``: the same again in a second fresh process on the cache the first one
  filled (every compile of that process, the text encoders' included, is cached:
  ``jax_persistent_cache_min_compile_time_secs=0``). This process turns the cache on itself:
  ``hypertron diffuse`` has no ``--compile-cache`` in this tree yet.

On a shared machine torch's default OpenMP threads can stall on one another (a loaded 2-core machine
ran tiny SD's UNet 10x slower on 2 threads than on 1); ``--threads 1`` sets torch to one thread and
asks XLA's CPU backend for one (``--xla_cpu_multi_thread_eigen=false``).

One line per config; ``--output`` also writes the rows, the versions and the machine as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PROMPT = "a photo of a red cat"
# config -> (the builder in tests/support/diffusion_folders.py, image side in pixels)
CONFIGS = {"tiny-sd": ("tiny_sd", 16), "tiny-sdxl": ("tiny_sdxl", 16), "tiny-flux": ("tiny_flux", 16),
           "small-sd": ("small_sd", 128)}


def _hypertron_args(pipe, steps: int, size: int, latents):
    from hypertron.diffusion import sampling

    return sampling.request_args(pipe, PROMPT, None, count=1, seed=0, steps=steps, guidance=pipe.spec.kind.guidance,
                                 height=size, width=size, latents=latents)


def first_image(folder: str, steps: int, size: int, cache: str) -> float:
    """(In a fresh process.) Seconds from nothing loaded to the first image's pixels, with the
    persistent compilation cache in ``cache``."""
    import jax

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    from hypertron.diffusion import sampling
    from hypertron.diffusion.pipeline import load_pipeline

    start = time.perf_counter()
    pipe = load_pipeline(folder)
    args = _hypertron_args(pipe, steps, size, None)
    program = sampling.program(pipe, sampling.latent_hw(pipe.spec, size, size))
    jax.block_until_ready(program.fn(*args))
    return time.perf_counter() - start


def _first_image_in_child(folder: Path, steps: int, size: int, cache: Path) -> float:
    out = subprocess.run([sys.executable, __file__, "--first-image", str(folder), "--steps", str(steps),
                          "--size", str(size), "--compile-cache", str(cache)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode != 0:
        sys.exit(f"error: the first-image process failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def hypertron_step(folder: Path, steps: int, size: int, latents):
    """A function that runs hypertron's compiled program once (compiled here) and returns its s/step."""
    import jax

    from hypertron.diffusion import sampling
    from hypertron.diffusion.pipeline import load_pipeline

    pipe = load_pipeline(folder)
    args = jax.block_until_ready(_hypertron_args(pipe, steps, size, latents))
    program = sampling.program(pipe, sampling.latent_hw(pipe.spec, size, size), timed=True)
    compiled = program.fn.lower(*args).compile()

    def once() -> float:
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        return (program.marks[-1] - start) / steps
    return once


def _diffusers_embeds(pipe, flux: bool, sdxl: bool) -> dict:
    """The prompt's embeddings as the pipeline's own ``encode_prompt`` makes them (CFG's negatives too)."""
    import torch

    with torch.no_grad():
        if flux:
            context, pooled, _ = pipe.encode_prompt(PROMPT, None, device="cpu", max_sequence_length=512)
            return {"prompt_embeds": context, "pooled_prompt_embeds": pooled}
        if sdxl:
            c, nc, p, np_ = pipe.encode_prompt(PROMPT, device="cpu", num_images_per_prompt=1,
                                               do_classifier_free_guidance=True)
            return {"prompt_embeds": c, "negative_prompt_embeds": nc, "pooled_prompt_embeds": p,
                    "negative_pooled_prompt_embeds": np_}
        c, nc = pipe.encode_prompt(PROMPT, "cpu", 1, True)
        return {"prompt_embeds": c, "negative_prompt_embeds": nc}


def diffusers_step(pipe, steps: int, size: int, latents, guidance: float):
    """A function that runs the diffusers pipeline once (encoding and decode left out) and returns its s/step."""
    import torch

    name = type(pipe).__name__
    embeds = _diffusers_embeds(pipe, name == "FluxPipeline", name == "StableDiffusionXLPipeline")
    pipe.set_progress_bar_config(disable=True)

    def once() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            pipe(**embeds, latents=torch.from_numpy(latents), height=size, width=size, num_inference_steps=steps,
                 guidance_scale=guidance, output_type="latent")
        return (time.perf_counter() - start) / steps
    return once


def run_config(name: str, root: Path, steps: int, repeats: int) -> dict:
    import numpy as np

    from hypertron.diffusion.pipeline import read_pipeline
    from support import diffusion_folders

    builder, size = CONFIGS[name]
    (root / name).mkdir()
    folder, reference = getattr(diffusion_folders, builder)(root / name)
    spec = read_pipeline(folder)
    latents = np.random.default_rng(0).normal(size=(1, *spec.latent_shape(size, size))).astype(np.float32)
    cache = root / name / "compile-cache"
    cold = _first_image_in_child(folder, steps, size, cache)
    warm = _first_image_in_child(folder, steps, size, cache)
    runs = (hypertron_step(folder, steps, size, latents), diffusers_step(reference, steps, size, latents,
                                                                          spec.kind.guidance))
    times = [[run() for run in runs] for _ in range(repeats + 1)]  # interleaved: both see the same load
    ours, theirs = (statistics.median(t[i] for t in times[1:]) for i in range(2))
    return {"config": name, "hypertron_s_per_step": ours, "diffusers_s_per_step": theirs, "speedup": theirs / ours,
            "first_image_cold_s": cold, "first_image_warm_s": warm, "warm_over_cold": warm / cold,
            "steps": steps, "size": size}


def _line(row: dict) -> str:
    return (f"config={row['config']} hypertron_s_per_step={row['hypertron_s_per_step']:.4f} "
            f"diffusers_s_per_step={row['diffusers_s_per_step']:.4f} speedup={row['speedup']:.2f} "
            f"first_image_cold_s={row['first_image_cold_s']:.2f} first_image_warm_s={row['first_image_warm_s']:.2f}")


def _versions() -> dict:
    import diffusers
    import jax
    import torch
    import transformers

    return {"python": platform.python_version(), "jax": jax.__version__, "torch": torch.__version__,
            "diffusers": diffusers.__version__, "transformers": transformers.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (the median is reported)")
    p.add_argument("--output", default=None, metavar="FILE.json")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch's intra-op threads (default: torch's own); 1 also asks XLA's CPU backend for one "
                   "(--xla_cpu_multi_thread_eigen=false)")
    p.add_argument("--first-image", default=None, help=argparse.SUPPRESS)  # the child process's folder
    p.add_argument("--size", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--compile-cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads == 1:  # before jax is imported; the first-image processes inherit it
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    if args.first_image:
        print(first_image(args.first_image, args.steps, args.size, args.compile_cache))
        return 0
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"error: --configs: unknown {', '.join(unknown)} (known: {', '.join(CONFIGS)})", file=sys.stderr)
        return 2
    if args.steps < 1 or args.repeats < 1:
        print("error: --steps and --repeats must be at least 1", file=sys.stderr)
        return 2
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    versions = _versions()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  {platform.node()}  "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores  threads "
          f"{args.threads or 'default'}  "
          + "  ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:
            rows.append(run_config(name, Path(tmp), args.steps, args.repeats))
            print(_line(rows[-1]), flush=True)
    if args.output:
        meta = {"date": datetime.date.today().isoformat(), "machine": platform.node(), "cores": os.cpu_count(),
                "threads": args.threads, "versions": versions, "steps": args.steps, "repeats": args.repeats}
        Path(args.output).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
