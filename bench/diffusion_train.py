"""hypertron's diffusion training step against diffusers' (torch) on the same tiny UNet: the
``shapes-unet`` preset of ``recipes/cpu/diffusion-shapes.yaml`` (0.36M parameters, 32 x 32 pixels,
a frozen 2-layer CLIP), the same batch of the ``shapes`` source, flow matching with logit-normal
timesteps, AdamW (the recipe's lr, betas and decay). hypertron: the task's compiled step
(``DiffusionTrainer``: the CLIP forward, the UNet's forward and backward, the update) on one
device. diffusers: ``UNet2DConditionModel`` and ``CLIPTextModel`` read from the same folder, the
text encoder under ``no_grad``, ``loss.backward()`` and ``torch.optim.AdamW``, torch's threads as
it sets them. Each side: ``--warmup`` steps, then ``--steps`` timed, ``--repeats`` times
alternating; images/s of each repeat and the median. Prints one line::

    diffusion_train batch=B: hypertron X images/s (S s/step) diffusers Y images/s (T s/step) ratio R

``R`` = hypertron's over diffusers' (issue 44's bar: at least 1.5 at batch 32 on this CPU).

    python bench/diffusion_train.py [--batch 32] [--steps 10] [--warmup 3] [--repeats 3] [OVERRIDE ...]
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
RECIPE = ROOT / "recipes" / "cpu" / "diffusion-shapes.yaml"


def _hypertron(cfg):
    """``(step, folder, batch)``: one call runs a step and waits for it."""
    import jax

    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.diffusion_task import DiffusionTask

    task = DiffusionTask()
    task.check_inputs(cfg)
    trainer = task.trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    local = next(task.batches(cfg))
    state = [trainer.initial()]

    def step():
        state[0], metrics = trainer.step(state[0], local)
        jax.block_until_ready(metrics["loss"])

    return step, task.folder(cfg), local


def _diffusers(cfg, folder: Path, local: dict):
    import numpy as np
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    t = cfg.train
    unet = UNet2DConditionModel.from_pretrained(folder / "unet")
    text = CLIPTextModel.from_pretrained(folder / "text_encoder").eval()
    opt = torch.optim.AdamW(unet.parameters(), lr=t.lr, betas=(t.b1, t.b2), weight_decay=t.weight_decay)
    ids = torch.from_numpy(np.asarray(local["ids"], np.int64))
    x0 = torch.from_numpy(np.asarray(local["pixels"], np.float32)).permute(0, 3, 1, 2).contiguous()
    f = cfg.diffusion

    def step():
        with torch.no_grad():
            context = text(ids).last_hidden_state
        sigma = torch.sigmoid(f.logit_mean + f.logit_std * torch.randn(x0.shape[0]))
        noise = torch.randn_like(x0)
        s = sigma[:, None, None, None]
        pred = unet((1 - s) * x0 + s * noise, sigma * 1000, encoder_hidden_states=context).sample
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _rate(step, batch: int, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="config overrides (key=value) of the recipe")
    args = p.parse_args(argv)

    from hypertron.config import load_config

    run = Path(tempfile.mkdtemp(prefix="diffusion_train_")) / "run"
    cfg = load_config(RECIPE, [f"run_dir={run}", f"train.global_batch={args.batch}", "mesh.data=1",
                               "diffusion.use_ema=false", "monitor.collect=false", *args.overrides])
    ours, folder, local = _hypertron(cfg)
    theirs = _diffusers(cfg, folder, local)
    rates: dict[str, list[float]] = {"hypertron": [], "diffusers": []}
    for _ in range(args.repeats):
        rates["hypertron"].append(_rate(ours, args.batch, args.warmup, args.steps))
        rates["diffusers"].append(_rate(theirs, args.batch, args.warmup, args.steps))
    med = {k: statistics.median(v) for k, v in rates.items()}
    runs = "; ".join(f"{k} {', '.join(f'{r:.1f}' for r in v)}" for k, v in rates.items())
    print(f"diffusion_train batch={args.batch}: hypertron {med['hypertron']:.1f} images/s "
          f"({args.batch / med['hypertron']:.3f} s/step) diffusers {med['diffusers']:.1f} images/s "
          f"({args.batch / med['diffusers']:.3f} s/step) ratio {med['hypertron'] / med['diffusers']:.2f}  "
          f"(repeats: {runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
