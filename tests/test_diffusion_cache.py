"""``task: diffusion`` on an SDXL folder, and its cached encodings (``hypertron diffusion cache``,
``diffusion.cache_dir``): the task's conditioning of a batch is diffusers' (``encode_prompt``'s
prompt and pooled embeddings, 1e-5; ``add_time_ids`` of the picture's original size and crop, as
``train_text_to_image_sdxl.py``); a run that reads the captions' embeddings, or those and the
images' VAE latents, from the cache takes the uncached run's losses (1e-6) without loading the
text encoders (or the VAE); a cache whose text encoder changed since is refused in one line
before anything is written, as are an existing cache without ``--overwrite`` and settings a cache
cannot keep. A tiny SDXL folder (two CLIPs, VAE latents, Euler; a UNet of one level) and 8
pictures of 20 x 16 with one undecodable file among them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from hypertron.config import load_config
from support.cli import one_error_line, run_cli  # tests/support

pytest.importorskip("diffusers")
CAPTIONS = ["a photo of a red cat", "a blue dog", "a cat", "red"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from PIL import Image

    from support.diffusion_folders import TINY_UNET, tiny_sdxl

    root = tmp_path_factory.mktemp("cache")  # one level of the UNet, with cross-attention: quick to compile
    folder, pipe = tiny_sdxl(root, TINY_UNET | {"block_out_channels": (32,), "down_block_types": ("CrossAttnDownBlock2D",),
                                                "up_block_types": ("CrossAttnUpBlock2D",)})
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(CAPTIONS[i % 4])
    (images / "8.png").write_bytes(b"not a png")
    (images / "8.txt").write_text("a dog")
    settings = [f"diffusion.model={folder}", "data.source=imagefolder", f"data.paths=[{images}]", "data.resolution=16",
                "diffusion.objective=auto", "diffusion.timesteps=uniform", "diffusion.cond_dropout=0.5",
                "diffusion.use_ema=false", "train.global_batch=8", "train.steps=2", "checkpoint.every=2",
                "monitor.collect=false", "train.eval_every=0", "task=diffusion",
                "train.lr=1e-3", "data.shuffle=true"]
    return root, folder, settings, pipe


def _losses(run, settings, *extra) -> tuple[list[float], str, object]:
    """The task's first two steps on one device (as the loop runs them), what it printed, and the
    trainer and its first batch."""
    import io

    import jax
    from rich.console import Console

    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.diffusion_task import DiffusionTask

    cfg = load_config(None, [f"run_dir={run}", *settings, *extra])
    task, said = DiffusionTask(), io.StringIO()
    task.check_inputs(cfg)
    trainer = task.trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    state, batches = task.initial_state(cfg, trainer, Console(file=said, soft_wrap=True)), task.batches(cfg)
    taken, losses = [next(batches) for _ in range(2)], []
    for batch in taken:
        state, metrics = task.step(trainer, state, batch)
        losses.append(float(metrics["loss"]))
    return losses, said.getvalue(), (trainer, taken[0])


def test_sdxl_conditioning_is_diffusers_and_cached_runs_take_the_uncached_losses(setup):
    import torch

    root, _, settings, pipe = setup
    want, _, (trainer, batch) = _losses(root / "plain", settings)
    from hypertron.diffusion.text_encoders import prompt_ids
    from hypertron.tokenizer import get_tokenizer

    ids = tuple(prompt_ids(get_tokenizer(str(setup[1] / name)), CAPTIONS, c.max_positions, bos=True)
                for name, c in zip(("tokenizer", "tokenizer_2"), trainer.cond.text_cfgs))
    ours = trainer.cond.text(trainer.frozen, ids)  # what the step encodes a batch's ids with
    captions = CAPTIONS
    with torch.no_grad():
        context, _, pooled, _ = pipe.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
    np.testing.assert_allclose(np.asarray(ours["context"]), context.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ours["pooled"]), pooled.numpy(), atol=1e-5)
    # 16 x 20 pictures: the short side to 16, so 16 x 20, the centre crop's left 2; target 16 x 16
    np.testing.assert_array_equal(batch["time_ids"], np.tile([16, 20, 0, 2, 16, 16], (8, 1)))
    for name, latents in (("text", "false"), ("latents", "true")):
        cache = [f"diffusion.cache_dir={root / name}", f"diffusion.cache_latents={latents}"]
        r = run_cli(["diffusion", "cache", *settings, *cache])
        assert r.rc == 0, r.describe()
        meta = json.loads((root / name / "cache.json").read_text())
        assert meta["records"] == 9 and meta["skipped"] == (1 if latents == "true" else 0), meta
        got, said, _ = _losses(root / f"run-{name}", settings, *cache)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
        line = next(t for t in said.splitlines() if "not loaded" in t)
        assert "the text encoder (" in line and "the text encoder 2 (" in line, line
        assert ("the vae" in line) == (latents == "true"), line


def test_a_stale_or_existing_cache_and_settings_a_cache_cannot_keep_are_one_line(setup, tmp_path, monkeypatch):
    from safetensors.numpy import load_file, save_file

    from hypertron.train import diffusion_cache as C

    root, folder, settings, _ = setup
    cache = [f"diffusion.cache_dir={tmp_path / 'cache'}"]
    assert run_cli(["diffusion", "cache", *settings, *cache]).rc == 0
    written = (tmp_path / "cache" / "cache.json").read_text()
    monkeypatch.setattr(C, "PER_SHARD", 4)  # the same records in shards of 4 (and 3 captions a call)
    monkeypatch.setattr(C, "TEXT_CHUNK", 3)
    assert run_cli(["diffusion", "cache", *settings, f"diffusion.cache_dir={tmp_path / 'sharded'}"]).rc == 0
    one, three = (json.loads((tmp_path / n / "cache.json").read_text()) for n in ("cache", "sharded"))
    assert (len(one["shards"]), len(three["shards"])) == (1, 3)
    a, b = C.Reader(tmp_path / "cache", one), C.Reader(tmp_path / "sharded", three)
    assert len(a) == len(b) == 9
    for i in range(9):
        assert a[i].keys() == b[i].keys() == {"context", "pooled"}
        np.testing.assert_allclose(b[i]["context"], a[i]["context"], rtol=1e-6, atol=1e-6)
    one_error_line(run_cli(["diffusion", "cache", *settings, *cache]), "holds a cache already (--overwrite replaces it)")
    assert (tmp_path / "cache" / "cache.json").read_text() == written

    changed = tmp_path / "changed"  # the same pipeline but one weight of the text encoder
    shutil.copytree(folder, changed)
    weights = changed / "text_encoder_2" / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, weights)
    run = tmp_path / "run"
    r = run_cli(["train", *settings, *cache, f"diffusion.model={changed}", f"run_dir={run}"])
    one_error_line(r, "stale, the text encoder 2's files changed since it was written")
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
