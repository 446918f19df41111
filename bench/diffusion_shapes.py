"""The CPU diffusion demo, end to end: train ``recipes/cpu/diffusion-shapes.yaml`` (a pixel-space UNet
from scratch on the ``shapes`` source, ``hypertron train`` in its own process), then sample
``--per-prompt`` pictures of each of the six captions with ``--steps`` steps of its scheduler and
let :func:`hypertron.diffusion.shapes.judge` read their colour and shape back. Prints::

    train_s=S colour_right=C/N shape_right=H/N zeroed_shape_right=Z/N

``zeroed``: the same samples with every prompt embedding zeroed (the conditioning's share of the
shape). Issue 44's bar: training at most 5 minutes on this project's 2-core CPU, the colour right in
at least 90 % and the shape in at least 80 % of 48 samples.

    python bench/diffusion_shapes.py [--run-dir DIR] [--per-prompt 8] [--steps 25] [--guidance G] [OVERRIDE ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "cpu" / "diffusion-shapes.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--per-prompt", type=int, default=8)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance", type=float, default=None, help="default: the pipeline's")
    p.add_argument("--skip-train", action="store_true", help="score RUN/model as it is")
    p.add_argument("overrides", nargs="*", help="config overrides for the training run (key=value)")
    args = p.parse_args(argv)
    run = Path(args.run_dir or tempfile.mkdtemp(prefix="diffusion_shapes_")) / "run"
    train_s = float("nan")
    if not args.skip_train:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "hypertron.cli", "train", str(RECIPE), f"run_dir={run}",
                        *args.overrides], check=True)
        train_s = time.perf_counter() - start

    from hypertron.diffusion import shapes
    from hypertron.diffusion.pipeline import load_pipeline

    pipe = load_pipeline(run / "model")
    score = shapes.score(pipe, per_prompt=args.per_prompt, steps=args.steps, guidance=args.guidance)
    zeroed = shapes.score(pipe, per_prompt=args.per_prompt, steps=args.steps, guidance=args.guidance,
                          zero_prompts=True)
    print(f"train_s={train_s:.1f} {score} zeroed_shape_right={zeroed.shape}/{zeroed.total} "
          f"zeroed_colour_right={zeroed.colour}/{zeroed.total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
