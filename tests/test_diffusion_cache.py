"""Cached encodings for ``task: diffusion`` (``hypertron diffusion cache``, ``diffusion.cache_dir``):
a run that reads the captions' embeddings, or those and the images' VAE latents, from the cache
takes the uncached run's losses (1e-6) without loading the text encoder (or the VAE); a cache
whose text encoder changed since is refused in one line before anything is written, as are an
existing cache without ``--overwrite`` and settings a cache cannot keep. A tiny SD folder (VAE
latents, DDIM; a UNet of one level) and 8 pictures with one undecodable file among them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from hypertron.config import load_config
from support.cli import one_error_line, run_cli  # tests/support

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from PIL import Image

    from support.diffusion_folders import TINY_UNET, tiny_sd

    root = tmp_path_factory.mktemp("cache")  # one level of the UNet, with cross-attention: quick to compile
    folder, _ = tiny_sd(root, TINY_UNET | {"block_out_channels": (32,), "down_block_types": ("CrossAttnDownBlock2D",),
                                           "up_block_types": ("CrossAttnUpBlock2D",)})
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(["a photo of a red cat", "a blue dog", "a cat", "red"][i % 4])
    (images / "8.png").write_bytes(b"not a png")
    (images / "8.txt").write_text("a dog")
    settings = [f"diffusion.model={folder}", "data.source=imagefolder", f"data.paths=[{images}]", "data.resolution=16",
                "diffusion.objective=auto", "diffusion.timesteps=uniform", "diffusion.cond_dropout=0.5",
                "diffusion.use_ema=false", "train.global_batch=8", "train.steps=2", "checkpoint.every=2",
                "monitor.collect=false", "train.eval_every=0", "task=diffusion",
                "train.lr=1e-3", "data.shuffle=true"]
    return root, folder, settings


def _losses(run, settings, *extra) -> tuple[list[float], str]:
    """The task's first two steps on one device (as the loop runs them), and what it printed."""
    import io

    import jax
    from rich.console import Console

    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.diffusion_task import DiffusionTask

    cfg = load_config(None, [f"run_dir={run}", *settings, *extra])
    task, said = DiffusionTask(), io.StringIO()
    task.check_inputs(cfg)
    trainer = task.trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    state, batches, losses = task.initial_state(cfg, trainer, Console(file=said, soft_wrap=True)), task.batches(cfg), []
    for _ in range(2):
        state, metrics = task.step(trainer, state, next(batches))
        losses.append(float(metrics["loss"]))
    return losses, said.getvalue()


def test_cached_runs_take_the_uncached_losses_without_the_encoders(setup):
    root, _, settings = setup
    want, _ = _losses(root / "plain", settings)
    for name, latents in (("text", "false"), ("latents", "true")):
        cache = [f"diffusion.cache_dir={root / name}", f"diffusion.cache_latents={latents}"]
        r = run_cli(["diffusion", "cache", *settings, *cache])
        assert r.rc == 0, r.describe()
        meta = json.loads((root / name / "cache.json").read_text())
        assert meta["records"] == 9 and meta["skipped"] == (1 if latents == "true" else 0), meta
        got, said = _losses(root / f"run-{name}", settings, *cache)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
        line = next(t for t in said.splitlines() if "not loaded" in t)
        assert "the text encoder" in line and (("the vae" in line) == (latents == "true")), line


def test_a_stale_or_existing_cache_and_settings_a_cache_cannot_keep_are_one_line(setup, tmp_path):
    from safetensors.numpy import load_file, save_file

    root, folder, settings = setup
    cache = [f"diffusion.cache_dir={tmp_path / 'cache'}"]
    assert run_cli(["diffusion", "cache", *settings, *cache]).rc == 0
    written = (tmp_path / "cache" / "cache.json").read_text()
    one_error_line(run_cli(["diffusion", "cache", *settings, *cache]), "holds a cache already (--overwrite replaces it)")
    assert (tmp_path / "cache" / "cache.json").read_text() == written

    changed = tmp_path / "changed"  # the same pipeline but one weight of the text encoder
    shutil.copytree(folder, changed)
    weights = changed / "text_encoder" / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, weights)
    run = tmp_path / "run"
    r = run_cli(["train", *settings, *cache, f"diffusion.model={changed}", f"run_dir={run}"])
    one_error_line(r, "stale, the text encoder's files changed since it was written")
    assert not run.exists()
    for extra, words in [
        ([f"diffusion.cache_dir={tmp_path / 'none'}"], "no cache there (write it with: hypertron diffusion cache"),
        (["diffusion.cache_latents=true"], "diffusion.cache_latents: set diffusion.cache_dir too"),
        ([*cache, "diffusion.cache_latents=true", "data.random_flip=true"], "data.random_flip and a random crop"),
        ([*cache, "data.source=shapes", "data.paths=[]", "data.resolution=0"], "the shapes source draws new pictures"),
    ]:
        r = run_cli(["train", *settings, *extra, f"run_dir={run}"])
        one_error_line(r, words)
        assert not run.exists()
