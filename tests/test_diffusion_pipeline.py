"""Diffusion pipelines: the folder loader's errors, the one compiled sampling program and
``hypertron diffuse`` (issue 39, points 5, 6 and 8).

The program's structure is checked with a stand-in denoiser (a tiny pure function) over a random
tiny VAE: one while loop holding the denoiser once, no compile for a repeated shape, and image i's
noise independent of its batch. The command runs in process on a tiny ``StableDiffusionPipeline``
folder written by diffusers (random weights, a hand-written CLIP vocabulary): end to end with
hypertron's UNet against diffusers' pipeline (DDIM, Euler, DPM-Solver++ 2M), and with diffusers' own
UNet as a stand-in (``pure_callback``) where only what surrounds the denoiser is the subject. Two
processes only where they are the subject: a second one loads its program from ``--compile-cache``.
"""

from __future__ import annotations

import dataclasses

import json
import sys
import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.diffusion import flux as F
from hypertron.diffusion import pipeline as P
from hypertron.diffusion import sampling
from hypertron.diffusion import schedulers as S
from hypertron.diffusion import unet as U
from hypertron.diffusion import vae as V
from hypertron.models.params import is_spec
from support import processes
from support.cli import one_error_line, run_cli  # tests/support
from support.diffusion_folders import tiny_sd

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _compiles.__setitem__(0, _compiles[0] + (event == _COMPILE_EVENT)))

TINY_VAE = V.VaeConfig(block_out_channels=(8,), layers_per_block=1, latent_channels=4, norm_num_groups=4)


def toy_denoiser(params, cfg, x_bhwc, timesteps_b, context_bsd, added=None):
    """A UNet's signature and nothing else: depends on each row's own latents, timestep and prompt."""
    shift_b = jnp.mean(context_bsd, axis=(1, 2)) + timesteps_b / 1000
    return jnp.tanh(x_bhwc * params["w"] + shift_b[:, None, None, None])


def _toy_pipeline(tmp_path) -> P.Pipeline:
    spec = P.PipelineSpec(folder=tmp_path, class_name=P.SD, kind=P.KINDS[P.SD],
                          scheduler=S.parse_config({"_class_name": "DDIMScheduler"}), vae=TINY_VAE,
                          denoiser_config={}, options={})
    rng = np.random.default_rng(1)  # numpy, not initialize: an eager draw per leaf compiles each
    vae_params = jax.tree.map(lambda spec: jnp.asarray(
        {"zeros": 0.0, "ones": 1.0}.get(spec.init, 0) + (spec.init == "normal") * spec.scale
        * rng.normal(size=spec.shape), jnp.float32), V.declare(TINY_VAE), is_leaf=is_spec)
    return P.Pipeline(spec=spec, text_encoders=(), tokenizers=(), denoiser_cfg=None,
                      denoiser_params={"w": jnp.full((4,), 0.5)}, vae_params=vae_params, dtype=jnp.float32,
                      denoise=toy_denoiser)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return _toy_pipeline(tmp_path_factory.mktemp("toy"))


