"""``hypertron diffuse``'s work: a request checked before anything is loaded, then load, encode,
compile, sample and decode (one program), and PNGs written without overwriting anything.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import time
from collections.abc import Callable
from typing import Any
from pathlib import Path

import jax
import numpy as np

from hypertron.config.numbers import shown
from hypertron.config.schema import DIFFUSION_DTYPE
from hypertron.diffusion import placement, sampling
from hypertron.diffusion.errors import DiffusionError
from hypertron.diffusion.lora import lora_argument
from hypertron.diffusion.pipeline import PipelineSpec, read_pipeline
from hypertron.diffusion.sampling import schedule_for

@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffuseRequest:
    """One ``hypertron diffuse`` run. None: the pipeline's default (diffusers')."""

    model: str
    prompt: str
    out: str
    negative_prompt: str | None = None
    steps: int | None = None
    guidance: float | None = None
    height: int | None = None
    width: int | None = None
    batch: int | None = None
    seed: int = 0
    latents: str | None = None  # a .npy of initial latents, diffusers' layout
    save_latents: str | None = None
    scheduler: str | None = None
    dtype: str = DIFFUSION_DTYPE  # one of placement.DTYPES
    quantize: str = "none"  # the denoiser's matmuls: one of placement.QUANTIZE
    text_encoder_quantize: str = "none"  # the text encoders' matmuls: one of placement.TEXT_QUANTIZE
    mesh: str | None = None  # "data=2,fsdp=2": images over data, weights by the rules; None: one device
    max_sequence_length: int = 512
    lora: str | None = None  # FILE[:SCALE]: a diffusers LoRA file merged into the denoiser (scale 1 by default)


def output_paths(out: str | Path, count: int) -> list[Path]:
    """The PNGs of ``count`` images: ``out`` itself for one, ``STEM-0.png`` .. ``STEM-{count-1}.png``
    beside it for more."""
    out = Path(out)
    if count == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{i}{out.suffix or '.png'}") for i in range(count)]


def _refuse_existing(paths: list[Path]) -> None:
    for path in paths:
        if path.exists():
            raise DiffusionError(f"{path} exists: hypertron diffuse never overwrites a file")
        if not path.parent.is_dir():
            raise DiffusionError(f"{path}: no directory {path.parent}")


def _initial_latents(req: DiffuseRequest, shape: tuple[int, ...]) -> np.ndarray | None:
    """The ``--latents`` file's array [b, *shape] (float32), checked; None without one."""
    if req.latents is None:
        return None
    try:
        latents = np.load(req.latents, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DiffusionError(f"{req.latents}: not a readable .npy file ({e})") from None
    if latents.ndim != len(shape) + 1 or tuple(latents.shape[1:]) != shape or latents.shape[0] < 1:
        raise DiffusionError(f"{req.latents}: latents of shape {list(latents.shape)}, expected "
                             f"[batch, {', '.join(map(str, shape))}] for this model and size")
    if req.batch is not None and latents.shape[0] != req.batch:
        raise DiffusionError(f"{req.latents}: holds {latents.shape[0]} latents, but the batch is {req.batch}")
    if not np.issubdtype(latents.dtype, np.floating) or not np.isfinite(latents).all():
        raise DiffusionError(f"{req.latents}: latents must be finite floating-point numbers")
    return latents.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class _Plan:
    spec: PipelineSpec
    steps: int
    guidance: float
    height: int
    width: int
    latents: np.ndarray | None
    paths: list[Path]
    mesh: Any  # a jax Mesh, or None
    lora: tuple[Path, float] | None  # the LoRA file and its scale


def check_request(req: DiffuseRequest) -> _Plan:
    """Everything about ``req`` that can be checked before a weight is read or a program compiled."""
    if req.dtype not in placement.DTYPES:
        raise DiffusionError(f"dtype={shown(req.dtype)} is not supported (supported: "
                             f"{', '.join(placement.DTYPES)})")
    if req.quantize not in placement.QUANTIZE:
        raise DiffusionError(f"quantize={shown(req.quantize)} is not supported (supported: "
                             f"{', '.join(placement.QUANTIZE)})")
    if req.text_encoder_quantize not in placement.TEXT_QUANTIZE:
        raise DiffusionError(f"text_encoder_quantize={shown(req.text_encoder_quantize)} is not supported "
                             f"(supported: {', '.join(placement.TEXT_QUANTIZE)})")
    mesh = placement.mesh_of(req.mesh)
    spec = read_pipeline(req.model, req.scheduler)
    steps = spec.kind.steps if req.steps is None else req.steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise DiffusionError(f"steps={shown(steps)}: must be at least 1")
    if req.batch is not None and req.batch < 1:
        raise DiffusionError(f"batch={shown(req.batch)}: must be at least 1")
    if spec.is_flux and req.negative_prompt is not None:
        raise DiffusionError(f"{spec.class_name} takes no negative prompt (it has no classifier-free guidance)")
    height = spec.default_size() if req.height is None else req.height
    width = spec.default_size() if req.width is None else req.width
    shape = spec.latent_shape(height, width)
    latents = _initial_latents(req, shape)
    count = latents.shape[0] if latents is not None else (req.batch or 1)
    paths = output_paths(req.out, count)
    _refuse_existing(paths + ([Path(req.save_latents)] if req.save_latents else []))
    schedule_for(spec, steps, height, width)  # steps within the scheduler's range
    guidance = spec.kind.guidance if req.guidance is None else req.guidance
    lora = None if req.lora is None else lora_argument(req.lora)
    return _Plan(spec, steps, float(guidance), height, width, latents, paths, mesh, lora)


def png_bytes(image_hwc: np.ndarray) -> bytes:
    """One uint8 image [h, w, 3] as PNG bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.asarray(image_hwc, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _write_new(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:  # never overwrite, even a file that appeared while sampling
        f.write(data)


@functools.cache
def _cache_hits() -> list[int]:
    """A counter of JAX's persistent-cache hits in this process (its listener is added once)."""
    hits = [0]
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.__setitem__(0, hits[0] + (event == "/jax/compilation_cache/cache_hits")))
    return hits


