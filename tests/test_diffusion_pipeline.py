"""Diffusion pipelines: the folder loader's errors, the one compiled sampling program and
``hypertron diffuse`` (issue 39, points 5, 6 and 8).

The program is checked with a stand-in denoiser (a tiny pure function, so these run without the
UNet and Flux modules) over a random tiny VAE: one while loop holding the denoiser once, no compile
for a repeated shape, and image i's noise independent of its batch. The command runs in process on a
tiny ``StableDiffusionPipeline`` folder written by diffusers (random weights, a hand-written CLIP
vocabulary), its UNet replaced by the stand-in; the end-to-end parity against diffusers needs
``hypertron.diffusion.unet`` and is skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.diffusion import pipeline as P
from hypertron.diffusion import sampling
from hypertron.diffusion import schedulers as S
from hypertron.diffusion import vae as V
from hypertron.diffusion.errors import DiffusionError
from hypertron.models.params import is_spec
from support.cli import one_error_line, run_cli  # tests/support

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _compiles.__setitem__(0, _compiles[0] + (event == _COMPILE_EVENT)))

HAVE_UNET = importlib.util.find_spec("hypertron.diffusion.unet") is not None
TINY_VAE = V.VaeConfig(block_out_channels=(8,), layers_per_block=1, latent_channels=4, norm_num_groups=4)
WORDS = ["a", "photo", "of", "cat", "dog", "red", "blue"]
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def toy_denoiser(params, cfg, x_bhwc, timesteps_b, context_bsd, added=None):
    """A UNet's signature and nothing else: depends on each row's own latents, timestep and prompt."""
    shift_b = jnp.mean(context_bsd, axis=(1, 2)) + timesteps_b / 1000
    return jnp.tanh(x_bhwc * params["w"] + shift_b[:, None, None, None])


def _toy_module() -> types.ModuleType:
    """A stand-in for ``hypertron.diffusion.unet``: ``load_unet`` and ``apply``."""
    module = types.ModuleType("toy_unet")
    module.load_unet = lambda folder: (None, {"w": np.full((4,), 0.5, np.float32)})
    module.apply = toy_denoiser
    return module


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


def test_image_noise_does_not_depend_on_its_batch(toy):
    """Image i of seed s draws from fold_in(key(s), i): alone or in a batch, the same initial latents
    and (Euler ancestral's per-step noise) the same final latents and pixels."""
    shape = (4, 8, 8)
    three = sampling.draw_latents(sampling.image_keys(7, 3), shape)
    alone = sampling.draw_latents(sampling.image_keys(7, 1, first=2), shape)
    np.testing.assert_array_equal(three[2], alone[0])
    assert not np.allclose(three[0], three[1])
    schedule = _schedule("EulerAncestralDiscreteScheduler", 3)
    cond = _cond(3)
    out3 = sampling.sample(toy, schedule, cond, three, sampling.image_keys(7, 3), height=8, width=8, guidance=5.0)
    one = {k: v[2:] for k, v in cond.items()}
    out1 = sampling.sample(toy, schedule, one, alone, sampling.image_keys(7, 1, first=2), height=8, width=8,
                           guidance=5.0)
    np.testing.assert_allclose(out3[0][2], out1[0][0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out3[1][2], out1[1][0])
    assert out3[1].shape == (3, 8, 8, 3) and out3[1].dtype == jnp.uint8


def test_guidance_rescale_is_diffusers():
    """rescale_noise_cfg: std per image over all other axes (unbiased), mixed by guidance_rescale."""
    torch = pytest.importorskip("torch")
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

    rng = np.random.default_rng(0)
    guided, text = rng.normal(size=(2, 4, 3, 3)).astype(np.float32), rng.normal(size=(2, 4, 3, 3)).astype(np.float32)
    want = rescale_noise_cfg(torch.tensor(guided), torch.tensor(text), guidance_rescale=0.7).numpy()
    got = sampling.rescale_guidance(jnp.asarray(guided), jnp.asarray(text), jnp.full((2,), 0.7))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_flux_packing_is_diffusers():
    """Unpacking Flux's [b, tokens, 4c] and its image ids equal FluxPipeline's (as NHWC)."""
    torch = pytest.importorskip("torch")
    from diffusers import FluxPipeline

    x = np.random.default_rng(0).normal(size=(2, 4 * 3, 16)).astype(np.float32)  # h=8, w=6 latents, c=4
    want = FluxPipeline._unpack_latents(torch.tensor(x), 64, 48, 8).numpy()
    np.testing.assert_array_equal(V.to_nchw(np.asarray(sampling.flux_unpack(jnp.asarray(x), 8, 6))), want)
    ids = FluxPipeline._prepare_latent_image_ids(1, 4, 3, "cpu", torch.float32).numpy()
    np.testing.assert_array_equal(sampling.flux_image_ids(8, 6), ids)
