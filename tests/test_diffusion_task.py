"""``task: diffusion`` on the training loop: the shapes demo learns its prompts' colours (and not
without its prompts), a run killed with SIGKILL resumes to an uninterrupted one's losses bit for
bit with its EMA, the final ``RUN/model`` is a pipeline folder ``hypertron diffuse`` loads, and bad configs
are one line before anything is written. On 8 simulated CPU devices; the preset's UNet is
0.36M parameters."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

from hypertron.checkpoint import MANIFEST
from hypertron.config import load_config
from hypertron.diffusion import shapes
from hypertron.diffusion.pipeline import PIXEL, load_pipeline
from hypertron.train.loop import FAULT_DATA_DELAY, train
from support import processes, runs  # tests/support
from support.cli import one_error_line, run_cli  # tests/support

ROOT = Path(__file__).parent.parent
RECIPE = ROOT / "recipes" / "cpu" / "diffusion-shapes.yaml"
QUIET = ["monitor.collect=false", "train.eval_every=0"]
# A process on one CPU device, compiled fast (its steps are few and tiny; the three processes compile alike).
ONE_DEVICE = processes.fast_compile(processes.hypertron_env(
    JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace("device_count=8", "device_count=1")))


def _cfg(run: Path, *overrides: str):
    return load_config(RECIPE, [f"run_dir={run}", *QUIET, *overrides])


def test_the_shapes_demo_learns_its_prompts_colour(tmp_path, one_device):
    """The recipe's model, trained briefly (80 steps of 8 pictures, on one device as the demo runs:
    on the 8 simulated devices each step took longer, twice as long over fsdp), draws the prompt's
    colour in at least 90 % of 24 samples, and with the prompt embeddings zeroed in at most 60 % (the prompt decides it).
    The run leaves RUN/model, our pixel pipeline, its EMA weights. (The shape needs the recipe's
    2,800 steps, about 5 minutes: bench/diffusion_shapes.py, docs/benchmarks.md.) Compiled at the
    suite's least effort and sampled in 10 steps (the bench's 25 gave the same counts): alone, 37 s
    of training and 9 of sampling against 54 and 12 optimised with the suite's CPU emitters."""
    run = tmp_path / "run"
    result = train(_cfg(run, "train.steps=80", "train.global_batch=8", "checkpoint.every=80"))
    assert result.losses[-1] < result.losses[0] / 4
    index = json.loads((run / "model" / "model_index.json").read_text())
    assert index["_class_name"] == PIXEL
    pipe = load_pipeline(run / "model")
    score = shapes.score(pipe, per_prompt=4, steps=10)
    zeroed = shapes.score(pipe, per_prompt=4, steps=10, zero_prompts=True)
    assert score.colour >= 0.9 * score.total, score
    assert zeroed.colour <= 0.6 * zeroed.total, zeroed