def _cond(b: int, cfg: bool = True, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    cond = {"context": rng.normal(size=(b, 5, 8)).astype(np.float32)}
    if cfg:
        cond["negative_context"] = rng.normal(size=(b, 5, 8)).astype(np.float32)
    return cond


def _schedule(name: str, steps: int) -> S.Schedule:
    return S.make_schedule(S.parse_config({"_class_name": name}), steps)


def _args(pipe, name="DDIMScheduler", steps=3, b=2, seed=0):
    keys = sampling.image_keys(seed, b)
    latents = sampling.draw_latents(keys, (4, 8, 8))
    return (sampling.weights(pipe), _schedule(name, steps), _cond(b), latents, keys,
            jnp.full((b,), 7.5, jnp.float32), jnp.zeros((b,), jnp.float32))


def _primitives(jaxpr, in_scan=False):
    """(primitive name, whether inside a scan body) of every equation, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name, in_scan
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _primitives(sub, in_scan or eqn.primitive.name == "scan")


def test_program_is_one_loop_holding_the_denoiser_once(toy):
    """The whole sampling is one scan (one while loop in the lowered program) whose body calls the
    denoiser once, with the CFG rows batched ([2b, ...]); the VAE decode follows outside the loop."""
    prog = sampling.program(toy, (8, 8))
    args = _args(toy)
    names = list(_primitives(jax.make_jaxpr(prog.fn)(*args).jaxpr))
    assert [n for n, _ in names if n in ("scan", "while")] == ["scan"]
    assert [inside for n, inside in names if n == "tanh"] == [True]  # the denoiser, once, in the loop
    assert any(n == "conv_general_dilated" and not inside for n, inside in names)  # the decode, after it
    assert not any(n == "conv_general_dilated" and inside for n, inside in names)
    text = prog.fn.lower(*args).as_text()
    assert text.count("stablehlo.while") == 1
    assert "stablehlo.tanh" in text and "tensor<4x8x8x4xf32>" in text  # 2b rows of NHWC latents


def test_repeated_shape_compiles_nothing(toy):
    """A second request of the same size, batch, steps and scheduler, with other prompts, latents,
    seeds, guidance and schedule values, runs the compiled program; another step count compiles."""
    run = lambda args: jax.block_until_ready(sampling.program(toy, (8, 8)).fn(*args))  # noqa: E731
    run(_args(toy, seed=0))
    weights, schedule, cond, latents, keys, guidance, rescale = _args(toy, seed=3)
    other = S.make_schedule(S.parse_config({"_class_name": "DDIMScheduler", "timestep_spacing": "trailing"}), 3)
    args = (weights, other, _cond(2, seed=5), latents, keys, jnp.asarray([2.0, 9.0]), jnp.asarray([0.0, 0.7]))
    longer = _args(toy, steps=4)
    before = _compiles[0]
    run(args)
    assert _compiles[0] == before
    run(longer)
    assert _compiles[0] > before


def test_image_latents_do_not_depend_on_their_batch():
    """Image i of seed s draws from fold_in(key(s), i): alone or in a batch, the same initial latents
    (the same per-step noise of Euler ancestral: ``test_diffuse_writes_pngs...``)."""
    three = sampling.draw_latents(sampling.image_keys(7, 3), (4, 8, 8))
    alone = sampling.draw_latents(sampling.image_keys(7, 1, first=2), (4, 8, 8))
    np.testing.assert_array_equal(three[2], alone[0])
    assert not np.allclose(three[0], three[1])


def test_guidance_rescale_is_diffusers():
    """rescale_noise_cfg: std per image over all other axes (unbiased), mixed by guidance_rescale."""
    torch = pytest.importorskip("torch")
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

    rng = np.random.default_rng(0)
    guided, text = rng.normal(size=(2, 4, 3, 3)).astype(np.float32), rng.normal(size=(2, 4, 3, 3)).astype(np.float32)
    want = rescale_noise_cfg(torch.tensor(guided), torch.tensor(text), guidance_rescale=0.7).numpy()
    got = sampling.rescale_guidance(jnp.asarray(guided), jnp.asarray(text), jnp.full((2,), 0.7))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# A tiny StableDiffusionPipeline folder, written by diffusers


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    """``(folder, diffusers pipeline)``: :func:`support.diffusion_folders.tiny_sd`'s."""
    return tiny_sd(tmp_path_factory.mktemp("diffusion_pipeline"))


def _diffusers_unet_module(pipe) -> types.ModuleType:
    """A stand-in for ``hypertron.diffusion.unet`` that runs diffusers' own UNet on the host (through
    ``pure_callback``): the program around it is then held to diffusers' pipeline term by term."""
    import torch

    def host(x_bhwc, t_b, context_bsd):
        with torch.no_grad():
            out = pipe.unet(torch.from_numpy(np.array(x_bhwc)).permute(0, 3, 1, 2), torch.from_numpy(np.array(t_b)),
                            encoder_hidden_states=torch.from_numpy(np.array(context_bsd))).sample
        return out.permute(0, 2, 3, 1).numpy()

    def apply(params, cfg, x_bhwc, timesteps_b, context_bsd, added=None):
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x_bhwc.shape, jnp.float32), x_bhwc, timesteps_b,
                                 context_bsd)

    module = types.ModuleType("diffusers_unet")
    module.load_unet = lambda folder: (None, {})
    module.apply = apply
    return module


