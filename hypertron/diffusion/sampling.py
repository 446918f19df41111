"""Text to pixels for a loaded :class:`~hypertron.diffusion.pipeline.Pipeline`, as the diffusers
pipelines compute it.

* :func:`encode_prompts`: prompts to the denoiser's conditioning (SD's CLIP states; SDXL's pair and
  pooled projection; Flux's T5 states and CLIP pooled output), negatives beside them for CFG.
* :func:`image_keys` and :func:`draw_latents`: image ``i`` of a request with seed ``s`` draws from
  ``fold_in(key(s), i)``, so an image does not depend on what else shares its batch.
* :func:`sample`: the one compiled program from conditioning and initial latents to the final
  latents and uint8 images: a ``lax.scan`` over the schedule's steps (denoiser, CFG, scheduler
  step), then the VAE decode. The pipeline, the image size, the batch, the step count and the
  scheduler class are its static part (one compile each); weights, schedule values, prompts,
  latents, keys and guidance are traced.

Latents cross this module's boundary in diffusers' layout (what a diffusers pipeline takes as
``latents=`` and returns with ``output_type="latent"``): ``[b, c, h, w]`` for UNet pipelines and
packed ``[b, tokens, 4c]`` for Flux; inside, UNet latents are NHWC.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.diffusion import flux as F
from hypertron.diffusion import schedulers as S
from hypertron.diffusion import vae as V
from hypertron.diffusion.pipeline import FLUX, SDXL, Pipeline, PipelineSpec
from hypertron.diffusion.text_encoders import clip_encode, prompt_ids, sd_prompt_embeds, sdxl_prompt_embeds, t5_encode
from hypertron.parallel.rules import DEFAULT_RULES, constrain, use_rules
from hypertron.quant import einsum_for

_clip = jax.jit(clip_encode, static_argnums=1, static_argnames="quantization")
_t5 = jax.jit(t5_encode, static_argnums=1, static_argnames="quantization")
# Flux's default T5 length (FluxPipeline's max_sequence_length)
FLUX_MAX_SEQUENCE_LENGTH = 512


# ---------------------------------------------------------------------------
# Prompts


def _clip_out(pipe: Pipeline, which: int, prompts: Sequence[str]):
    encoder, tokenizer = pipe.text_encoders[which], pipe.tokenizers[which]
    ids = prompt_ids(tokenizer, list(prompts), encoder.cfg.max_positions, bos=True)
    return _clip(encoder.params, encoder.cfg, jnp.asarray(ids), quantization=encoder.quantize)


def _halves(x: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    return x[:n], x[n:]


def encode_prompts(pipe: Pipeline, prompts: Sequence[str], negative: Sequence[str] | None = None, *,
                   cfg: bool = True, max_sequence_length: int = FLUX_MAX_SEQUENCE_LENGTH) -> dict[str, jax.Array]:
    """The conditioning of ``prompts`` (one per image): ``context`` [b, s, d] and, for SDXL and Flux,
    ``pooled`` [b, p]; with ``cfg`` (UNet pipelines), ``negative_context`` (and ``negative_pooled``)
    of ``negative`` (default: empty prompts; SDXL's zeros when its ``force_zeros_for_empty_prompt``),
    as diffusers' ``encode_prompt``."""
    spec, n = pipe.spec, len(prompts)
    if spec.class_name == FLUX:
        encoder, tokenizer = pipe.text_encoders[1], pipe.tokenizers[1]
        ids = prompt_ids(tokenizer, list(prompts), max_sequence_length, bos=False)
        return {"context": _t5(encoder.params, encoder.cfg, jnp.asarray(ids), quantization=encoder.quantize),
                "pooled": _clip_out(pipe, 0, prompts).pooled_bd}
    zeros = spec.class_name == SDXL and negative is None and spec.options.get("force_zeros_for_empty_prompt", True)
    texts = list(prompts) + (list(negative or [""] * n) if cfg and not zeros else [])
    first = _clip_out(pipe, 0, texts)
    if spec.class_name == SDXL:
        context, pooled = sdxl_prompt_embeds(first, _clip_out(pipe, 1, texts))
    else:
        encoder = pipe.text_encoders[0]
        context, pooled = sd_prompt_embeds(first, encoder.params, encoder.cfg), None
    out = {"context": context[:n]}
    if pooled is not None:
        out["pooled"] = pooled[:n]
    if cfg:
        out["negative_context"] = jnp.zeros_like(out["context"]) if zeros else context[n:]
        if pooled is not None:
            out["negative_pooled"] = jnp.zeros_like(out["pooled"]) if zeros else pooled[n:]
    return out


# ---------------------------------------------------------------------------
# Randomness


def image_keys(seed: int, count: int, first: int = 0) -> jax.Array:
    """The keys of images ``first .. first + count - 1`` of a request with ``seed``: ``fold_in(key(seed), i)``."""
    return _image_keys(jnp.uint32(seed), jnp.arange(first, first + count, dtype=jnp.uint32))


@jax.jit
def _image_keys(seed, indices_b):
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(indices_b)


def _split(keys_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each image's key for its initial latents and for its per-step noise."""
    return jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys_b), jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys_b)