@pytest.mark.slow
def test_a_run_killed_after_checkpoint_6_resumes_to_the_uninterrupted_losses_and_ema(tmp_path):
    """Real ``hypertron train`` processes on the recipe (one device, as the demo runs): 12 steps
    straight; then 12 with SIGKILL once checkpoint 6 is final, and again, resuming at 6: the same 12
    losses to the bit, and the same EMA weights in RUN/model (test_resume.py's kill, on this task's
    state: parameters, optimizer, EMA and data position)."""
    common = [str(RECIPE), *QUIET, "train.steps=12", "checkpoint.every=6", "train.log_every=1",
              "train.global_batch=8", "diffusion.ema.decay=0.9"]
    cmd = lambda run: processes.hypertron_argv("train", *common, f"run_dir={run}")  # noqa: E731
    straight = processes.run(cmd(tmp_path / "a"), env=ONE_DEVICE)
    assert straight.returncode == 0, straight.stderr
    run = tmp_path / "b"
    killed = processes.start(cmd(run), env={**ONE_DEVICE, FAULT_DATA_DELAY: "*:0.5"})
    try:
        processes.wait_for(lambda: (run / "checkpoints" / "6" / MANIFEST).exists(), killed, "checkpoint 6 became final")
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert not (run / "checkpoints" / "12").exists(), "the run finished before the kill; steps too fast"
    finally:
        processes.kill(killed)
    resumed = processes.run(cmd(run), env=ONE_DEVICE)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step 6" in resumed.stderr
    want, got = runs.losses(tmp_path / "a"), runs.losses(run)
    assert sorted(want) == sorted(got) == list(range(1, 13))
    assert [got[s] for s in range(1, 13)] == [want[s] for s in range(1, 13)]  # exact float equality
    a, b = (load_pipeline(r / "model").denoiser_params for r in (tmp_path / "a", run))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_lora_on_a_flux_folder_trains_adapters_alone_and_diffusers_loads_the_export(tmp_path, one_device):
    """A tiny Flux-dev folder (T5 and CLIP, VAE latents packed 2 x 2, flow matching, embedded
    guidance) fine-tuned with ``lora.rank`` over its transformer held int8 (QLoRA-style) for 2 steps on pictures read from files (an
    undecodable one counted in ``data_skipped``): the checkpoints hold the adapters alone,
    RUN/lora holds diffusers' file of them (``transformer.`` + the double and single blocks'
    ``attn.to_q`` / ``to_k`` / ``to_v`` and the double blocks' ``attn.to_out.0``, diffusers' Flux
    LoRA scripts' targets), and RUN/model's transformer is the base's with them merged (every
    weight they do not cover the base's to the bit, every one they cover the base's plus their
    product, 1e-6). diffusers' ``FluxPipeline.from_pretrained`` loads RUN/model, and from the same
    initial latents it gives ``hypertron diffuse``'s final latents (1e-3)."""
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    from PIL import Image

    from hypertron.diffusion import flux as F
    from hypertron.diffusion import lora as DL
    from hypertron.models import lora as L
    from support.diffusion_folders import tiny_flux

    folder, _ = tiny_flux(tmp_path)
    images = tmp_path / "images"  # 8 pictures captioned by sidecars, and one not a picture
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(["a photo of a red cat", "a blue dog"][i % 2])
    (images / "8.png").write_bytes(b"not a png")
    (images / "8.txt").write_text("a cat")
    run = tmp_path / "run"
    result = train(_cfg(run, f"diffusion.model={folder}", "data.source=imagefolder", f"data.paths=[{images}]",
                        "data.resolution=16", "diffusion.max_sequence_length=16", "train.global_batch=8",
                        "train.steps=2", "checkpoint.every=2", "lora.rank=4", "lora.alpha=8", "lora.base_dtype=int8",
                        "diffusion.use_ema=false", "train.lr=1e-2"))
    assert result.rows[-1]["data_skipped"] >= 1  # counted, not fatal
    assert result.losses[-1] < 10, result.losses
    saved = json.loads((run / "checkpoints" / "2" / "params" / "_METADATA").read_text())["tree_metadata"]
    assert saved and all(key.rsplit("'", 2)[-2] in ("a", "b") for key in saved), list(saved)[:3]  # adapters only
    from hypertron.parallel.mesh import make_mesh
    from hypertron.quant import QArray
    from hypertron.train.diffusion import make_diffusion_trainer

    held = make_diffusion_trainer(_cfg(tmp_path / "other", f"diffusion.model={folder}", "lora.rank=4",
                                       "lora.base_dtype=int8", "data.source=imagefolder", f"data.paths=[{images}]"),
                                  make_mesh(_cfg(tmp_path / "other").mesh, jax.devices()[:1]), folder, "flow")
    q = held.frozen["denoiser"]["single"]["q"]["w"]  # the base the adapters trained over: int8 matmul weights
    assert isinstance(q, QArray) and q.values.dtype == np.int8, type(q)
    cfg, base = F.load_flux(folder / "transformer")
    adapters, settings = DL.load_lora(run / "lora", F.declare_flux(cfg), "transformer")
    found = L.targets(F.declare_flux(cfg), settings.targets)
    from safetensors import safe_open  # the file's modules: every Linear of diffusers' model PEFT would match

    with safe_open(run / "lora" / DL.LORA_FILE, "np") as f:
        modules = {k[len("transformer."):-len(".lora_A.weight")] for k in f.keys() if k.endswith(".lora_A.weight")}
    reference = diffusers.FluxTransformer2DModel.from_pretrained(folder / "transformer")
    want_modules = {n for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)
                    and any(n == t or n.endswith("." + t) for t in DL.UNET_TARGETS)}
    assert modules == want_modules and len(modules) == 7, (modules, want_modules)
    assert (settings.rank, settings.alpha) == (4, 8.0)
    assert all(np.abs(np.asarray(b)).max() > 0 for b in jax.tree.leaves(adapters) if b.shape[0] == 4)  # B trained
    _, tuned = F.load_flux(run / "model" / "transformer")
    want = L.merge(base, adapters, settings)
    adapted = {t.path for t in found}
    for path, got in jax.tree_util.tree_leaves_with_path(tuned):
        keys = tuple(getattr(k, "key", k) for k in path)
        if keys in adapted:
            np.testing.assert_allclose(np.asarray(got), np.asarray(_leaf(want, keys)), atol=1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(_leaf(base, keys)))

    initial = rng.normal(size=(1, 16, 16)).astype(np.float32)  # packed: 4 x 4 tokens of 4 channels x 2 x 2
    np.save(tmp_path / "initial.npy", initial)
    r = run_cli(["diffuse", "--model", run / "model", "--prompt", "a photo of a red cat", "--steps", "3",
                 "--max-sequence-length", "16", "--height", "16", "--width", "16", "--latents", tmp_path / "initial.npy",
                 "--save-latents", tmp_path / "final.npy", "--out", tmp_path / "img.png"])
    assert r.rc == 0, r.describe()
    theirs = diffusers.FluxPipeline.from_pretrained(run / "model")
    with torch.no_grad():
        expect = theirs("a photo of a red cat", latents=torch.from_numpy(initial), num_inference_steps=3, height=16,
                        width=16, max_sequence_length=16, output_type="latent").images.numpy()
    np.testing.assert_allclose(np.load(tmp_path / "final.npy"), expect, atol=1e-3, rtol=0)