@pytest.fixture
def stand_in_unet(sd, monkeypatch):
    """The folder's UNet is diffusers' own, run on the host (hypertron's may not be there yet)."""
    monkeypatch.setitem(sys.modules, "diffusers_unet", _diffusers_unet_module(sd[1]))
    monkeypatch.setitem(P.DENOISERS, "UNet2DConditionModel", ("diffusers_unet", "load_unet"))


PROMPT, NEGATIVE = "a photo of a red cat", "blue dog"


def _diffusers_latents(pipe, latents, scheduler=None, steps=10):
    import torch

    folders_own = pipe.scheduler
    if scheduler is not None:
        pipe.scheduler = getattr(__import__("diffusers"), scheduler).from_config(pipe.scheduler.config)
    try:
        with torch.no_grad():
            n = len(latents)
            return pipe([PROMPT] * n, negative_prompt=[NEGATIVE] * n, latents=torch.from_numpy(latents),
                        num_inference_steps=steps, guidance_scale=7.5, output_type="latent").images.numpy()
    finally:
        pipe.scheduler = folders_own


@pytest.mark.parametrize("scheduler", [None, "EulerDiscreteScheduler", "DPMSolverMultistepScheduler"])
def test_diffuse_latents_are_diffusers(sd, tmp_path, scheduler):
    """End to end in JAX: ``hypertron diffuse --latents`` with hypertron's UNet read from the folder
    (CFG 7.5, a negative prompt, 10 steps; the folder's DDIM and, by ``--scheduler``, Euler with its
    init_noise_sigma and input scaling, and DPM-Solver++ 2M on a data=2 mesh) saves the final latents of diffusers'
    pipeline from the same initial latents (1e-3), and its PNGs are diffusers' decode of them (1 level
    on 99% of pixels)."""
    _check_latents_are_diffusers(sd, tmp_path, scheduler)


