"""What cached encodings save a diffusion training step (``hypertron diffusion cache``,
``diffusion.cache_dir``): the task's compiled step on one device, reading image files and encoding
them (the text encoder and the VAE in the step), reading cached caption embeddings (the VAE still
in the step), and reading cached latents as well (neither). The model is a small SD folder written
with random weights by ``tests/support/diffusion_folders.small_sd`` (UNet channels 64/128/256, two
resnets a block, a 2-layer CLIP, a 2-level VAE) at ``--resolution`` (64: 32 x 32 latents; at 128
the UNet's attention over 64 x 64 latents wants about 50 GB at batch 8), the pictures random PNGs
of that size with captions. Each mode: ``--warmup`` steps, then ``--steps`` timed, ``--repeats`` times, the
modes alternating; images/s of each repeat and the median. Prints, per mode::

    diffusion_cache batch=B mode=M: X images/s (S s/step) vs uncached R

and the time ``hypertron diffusion cache`` took to write each cache.

    python bench/diffusion_cache.py [--batch 8] [--resolution 64] [--images 32] [--steps 5] [--warmup 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
MODES = ("uncached", "text", "latents")


def _images(folder: Path, count: int, side: int) -> None:
    import numpy as np
    from PIL import Image

    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(["a photo of a red cat", "a blue dog", "a cat", "a red dog"][i % 4])


def _step(settings: list[str]):
    import io

    import jax
    from rich.console import Console

    from hypertron.config import load_config
    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.diffusion_task import DiffusionTask

    cfg = load_config(None, settings)
    task = DiffusionTask()
    task.check_inputs(cfg)
    trainer = task.trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    said = io.StringIO()
    state, batches = [task.initial_state(cfg, trainer, Console(file=said, soft_wrap=True))], task.batches(cfg)

    def step():
        state[0], metrics = task.step(trainer, state[0], next(batches))
        jax.block_until_ready(metrics["loss"])

    return step, said.getvalue().strip()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from hypertron.cli import main as cli
    from support.diffusion_folders import small_sd

    root = Path(tempfile.mkdtemp(prefix="hypertron-bench-cache-"))
    folder, _ = small_sd(root)
    _images(root / "images", args.images, args.resolution)
    settings = ["task=diffusion", f"diffusion.model={folder}", "data.source=imagefolder", f"data.paths=[{root / 'images'}]",
                f"data.resolution={args.resolution}", "diffusion.use_ema=false", f"train.global_batch={args.batch}",
                f"run_dir={root / 'run'}", "monitor.collect=false"]
    extra = {"uncached": [], "text": [f"diffusion.cache_dir={root / 'text'}"],
             "latents": [f"diffusion.cache_dir={root / 'latents'}", "diffusion.cache_latents=true"]}
    for mode in ("text", "latents"):
        started = time.perf_counter()
        assert cli(["diffusion", "cache", *settings, *extra[mode]]) == 0
        print(f"diffusion_cache mode={mode}: wrote {args.images} samples in {time.perf_counter() - started:.1f} s "
              "(compiles included)", flush=True)
    steps = {}
    for mode in MODES:
        steps[mode], said = _step(settings + extra[mode])
        if said:
            print(f"diffusion_cache mode={mode}: {said.splitlines()[-1]}", flush=True)
        for _ in range(args.warmup):
            steps[mode]()
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            started = time.perf_counter()
            for _ in range(args.steps):
                steps[mode]()
            rates[mode].append(args.batch * args.steps / (time.perf_counter() - started))
    base = statistics.median(rates["uncached"])
    for mode in MODES:
        rate = statistics.median(rates[mode])
        print(f"diffusion_cache batch={args.batch} mode={mode}: {rate:.1f} images/s ({args.batch / rate:.3f} s/step) "
              f"vs uncached {rate / base:.2f} (repeats {', '.join(f'{r:.1f}' for r in rates[mode])})", flush=True)


if __name__ == "__main__":
    main()