def test_an_sd_folder_fine_tuned_3_steps_is_a_folder_diffusers_loads(tmp_path, one_device):
    """Issue 44's export point: a tiny SD folder (VAE latents, DDIM, epsilon; a UNet of one level)
    fine-tuned in full for 3 steps writes a RUN/model that diffusers'
    ``StableDiffusionPipeline.from_pretrained`` loads, and from the same initial latents it gives
    ``hypertron diffuse``'s final latents (1e-3); its UNet is no longer the base's."""
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    from PIL import Image

    from hypertron.diffusion import unet as U
    from support.diffusion_folders import TINY_UNET, tiny_sd

    folder, _ = tiny_sd(tmp_path, TINY_UNET | {"block_out_channels": (32,), "down_block_types": ("CrossAttnDownBlock2D",),
                                               "up_block_types": ("CrossAttnUpBlock2D",)})  # one level: quick to compile
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(1)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(["a photo of a red cat", "a blue dog"][i % 2])
    run = tmp_path / "run"
    train(_cfg(run, f"diffusion.model={folder}", "data.source=imagefolder", f"data.paths=[{images}]",
               "data.resolution=16", "diffusion.timesteps=uniform", "train.global_batch=4", "train.steps=3",
               "checkpoint.every=3", "diffusion.use_ema=false", "train.lr=1e-2"))
    _, base = U.load_unet(folder / "unet")
    _, tuned = U.load_unet(run / "model" / "unet")
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(tuned)))
    initial = rng.normal(size=(1, 4, 8, 8)).astype(np.float32)
    np.save(tmp_path / "initial.npy", initial)
    r = run_cli(["diffuse", "--model", run / "model", "--prompt", "a photo of a red cat", "--steps", "3",
                 "--latents", tmp_path / "initial.npy", "--save-latents", tmp_path / "final.npy",
                 "--out", tmp_path / "img.png"])
    assert r.rc == 0, r.describe()
    theirs = diffusers.StableDiffusionPipeline.from_pretrained(run / "model")
    with torch.no_grad():
        expect = theirs("a photo of a red cat", latents=torch.from_numpy(initial), num_inference_steps=3,
                        output_type="latent").images.numpy()
    np.testing.assert_allclose(np.load(tmp_path / "final.npy"), expect, atol=1e-3, rtol=0)