def diffuse(req: DiffuseRequest, log: Callable[[str], None] = print) -> list[Path]:
    """Run ``req``: the PNGs written (and ``--save-latents``'s file), timings through ``log``."""
    plan = check_request(req)
    start = time.perf_counter()
    pipe = placement.load_placed(plan.spec, dtype=req.dtype, quantize_mode=req.quantize,
                                 text_quantize=req.text_encoder_quantize, mesh=plan.mesh, lora=plan.lora)
    log(f"load: {time.perf_counter() - start:.2f} s ({placement.described(pipe)})")
    count = len(plan.paths)
    start = time.perf_counter()
    args = jax.block_until_ready(sampling.request_args(
        pipe, req.prompt, req.negative_prompt, count=count, seed=req.seed, steps=plan.steps, guidance=plan.guidance,
        height=plan.height, width=plan.width, latents=plan.latents, max_sequence_length=req.max_sequence_length))
    log(f"encode: {time.perf_counter() - start:.2f} s")
    pipe = dataclasses.replace(pipe, text_encoders=())  # one request: their weights (T5-XXL's GBs) go now
    # the step timer is a host callback, and JAX's persistent cache keeps no program holding one
    timed = not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir
    program = sampling.program(pipe, sampling.latent_hw(plan.spec, plan.height, plan.width), timed=timed)
    hits, start = _cache_hits()[0], time.perf_counter()
    compiled = program.fn.lower(*args).compile()
    cached = " (from the persistent cache)" if _cache_hits()[0] > hits else ""
    log(f"compile: {time.perf_counter() - start:.2f} s{cached}")
    start = time.perf_counter()
    final, images = jax.block_until_ready(compiled(*args))
    end = time.perf_counter()
    what = f"{plan.steps} steps, {count} image{'s' if count > 1 else ''}"
    if timed:
        steps_done = program.marks[-1]
        log(f"sample: {(steps_done - start) / plan.steps:.4f} s/step ({what}); decode: {end - steps_done:.3f} s")
    else:
        log(f"sample and decode: {end - start:.3f} s, {(end - start) / plan.steps:.4f} s/step with the decode ({what})")
    written = []
    if req.save_latents:
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(final))
        _write_new(Path(req.save_latents), buffer.getvalue())
        written.append(Path(req.save_latents))
    for path, image in zip(plan.paths, np.asarray(images)):
        _write_new(path, png_bytes(image))
        written.append(path)
    log("wrote " + ", ".join(map(str, written)))
    return written
