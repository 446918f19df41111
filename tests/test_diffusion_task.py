"""``task: diffusion`` on the training loop: the shapes demo learns its prompts' colours (and not
without its prompts), a resumed run repeats an uninterrupted one's losses bit for bit with
its EMA, the final ``RUN/model`` is a pipeline folder ``hypertron diffuse`` loads, and bad configs
are one line before anything is written. On 8 simulated CPU devices; the preset's UNet is
0.36M parameters."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from hypertron.config import load_config
from hypertron.diffusion import shapes
from hypertron.diffusion.pipeline import PIXEL, load_pipeline
from hypertron.train.loop import train
from support.cli import one_error_line, run_cli  # tests/support

ROOT = Path(__file__).parent.parent
RECIPE = ROOT / "recipes" / "cpu" / "diffusion-shapes.yaml"
QUIET = ["monitor.collect=false", "train.eval_every=0"]


def _cfg(run: Path, *overrides: str):
    return load_config(RECIPE, [f"run_dir={run}", *QUIET, *overrides])


@pytest.mark.optimized
def test_the_shapes_demo_learns_its_prompts_colour(tmp_path):
    """The recipe's model, trained briefly on one device, draws the prompt's colour in at least 90 %
    of 24 samples, and with the prompt embeddings zeroed in at most 60 % (the prompt decides it).
    The run leaves RUN/model, our pixel pipeline, its EMA weights. (Issue 44's shape bar is not
    met yet: docs/diffusion.md.)"""
    run = tmp_path / "run"
    result = train(_cfg(run, "train.steps=120", "checkpoint.every=120", "mesh.data=1"))
    assert result.losses[-1] < result.losses[0] / 4
    index = json.loads((run / "model" / "model_index.json").read_text())
    assert index["_class_name"] == PIXEL
    pipe = load_pipeline(run / "model")
    score = shapes.score(pipe, per_prompt=4)
    zeroed = shapes.score(pipe, per_prompt=4, zero_prompts=True)
    assert score.colour >= 0.9 * score.total, score
    assert zeroed.colour <= 0.6 * zeroed.total, zeroed


def test_a_resumed_run_repeats_the_uninterrupted_losses_and_ema(tmp_path):
    """12 steps straight, and 6 then 6 more from the checkpoint at 6: the same losses to the bit,
    the same EMA and parameters (both runs on the 8 devices, batch split over data)."""
    common = ["train.global_batch=8", "train.schedule=constant", "train.warmup_steps=0",
              "diffusion.ema.decay=0.9", "checkpoint.every=6"]
    straight = train(_cfg(tmp_path / "a", *common, "train.steps=12"))
    run = tmp_path / "b"
    first = train(_cfg(run, *common, "train.steps=6"))
    resumed = train(_cfg(run, *common, "train.steps=12"))
    assert first.losses + resumed.losses == straight.losses
    a, b = (load_pipeline(tmp_path / name / "model").denoiser_params for name in ("a", "b"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("overrides,message", [
    (["diffusion.objective=epsilon"], "objective epsilon does not fit the model's FlowMatchEulerDiscreteScheduler"),
    (["diffusion.ema.decay=1.5"], "diffusion.ema.decay=1.5: must be in (0, 1)"),
    (["diffusion.cond_dropout=1"], "diffusion.cond_dropout=1.0: must be in [0, 1)"),
    (["data.resolution=48"], "data.resolution=48: the shapes source draws 32 x 32 pictures"),
    (["diffusion.weighting=min_snr"], "weighting min_snr does not fit objective flow"),
    (["diffusion.model=nowhere"], "diffusion.model=nowhere: neither a diffusers folder nor a preset"),
    (["data.source=imagefolder", "data.paths=nowhere"], "nowhere"),
    (["train.init_from=somewhere"], "train.init_from: task=diffusion starts from diffusion.model"),
])
def test_bad_configs_are_one_line_and_write_nothing(tmp_path, overrides, message):
    run = tmp_path / "run"
    r = run_cli(["train", str(RECIPE), f"run_dir={run}", *QUIET, *overrides])
    one_error_line(r, message)
    assert not run.exists()