def _leaf(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


@pytest.mark.parametrize("overrides,message", [
    (["diffusion.objective=epsilon"], "objective epsilon does not fit the model's FlowMatchEulerDiscreteScheduler"),
    (["diffusion.ema.decay=1.5"], "diffusion.ema.decay=1.5: must be in (0, 1)"),
    (["diffusion.cond_dropout=1"], "diffusion.cond_dropout=1.0: must be in [0, 1)"),
    (["data.resolution=48"], "data.resolution=48: the shapes source draws 32 x 32 pictures"),
    (["diffusion.weighting=min_snr"], "weighting min_snr does not fit objective flow"),
    (["diffusion.model=nowhere"], "diffusion.model=nowhere: neither a diffusers folder nor a preset"),
    (["data.source=imagefolder", "data.paths=nowhere"], "nowhere"),
    (["train.init_from=somewhere"], "train.init_from: task=diffusion starts from diffusion.model"),
    (["lora.rank=4", "lora.targets=[q_proj]"], "the denoiser has no q_proj to adapt"),
    (["diffusion.dynamic_shift=true", "diffusion.shift=3"], "diffusion.shift=3.0 and diffusion.dynamic_shift: one"),
])
def test_bad_configs_are_one_line_and_write_nothing(tmp_path, overrides, message):
    run = tmp_path / "run"
    r = run_cli(["train", str(RECIPE), f"run_dir={run}", *QUIET, *overrides])
    one_error_line(r, message)
    assert not run.exists()


def test_plan_refuses_a_diffusion_config_in_one_line():
    """The planner counts a decoder: on a diffusion recipe it planned the config's unused language
    model (a wrong answer, exit 0), so it refuses the task until it plans a denoiser."""
    one_error_line(run_cli(["plan", str(RECIPE)]), "task=diffusion: hypertron plan does not plan a diffusion denoiser")


def test_one_step_on_each_mesh_is_the_single_devices(tmp_path):
    """One step's loss and gradient (``DiffusionTrainer.gradients``: what the step computes) of a
    small pixel UNet from the same state and batch: on 8 devices as (data=8), (fsdp=8) and (fsdp=4,
    tensor=2) the single device's, the loss within 1e-5 relative and every gradient within 1e-5 of
    its tensor's largest magnitude (a gradient that vanishes analytically, a bias before a GroupNorm, within
    1e-7 of the largest gradient's); the weights sharded as the rules say (a conv kernel's output
    channels over fsdp, an attention projection's heads over tensor)."""
    import dataclasses

    from hypertron.diffusion.folders import SHAPES_UNET, write_preset
    from hypertron.diffusion.text_encoders import prompt_ids
    from hypertron.parallel.mesh import make_mesh
    from hypertron.tokenizer import get_tokenizer
    from hypertron.train.diffusion import make_diffusion_trainer

    folder = tmp_path / "preset"  # 2 levels of 8 and 16 channels, cross-attention in the second: quick to compile
    small = SHAPES_UNET.unet | {"sample_size": 8, "block_out_channels": [8, 16],
                                "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                                "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"]}
    write_preset(folder, dataclasses.replace(SHAPES_UNET, unet=small), 0)
    rng = np.random.default_rng(0)
    captions = [f"a {c} {s}" for c in shapes.COLOURS for s in shapes.SHAPES][:8] * 2
    local = {"pixels": rng.uniform(-1, 1, (8, 8, 8, 3)).astype(np.float32),
             "ids": prompt_ids(get_tokenizer(str(folder / "tokenizer")), captions[:8], 8, bos=True)}

    def gradients(sizes: str):
        axes = {"data": 1, "fsdp": 1} | {k: int(v) for k, v in (a.split("=") for a in sizes.split(",") if a)}
        cfg = _cfg(tmp_path / "run", "train.global_batch=8", "diffusion.cond_dropout=0.3",
                   *[f"mesh.{k}={v}" for k, v in axes.items()])
        devices = jax.devices()[:int(np.prod(list(axes.values())))]
        trainer = make_diffusion_trainer(cfg, make_mesh(cfg.mesh, devices), folder, "flow")
        loss, grads = trainer.gradients(trainer.initial()["params"], local, step=3)
        return trainer, float(loss), jax.device_get(grads)

    _, want_loss, want = gradients("")
    floor = 1e-2 * max(np.abs(w).max() for w in jax.tree.leaves(want))  # a bias before a GroupNorm: 0 but rounding
    for mesh in ("data=8", "fsdp=8", "fsdp=4,tensor=2"):
        trainer, loss, grads = gradients(mesh)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=mesh)
        for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, atol=1e-5 * max(np.abs(w).max(), floor), rtol=0, err_msg=f"{mesh} {path}")
        spec = trainer.state_shardings["params"]
        if "fsdp" in mesh:
            assert "fsdp" in str(spec["conv_in"]["w"].spec), spec["conv_in"]["w"].spec
        if "tensor" in mesh:
            assert "tensor" in str(jax.tree.leaves(spec["down"])), spec["down"]