def _check_latents_are_diffusers(sd, tmp_path, scheduler):
    import torch
    from PIL import Image

    folder, pipe = sd
    initial = np.random.default_rng(0).normal(size=(2, 4, 8, 8)).astype(np.float32)
    np.save(tmp_path / "initial.npy", initial)
    argv = ["diffuse", "--model", folder, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--steps", "10",
            "--guidance", "7.5", "--latents", tmp_path / "initial.npy", "--save-latents", tmp_path / "final.npy",
            "--out", tmp_path / "img.png"] + (["--scheduler", scheduler] if scheduler else [])
    # DPM-Solver++ runs on a mesh: the command places the weights and splits the two images over data
    mesh = ["--mesh", "data=2"] if scheduler == "DPMSolverMultistepScheduler" else []
    r = run_cli(argv + mesh)
    assert r.rc == 0 and ("mesh data=2" in r.stdout) == bool(mesh), r.describe()
    want = _diffusers_latents(pipe, initial, scheduler)
    np.testing.assert_allclose(np.load(tmp_path / "final.npy"), want, atol=1e-3, rtol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final.npy", "img-0.png", "img-1.png", "initial.npy"]
    with torch.no_grad():
        pixels = pipe.vae.decode(torch.from_numpy(want) / pipe.vae.config.scaling_factor).sample
    for i, image in enumerate(pipe.image_processor.postprocess(pixels, output_type="pil")):
        with Image.open(tmp_path / f"img-{i}.png") as ours:
            off = np.abs(np.asarray(ours, np.int16) - np.asarray(image, np.int16))
        assert off.shape == (16, 16, 3) and np.mean(off <= 1) >= 0.99, off.max()


def test_diffuse_writes_pngs_and_a_seed_gives_the_same_bytes(sd, stand_in_unet, tmp_path):
    """``--batch 2`` writes STEM-0.png and STEM-1.png of the requested size; image 0 of seed 3 alone
    is the same image, with Euler ancestral's fresh noise at every step (drawn per image from its own
    key); the same request twice gives the same bytes; the timings are printed."""
    from PIL import Image

    common = ["diffuse", "--model", sd[0], "--prompt", PROMPT, "--steps", "3", "--seed", "3",
              "--scheduler", "EulerAncestralDiscreteScheduler"]
    r = run_cli(common + ["--batch", "2", "--out", "a.png"], cwd=tmp_path)
    assert r.rc == 0, r.describe()
    for word in ("load:", "encode:", "compile:", "s/step", "decode"):
        assert word in r.stdout, r.describe()
    r = run_cli(common + ["--out", "b.png"], cwd=tmp_path)
    assert r.rc == 0, r.describe()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-0.png", "a-1.png", "b.png"]
    a0, a1, b = (np.asarray(Image.open(tmp_path / name), np.int16) for name in ("a-0.png", "a-1.png", "b.png"))
    # the same image (alone, the programs round differently: within one level), not its neighbour
    assert np.abs(a0 - b).max() <= 1 and np.abs(a0 - a1).max() > 8, (np.abs(a0 - b).max(), np.abs(a0 - a1).max())
    assert a1.shape == (16, 16, 3)
    r = run_cli(common + ["--out", "c.png"], cwd=tmp_path)  # the same request again: the same bytes
    assert r.rc == 0 and (tmp_path / "c.png").read_bytes() == (tmp_path / "b.png").read_bytes(), r.describe()


def test_second_diffuse_process_hits_the_compile_cache(sd, tmp_path):
    """Two ``hypertron diffuse`` processes with one ``--compile-cache``: the first fills it, the
    second loads its program from it (JAX's cache-hit event; the folder gains no entry) and writes
    the first's bytes. The suite's own cache settings are dropped: the flag is the subject."""
    cache = tmp_path / "cache"
    env = processes.fast_compile(processes.hypertron_env(drop=("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE")))
    entries, outputs = [], []
    for name in ("a.png", "b.png"):
        r = processes.run_hypertron("diffuse", "--model", sd[0], "--prompt", PROMPT, "--steps", "3", "--out",
                                    tmp_path / name, "--compile-cache", cache, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        entries.append(sorted(p.name for p in cache.iterdir()))
        outputs.append(r.stdout)
    assert entries[0] and entries[1] == entries[0], entries
    assert "(from the persistent cache)" not in outputs[0] and "compile:" in outputs[0], outputs[0]
    assert "(from the persistent cache)" in outputs[1], outputs[1]
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def _folder_like(sd_folder, root, *, index=None, drop=(), replace=None):
    """A pipeline folder whose components link to ``sd_folder``'s, but ``drop`` ones and ``replace``
    ({component: {file: text}}), with ``index`` merged into its model_index.json."""
    root.mkdir()
    model_index = json.loads((sd_folder / P.MODEL_INDEX).read_text()) | (index or {})
    (root / P.MODEL_INDEX).write_text(json.dumps(model_index))
    for part in sd_folder.iterdir():
        if part.is_dir() and part.name not in drop and part.name not in (replace or {}):
            (root / part.name).symlink_to(part)
    for name, files in (replace or {}).items():
        (root / name).mkdir()
        for file, text in files.items():
            (root / name / file).write_text(text)
    return root


def _flux_folder(root):
    """A FluxPipeline folder's configs (no weights: its size checks come before any is read)."""
    index = {"_class_name": "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "vae": ["diffusers", "AutoencoderKL"], "transformer": ["diffusers", "FluxTransformer2DModel"],
             **{n: ["transformers", "X"] for n in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")}}
    root.mkdir()
    (root / P.MODEL_INDEX).write_text(json.dumps(index))
    for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
        (root / name).mkdir()
    configs = {"scheduler/scheduler_config.json": {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0,
                                                   "use_dynamic_shifting": True},
               "vae/config.json": {"_class_name": "AutoencoderKL", "block_out_channels": [8, 16], "norm_num_groups": 8,
                                   "down_block_types": ["DownEncoderBlock2D"] * 2,
                                   "up_block_types": ["UpDecoderBlock2D"] * 2, "latent_channels": 4},
               "transformer/config.json": {"_class_name": "FluxTransformer2DModel", "guidance_embeds": True}}
    for path, config in configs.items():
        (root / path).parent.mkdir(exist_ok=True)
        (root / path).write_text(json.dumps(config))
    return root


BAD_INPUT = {
    "no model_index.json": (lambda sd, tmp: ["--model", tmp], ["model_index.json", "not found"]),
    "unsupported class": (lambda sd, tmp: ["--model", _folder_like(sd, tmp / "m", index={
        "_class_name": "StableDiffusion3Pipeline"})], 
        ["StableDiffusion3Pipeline", "supported: StableDiffusionPipeline"]),
    "missing component": (lambda sd, tmp: ["--model", _folder_like(sd, tmp / "m", drop=("vae",))],
                          ["vae", "component folder not found"]),
    "bin-only weights": (lambda sd, tmp: ["--model", _folder_like(sd, tmp / "m", replace={"vae": {
        "config.json": (sd / "vae" / "config.json").read_text(), "diffusion_pytorch_model.bin": ""}})], [".bin"]),
    "unknown scheduler": (lambda sd, tmp: ["--model", sd, "--scheduler", "PNDMScheduler"],
                          ["PNDMScheduler", "not supported"]),
    "size": (lambda sd, tmp: ["--model", sd, "--height", "17"], ["height=17", "multiples of 2"]),
    "flux size": (lambda sd, tmp: ["--model", _flux_folder(tmp / "f"), "--width", "18"],
                  ["width=18", "multiples of 4"]),
    "flux negative prompt": (lambda sd, tmp: ["--model", _flux_folder(tmp / "f"), "--negative-prompt", "x"],
                             ["negative prompt"]),
    "steps": (lambda sd, tmp: ["--model", sd, "--steps", "0"], ["--steps"]),
    "latents shape": (lambda sd, tmp: ["--model", sd, "--latents", _npy(tmp / "l.npy", (1, 4, 4, 4))],
                      ["l.npy", "[batch, 4, 8, 8]"]),
    "dtype": (lambda sd, tmp: ["--model", sd, "--dtype", "float16"], ["float16", "supported: float32, bfloat16"]),
    "quantize": (lambda sd, tmp: ["--model", sd, "--quantize", "int4"], ["int4", "supported: none, int8, fp8"]),
    "text encoder quantize": (lambda sd, tmp: ["--model", sd, "--text-encoder-quantize", "fp8"],
                              ["text_encoder_quantize", "fp8", "supported: none, int8"]),
    "mesh": (lambda sd, tmp: ["--model", sd, "--mesh", "data=2,pipe=2"], ["data=2,pipe=2", "AXIS=N"]),
    "mesh devices": (lambda sd, tmp: ["--model", sd, "--mesh", "data=64"], ["needs 64 devices"]),
    "compile cache a file": (lambda sd, tmp: ["--model", sd, "--compile-cache", _npy(tmp / "cache", (1,))],
                             ["--compile-cache", "cache: not a directory"]),
    "lora missing": (lambda sd, tmp: ["--model", sd, "--lora", f"{tmp / 'none.safetensors'}:0.5"],
                     ["--lora", "no file", "none.safetensors"]),
    "lora of other modules": (lambda sd, tmp: ["--model", sd, "--lora", _lora_file(tmp / "l.safetensors")],
                              ["the denoiser has no down.proj_x to adapt", "to_out.0"]),
    "existing out": (lambda sd, tmp: ["--model", sd, "--batch", "2", "--out", tmp / "out.png",
                                      _npy(tmp / "out-1.png", (1,)) and "--seed", "1"], ["out-1.png", "exists"]),
}


def _lora_file(path):
    from safetensors.numpy import save_file

    save_file({f"unet.down.proj_x.lora_{p}.weight": np.zeros((4, 4), np.float32) for p in "AB"}, path)
    return path


def _npy(path, shape):
    with open(path, "wb") as f:  # a file object: np.save adds no .npy to the name
        np.save(f, np.zeros(shape, np.float32))
    return path


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_diffuse_refuses_bad_input(sd, tmp_path, case):
    """One ``error:`` line naming the problem, exit 2, nothing compiled and nothing written."""
    make, needles = BAD_INPUT[case]
    (tmp_path / "in").mkdir()
    extra = make(sd[0], tmp_path / "in")
    before = sorted((tmp_path / "in").rglob("*"))
    argv = ["diffuse", "--prompt", "a cat", "--out", tmp_path / "work" / "out.png", *extra]
    one_error_line(run_cli(argv, cwd=tmp_path / "work"), *needles)
    assert sorted((tmp_path / "in").rglob("*")) == before
    assert not any((tmp_path / "work").iterdir())  # nor the default --out


def test_flux_program_is_flux_pipelines(tmp_path):
    """Flux end to end in JAX, hypertron's transformer read from a folder (10 steps of flow-match Euler:
    the dynamic shift ``mu`` from the token count, sigmas, timesteps / 1000, embedded guidance), gives
    FluxPipeline's final latents from the same prompt embeddings and latents (1e-3), and its pixels
    (unpacked, unscaled, unshifted, decoded) FluxPipeline's within one level on 99%."""
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=24, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
                                  use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.5, shift_factor=0.1)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_image_seq_len=4,
                                                          max_image_seq_len=64, base_shift=0.5, max_shift=1.15)
    vae.save_pretrained(tmp_path / "vae")
    reference = diffusers.FluxPipeline(scheduler=scheduler, vae=vae, transformer=transformer, text_encoder=None,
                                       tokenizer=None, text_encoder_2=None, tokenizer_2=None)

    transformer.save_pretrained(tmp_path / "transformer")
    flux_cfg, flux_params = F.load_flux(tmp_path / "transformer")
    vae_cfg, vae_params = V.load_vae(tmp_path / "vae")
    spec = P.PipelineSpec(folder=tmp_path, class_name=P.FLUX, kind=P.KINDS[P.FLUX],
                          scheduler=S.parse_config(dict(scheduler.config), class_name=S.FLOW), vae=vae_cfg,
                          denoiser_config={"guidance_embeds": True}, options={})
    pipe = P.Pipeline(spec=spec, text_encoders=(), tokenizers=(), denoiser_cfg=flux_cfg, denoiser_params=flux_params,
                      vae_params=vae_params, dtype=jnp.float32, denoise=F.apply)
    rng = np.random.default_rng(0)
    cond = {"context": rng.normal(size=(2, 6, 32)).astype(np.float32),
            "pooled": rng.normal(size=(2, 24)).astype(np.float32)}
    latents = rng.normal(size=(2, *spec.latent_shape(16, 16))).astype(np.float32)  # [2, 16 tokens, 16]
    ours, images = sampling.sample(pipe, sampling.schedule_for(spec, 10, 16, 16), cond, latents,
                                   sampling.image_keys(0, 2), height=16, width=16, guidance=3.5)
    with torch.no_grad():
        want = reference(prompt_embeds=torch.from_numpy(cond["context"]), height=16, width=16,
                         pooled_prompt_embeds=torch.from_numpy(cond["pooled"]), latents=torch.from_numpy(latents),
                         num_inference_steps=10, guidance_scale=3.5, output_type="latent").images.numpy()
    np.testing.assert_allclose(np.asarray(ours), want, atol=1e-3, rtol=0)
    with torch.no_grad():  # FluxPipeline's decode: unpack, unscale, unshift
        z = reference._unpack_latents(torch.from_numpy(want), 16, 16, reference.vae_scale_factor)
        pixels = vae.decode(z / vae.config.scaling_factor + vae.config.shift_factor).sample
    want_images = np.stack([np.asarray(i) for i in reference.image_processor.postprocess(pixels, output_type="pil")])
    off = np.abs(np.asarray(images, np.int16) - want_images.astype(np.int16))
    assert images.shape == (2, 16, 16, 3) and np.mean(off <= 1) >= 0.99, off.max()
    # In bfloat16 the transformer computes in bfloat16 (it once ran float32 whatever the pipeline's
    # dtype): near the float32 latents, and not equal to them.
    half, _ = sampling.sample(dataclasses.replace(pipe, dtype=jnp.bfloat16), sampling.schedule_for(spec, 10, 16, 16),
                              cond, latents, sampling.image_keys(0, 2), height=16, width=16, guidance=3.5)
    rel = np.linalg.norm(np.asarray(half, np.float32) - ours) / np.linalg.norm(ours)
    assert 1e-4 < rel < 3e-2, rel


def test_sdxl_program_is_sdxl_pipelines(sd, tmp_path):
    """SDXL end to end in JAX, hypertron's UNet (``addition_embed_type="text_time"``) read from a
    folder: 10 Euler steps with the pooled embeddings and the (size, crop, size) time ids of both CFG
    rows beside the prompt embeddings give StableDiffusionXLPipeline's final latents (1e-3)."""
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8, norm_num_groups=8, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 24)
    folder, sd_pipe = sd
    reference = diffusers.StableDiffusionXLPipeline(
        vae=sd_pipe.vae, text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None, unet=unet,
        scheduler=diffusers.EulerDiscreteScheduler.from_config(sd_pipe.scheduler.config), add_watermarker=False)

    unet.save_pretrained(tmp_path / "unet")
    unet_cfg, unet_params = U.load_unet(tmp_path / "unet")
    base = P.read_pipeline(folder, "EulerDiscreteScheduler")
    spec = P.PipelineSpec(folder=folder, class_name=P.SDXL, kind=P.KINDS[P.SDXL], scheduler=base.scheduler,
                          vae=base.vae, denoiser_config={}, options={})
    pipe = P.Pipeline(spec=spec, text_encoders=(), tokenizers=(), denoiser_cfg=unet_cfg, denoiser_params=unet_params,
                      vae_params=V.load_vae(folder / "vae")[1], dtype=jnp.float32, denoise=U.apply)
    rng = np.random.default_rng(0)
    cond = {k: rng.normal(size=(2, 5, 32) if "context" in k else (2, 24)).astype(np.float32)
            for k in ("context", "negative_context", "pooled", "negative_pooled")}
    latents = rng.normal(size=(2, 4, 8, 8)).astype(np.float32)
    ours, _ = sampling.sample(pipe, sampling.schedule_for(spec, 10, 16, 16), cond, latents, sampling.image_keys(0, 2),
                              height=16, width=16, guidance=5.0)
    t = {k: torch.from_numpy(v) for k, v in cond.items()}
    with torch.no_grad():
        want = reference(prompt_embeds=t["context"], negative_prompt_embeds=t["negative_context"],
                         pooled_prompt_embeds=t["pooled"], negative_pooled_prompt_embeds=t["negative_pooled"],
                         latents=torch.from_numpy(latents), height=16, width=16, num_inference_steps=10,
                         guidance_scale=5.0, output_type="latent").images.numpy()
    np.testing.assert_allclose(np.asarray(ours), want, atol=1e-3, rtol=0)