def draw_latents(keys_b: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Unit Gaussian initial latents [b, *shape] (float32, diffusers' layout), row i from key i."""
    return _draw(keys_b, tuple(shape))


@functools.partial(jax.jit, static_argnums=1)
def _draw(keys_b: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.vmap(lambda k: jax.random.normal(k, shape, jnp.float32))(_split(keys_b)[0])


# ---------------------------------------------------------------------------
# The program


def rescale_guidance(guided: jax.Array, conditional: jax.Array, rescale: jax.Array) -> jax.Array:
    """diffusers' ``rescale_noise_cfg`` (Lin et al. 2023, 3.4): the guided prediction scaled to the
    conditional one's standard deviation (per image, unbiased), mixed in by ``rescale`` [b]."""
    axes = tuple(range(1, guided.ndim))
    ratio = jnp.std(conditional, axis=axes, keepdims=True, ddof=1) / jnp.std(guided, axis=axes, keepdims=True, ddof=1)
    r = rescale.reshape((-1,) + (1,) * len(axes))
    return jnp.where(r > 0, r * guided * ratio + (1 - r) * guided, guided)


def _time_ids(spec: PipelineSpec, height: int, width: int, rows: int) -> jax.Array:
    """SDXL's micro-conditioning [rows, 6]: original size, crop top-left, target size (diffusers'
    defaults: the image's size, no crop, the image's size)."""
    return jnp.tile(jnp.asarray([[height, width, 0, 0, height, width]], jnp.float32), (rows, 1))


def _hook(pipe: Pipeline, dtype: Any) -> dict:
    """The denoiser's ``einsum`` argument for ``--quantize fp8`` (the fp8 hook in ``dtype``, what the
    model computes in); none otherwise: the model's plain hook, which multiplies int8 weights
    (:class:`~hypertron.quant.QArray`) as int8 whatever its mode."""
    return {"einsum": einsum_for("fp8", dtype)} if pipe.quantize == "fp8" else {}


def _by_image(x: jax.Array) -> jax.Array:
    """``x`` pinned to the ``batch`` axes on its first axis (one image per row); identity off a mesh."""
    return constrain(x, ("batch",) + (None,) * (x.ndim - 1))


def _unet_output(pipe: Pipeline, params: Any, x_bhwc: jax.Array, t: jax.Array, cond: dict, guidance_b, rescale_b,
                 pixels: tuple[int, int]) -> jax.Array:
    """The UNet's prediction for ``x``; with CFG, both rows in one call, then guided (and rescaled)."""
    b, cfg = x_bhwc.shape[0], "negative_context" in cond
    context = jnp.concatenate([cond["negative_context"], cond["context"]]) if cfg else cond["context"]
    x_in = jnp.concatenate([x_bhwc, x_bhwc]) if cfg else x_bhwc
    rows = x_in.shape[0]
    added = None
    if pipe.spec.class_name == SDXL:
        pooled = jnp.concatenate([cond["negative_pooled"], cond["pooled"]]) if cfg else cond["pooled"]
        added = {"text_embeds": pooled.astype(pipe.dtype), "time_ids": _time_ids(pipe.spec, *pixels, rows)}
    out = pipe.denoise(params, pipe.denoiser_cfg, x_in.astype(pipe.dtype), jnp.full((rows,), t, jnp.float32),
                       context.astype(pipe.dtype), added, **_hook(pipe, pipe.dtype)).astype(jnp.float32)
    if not cfg:
        return out
    uncond, text = out[:b], out[b:]
    guided = uncond + guidance_b.reshape(b, 1, 1, 1) * (text - uncond)
    return rescale_guidance(guided, text, rescale_b)


def _flux_output(pipe: Pipeline, params: Any, x_btc: jax.Array, t: jax.Array, cond: dict, guidance_b,
                 latent_hw: tuple[int, int]) -> jax.Array:
    """The Flux transformer's prediction (embedded guidance when the model has it; no CFG rows)."""
    b = x_btc.shape[0]
    guidance = guidance_b.astype(jnp.float32) if pipe.spec.guidance_embeds else None
    txt_ids = jnp.zeros((cond["context"].shape[1], 3), jnp.float32)
    out = pipe.denoise(params, pipe.denoiser_cfg, x_btc.astype(pipe.dtype), jnp.full((b,), t / 1000, jnp.float32),
                       cond["context"].astype(pipe.dtype), cond["pooled"].astype(pipe.dtype), guidance,
                       jnp.asarray(F.latent_image_ids(latent_hw[0] // 2, latent_hw[1] // 2)), txt_ids,
                       **_hook(pipe, pipe.dtype), dtype=pipe.dtype)
    return out.astype(jnp.float32)


def schedule_for(spec: PipelineSpec, steps: int, height: int, width: int) -> S.Schedule:
    """The pipeline's schedule of ``steps`` steps for an image of ``height`` x ``width`` pixels: Flux's
    sigmas ``linspace(1, 1/steps, steps)``, shifted by the image's token count (FluxPipeline's ``mu``)."""
    if not spec.is_flux:
        return S.make_schedule(spec.scheduler, steps)
    tokens = spec.latent_shape(height, width)[0]
    sigmas = np.linspace(1.0, 1 / steps, steps) if isinstance(steps, int) and steps >= 1 else None
    return S.make_schedule(spec.scheduler, steps, image_seq_len=tokens, sigmas=sigmas)


@dataclasses.dataclass(frozen=True)
class Program:
    """The compiled sampling program of one pipeline and latent size (jit compiles it once per batch,
    step count, scheduler class and CFG or not). ``marks``: with ``timed``, the host time at which
    each run's last step was done (its decode followed)."""

    fn: Any
    marks: list


def program(pipe: Pipeline, latent_hw: tuple[int, int], *, timed: bool = False) -> Program:
    """The pipeline's :class:`Program` for latents of ``latent_hw`` (cached on the pipeline).

    ``fn(weights, schedule, cond, latents, keys_b, guidance_b, rescale_b) -> (latents, images)``:
    ``weights`` is :func:`weights`, ``cond`` :func:`encode_prompts`'s, ``latents`` initial latents in
    diffusers' layout (before ``init_noise_sigma``), ``keys_b`` the images' keys (Euler ancestral's
    noise), ``guidance_b`` / ``rescale_b`` [b] float32 per image. Returns the final latents (diffusers'
    layout, float32) and the images [b, H, W, 3] uint8."""
    key = (tuple(latent_hw), timed)
    if key not in pipe.programs:
        marks: list[float] = []
        run = functools.partial(_run, pipe, tuple(latent_hw), (lambda _: marks.append(time.perf_counter())) if timed
                                else None)
        pipe.programs[key] = Program(jax.jit(run if pipe.mesh is None else _under_rules(pipe, run)), marks)
    return pipe.programs[key]


def _under_rules(pipe: Pipeline, run):
    """``run`` traced under the placed pipeline's mesh and rules (its ``constrain`` pins apply)."""
    def ruled(*args):
        with use_rules(pipe.mesh, pipe.rules or DEFAULT_RULES):
            return run(*args)
    return ruled


def weights(pipe: Pipeline) -> dict[str, Any]:
    """What the program reads of the pipeline's parameters (traced, never baked in)."""
    return {"denoiser": pipe.denoiser_params, "vae": pipe.vae_params}


def _run(pipe: Pipeline, latent_hw, mark, weights, schedule: S.Schedule, cond, latents, keys_b, guidance_b,
         rescale_b):
    """The program: the scan over the steps, then the VAE decode (see :func:`program`)."""
    spec, flux = pipe.spec, pipe.spec.is_flux
    x = _by_image((latents if flux else V.from_nchw(latents)).astype(jnp.float32) * schedule.init_noise_sigma)
    cond = jax.tree.map(_by_image, cond)
    noise_keys = _split(keys_b)[1]
    pixels = tuple(n * spec.vae_scale_factor for n in latent_hw)

    def step(carry, i):
        x, state = carry
        t = schedule.timesteps[i]
        x_in = schedule.scale_model_input(x, i)
        if flux:
            out = _flux_output(pipe, weights["denoiser"], x_in, t, cond, guidance_b, latent_hw)
        else:
            out = _unet_output(pipe, weights["denoiser"], x_in, t, cond, guidance_b, rescale_b, pixels)
        noise = None
        if schedule.needs_noise:
            noise = jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, i), x.shape[1:], x.dtype))(noise_keys)
        state, x = schedule.step(state, out, i, x, noise)
        return (x, state), None

    (x, _), _ = jax.lax.scan(step, (x, schedule.init_state(x)), jnp.arange(schedule.num_steps))
    if mark is not None:
        jax.debug.callback(mark, x[:1, :1])
    if spec.vae is None:  # a pixel pipeline: the denoised tensor is the images
        images = x
    else:
        z_bhwc = _by_image(V.latents_to_vae(spec.vae, V.from_nchw(F.unpack_latents(x, *latent_hw)) if flux else x))
        images = _by_image(V.decode(weights["vae"], spec.vae, z_bhwc, dtype=pipe.dtype))
    return (x if flux else V.to_nchw(x)), V.to_uint8(images)


def latent_hw(spec: PipelineSpec, height: int, width: int) -> tuple[int, int]:
    """The latent grid of an image of ``height`` x ``width`` pixels (checked: see ``latent_shape``)."""
    spec.latent_shape(height, width)
    return height // spec.vae_scale_factor, width // spec.vae_scale_factor


def uses_cfg(spec: PipelineSpec, guidance: float) -> bool:
    """Whether images at ``guidance`` run classifier-free guidance's rows: above 1, UNet pipelines
    (Flux's guidance, if any, is embedded). Static in the program: one compile each way."""
    return not spec.is_flux and guidance > 1


def prompt_cond(pipe: Pipeline, prompt: str, negative_prompt: str | None, *, cfg: bool,
                max_sequence_length: int = FLUX_MAX_SEQUENCE_LENGTH) -> dict[str, jax.Array]:
    """:func:`encode_prompts`' conditioning of one prompt (one row); a request's images repeat it,
    as diffusers' ``num_images_per_prompt`` does."""
    negative = None if negative_prompt is None else [negative_prompt]
    return encode_prompts(pipe, [prompt], negative, cfg=cfg, max_sequence_length=max_sequence_length)


@dataclasses.dataclass(frozen=True)
class Rows:
    """One request's rows of :func:`program`'s per-image arguments: ``cond`` (as
    :func:`encode_prompts`'), initial ``latents`` (diffusers' layout), ``keys`` and ``guidance`` [b]."""

    cond: dict
    latents: jax.Array
    keys: jax.Array
    guidance: jax.Array


def request_rows(pipe: Pipeline, cond: dict[str, jax.Array], *, count: int, seed: int, guidance: float, height: int,
                 width: int, latents: np.ndarray | None = None) -> Rows:
    """``count`` images of one prompt's one-row ``cond`` (:func:`prompt_cond`'s): image i's noise from
    ``fold_in(key(seed), i)`` unless ``latents`` are given (diffusers' layout)."""
    keys = image_keys(seed, count)
    if latents is None:
        latents = draw_latents(keys, pipe.spec.latent_shape(height, width))
    return Rows(jax.tree.map(lambda a: jnp.repeat(a, count, axis=0), cond), jnp.asarray(latents, jnp.float32), keys,
                jnp.full((count,), guidance, jnp.float32))


def batch_args(pipe: Pipeline, rows: Sequence[Rows], *, steps: int, height: int, width: int,
               size: int | None = None) -> tuple:
    """:func:`program`'s arguments for the images of ``rows`` (requests of one size, step count and
    CFG or not), in order, padded to ``size`` rows (default: none) by repeating the last row: a
    padded row's image is dropped, and each row's image is its own whatever shares its batch."""
    def joined(*parts):
        x = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        pad = (size or x.shape[0]) - x.shape[0]
        return x if pad <= 0 else x[jnp.concatenate([jnp.arange(x.shape[0]), jnp.full((pad,), x.shape[0] - 1)])]

    cond = jax.tree.map(joined, *[r.cond for r in rows])
    latents, keys, guidance = (joined(*[getattr(r, f) for r in rows]) for f in ("latents", "keys", "guidance"))
    return (weights(pipe), schedule_for(pipe.spec, steps, height, width), cond, latents, keys, guidance,
            jnp.zeros(guidance.shape, jnp.float32))


def request_args(pipe: Pipeline, prompt: str, negative_prompt: str | None, *, count: int, seed: int, steps: int,
                 guidance: float, height: int, width: int, latents: np.ndarray | None = None,
                 max_sequence_length: int = FLUX_MAX_SEQUENCE_LENGTH) -> tuple:
    """:func:`program`'s arguments for ``count`` images of one prompt (``hypertron diffuse``'s; the
    image server batches :func:`request_rows` of several): CFG by :func:`uses_cfg`."""
    cond = prompt_cond(pipe, prompt, negative_prompt, cfg=uses_cfg(pipe.spec, guidance),
                       max_sequence_length=max_sequence_length)
    rows = request_rows(pipe, cond, count=count, seed=seed, guidance=guidance, height=height, width=width,
                        latents=latents)
    return batch_args(pipe, [rows], steps=steps, height=height, width=width)


def sample(pipe: Pipeline, schedule: S.Schedule, cond: dict[str, jax.Array], latents: jax.Array, keys_b: jax.Array,
           *, height: int, width: int, guidance: float | Sequence[float],
           guidance_rescale: float | Sequence[float] = 0.0) -> tuple[jax.Array, jax.Array]:
    """Final latents (diffusers' layout) and uint8 images [b, height, width, 3] from initial ``latents``
    (diffusers' layout, before ``init_noise_sigma``), by the pipeline's compiled :func:`program`."""
    b = latents.shape[0]
    guidance_b = jnp.broadcast_to(jnp.asarray(guidance, jnp.float32), (b,))
    rescale_b = jnp.broadcast_to(jnp.asarray(guidance_rescale, jnp.float32), (b,))
    fn = program(pipe, latent_hw(pipe.spec, height, width)).fn
    return fn(weights(pipe), schedule, cond, jnp.asarray(latents, jnp.float32), keys_b, guidance_b, rescale_b)
