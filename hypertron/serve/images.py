"""``POST /v1/images/generations`` over a diffusers pipeline folder (``model_index.json``): what
``hypertron serve --model DIR`` serves for such a folder instead of the text server.

The API key, the error shape (``param`` naming the field), ``GET /health``, ``/v1/models`` and
``/metrics`` are the text server's (:mod:`hypertron.serve.server`'s helpers). A request has OpenAI's
``model`` (optional: the model served), ``prompt``, ``n``, ``size`` (``"WxH"``, one of ``--sizes``;
default the first) and ``response_format`` (``b64_json`` only: this server keeps no files to link),
and the extensions ``negative_prompt``, ``num_inference_steps``, ``guidance_scale`` (defaults: the
diffusers pipeline's, the steps at most ``--max-steps``) and ``seed`` (default: a random one). The
answer is ``{"created", "data": [{"b64_json"}]}``, PNGs. Image i of a request is ``hypertron
diffuse``'s image i for the same seed and settings: both build the program's rows with
:func:`hypertron.diffusion.sampling.request_rows` and run the pipeline's one compiled program.

Requests of one size, step count and CFG on/off that wait together (one arrives while a batch runs,
or several at once) run as one program call of at most ``--max-batch`` images (each request's ``n``
count), with per-row guidance, negative prompt and seed, padded to the next of
:func:`batch_sizes` (powers of two, and ``--max-batch``) so that compiles stay bounded. A row's
image does not depend on its batch beyond rounding (within one uint8 level). At start each
``--sizes`` size is compiled (and run once) for each batch size at the default steps (at most
``--max-steps``) and guidance; another step count or CFG on/off compiles on its first request.
The text encoders' outputs are kept per prompt (``--embedding-cache`` entries, LRU).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import dataclasses
import logging
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from hypertron.config import ServeConfig
from hypertron.config.numbers import shown
from hypertron.config.schema import DIFFUSION_DTYPE
from hypertron.config.serving import IMAGE_DEFAULTS
from hypertron.diffusion import placement, sampling
from hypertron.diffusion.errors import DiffusionError
from hypertron.diffusion.generate import png_bytes
from hypertron.diffusion.pipeline import Pipeline, PipelineSpec, read_pipeline
from hypertron.serve.api import HEALTH_RESPONSES, METRICS_RESPONSES, ApiError, ModelCard, ModelList, _Strict, responses
from hypertron.serve.metrics import ImageMetrics
from hypertron.serve.model import served_name
from hypertron.serve.api import read_request
from hypertron.serve.server import DEFAULT_MAX_BODY_BYTES, add_error_handlers, authorizer, run

log = logging.getLogger(__name__)


class ImageRequest(_Strict):
    """``POST /v1/images/generations``."""

    model: str | None = None
    prompt: str
    n: int | None = Field(None, ge=1)
    size: str | None = Field(None, description="WxH, one of the sizes this server serves")
    response_format: str | None = Field(None, description="b64_json (url is refused)")
    negative_prompt: str | None = Field(None, description="extension: CFG's unconditional prompt (UNet pipelines)")
    num_inference_steps: int | None = Field(None, ge=1, description="extension: sampling steps")
    guidance_scale: float | None = Field(None, ge=0, description="extension: CFG scale, or Flux-dev's guidance")
    seed: int | None = Field(None, ge=0, le=2**32 - 1, description="extension: image i draws from "
                                                                     "fold_in(key(seed), i)")


class ImageData(BaseModel):
    b64_json: str


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]


def parse_size(text: str) -> tuple[int, int] | None:
    """``"WxH"`` as (width, height); None for anything else."""
    w, sep, h = text.strip().lower().partition("x")
    return (int(w), int(h)) if sep and w.isdigit() and h.isdigit() else None


def served_sizes(spec: PipelineSpec, sizes: str | None) -> list[tuple[int, int]]:
    """``--sizes`` (``"WxH,WxH"``) as (width, height) pairs the model takes; None: its default size.
    A malformed or unusable size is a :class:`DiffusionError` naming it."""
    if sizes is None:
        side = spec.default_size()
        return [(side, side)]
    out = []
    for item in sizes.split(","):
        size = parse_size(item)
        if size is None:
            raise DiffusionError(f"sizes={shown(sizes)}: {shown(item)} is not WxH (e.g. 512x512)")
        try:
            spec.latent_shape(size[1], size[0])
        except DiffusionError as e:
            raise DiffusionError(f"sizes={shown(sizes)}: {e}") from None
        out.append(size)
    return list(dict.fromkeys(out))


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a server compiles (its buckets): the powers of two below ``max_batch``, and
    ``max_batch``; a batch of fewer images is padded to the next one (at most ``log2(max_batch) + 2``
    compiles per size, step count and CFG or not)."""
    return tuple(sorted({1 << k for k in range(max_batch.bit_length()) if 1 << k < max_batch} | {max_batch}))


@dataclasses.dataclass(frozen=True)
class ImageJob:
    """One checked request: ``n`` images of ``prompt`` (image i from ``fold_in(key(seed), i)``)."""

    prompt: str
    negative: str | None
    n: int
    seed: int
    steps: int
    guidance: float
    width: int
    height: int
    cfg: bool  # classifier-free guidance's rows (sampling.uses_cfg)

    @property
    def group(self) -> tuple:
        """What jobs sharing a program call have in common (its static part)."""
        return (self.width, self.height, self.steps, self.cfg)


def next_batch(pending: Sequence[ImageJob], max_rows: int) -> list[int]:
    """The indices of the ``pending`` jobs (oldest first) that the next program call runs: the
    oldest, then in order each later one of its group whose images still fit in ``max_rows``."""
    group, rows, picked = pending[0].group, 0, []
    for i, job in enumerate(pending):
        if job.group == group and rows + job.n <= max_rows:
            picked.append(i)
            rows += job.n
    return picked


class PromptCache:
    """The text encoders' output per (prompt, negative prompt, max_sequence_length, CFG or not), least
    recently used dropped past ``capacity`` entries (0: nothing kept)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: tuple, make: Callable[[], Any]) -> tuple[Any, bool]:
        """(the value of ``key``, whether it was cached), made by ``make()`` on a miss."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key], True
        value = make()
        if self.capacity > 0:
            self._entries[key] = value
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return value, False


class ImageServer:
    """The pipeline, its limits, and the thread that runs its batches.

    Requests (:class:`ImageJob`) wait in arrival order; the thread runs the oldest with every other
    waiting one of its size, step count and CFG or not, up to ``max_batch`` images, as one program
    call padded to the next of :func:`batch_sizes` (per-row guidance, negative prompt and seed).
    ``running`` is held while a batch runs."""

    def __init__(self, pipe: Pipeline, model_name: str, *, sizes: list[tuple[int, int]], max_batch: int,
                 max_steps: int, embedding_cache: int = IMAGE_DEFAULTS["embedding_cache"]):
        self.pipe, self.model_name, self.sizes = pipe, model_name, sizes
        self.max_batch, self.max_steps = max_batch, max_steps
        self.batch_sizes = batch_sizes(max_batch)
        self.metrics = ImageMetrics()
        self.created = int(time.time())
        self.prompts = PromptCache(embedding_cache)
        self.running = threading.Lock()
        self._pending: list[tuple[ImageJob, concurrent.futures.Future]] = []
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="image-batches", daemon=True)
        self._thread.start()

    @property
    def default_steps(self) -> int:
        """A request's steps when it names none: the diffusers pipeline's, at most ``max_steps``."""
        return min(self.pipe.spec.kind.steps, self.max_steps)

    @property
    def prompt_tokens(self) -> int:
        """The prompt tokens the model reads (Flux: T5's, else CLIP's)."""
        if self.pipe.spec.is_flux:
            return sampling.FLUX_MAX_SEQUENCE_LENGTH
        return self.pipe.text_encoders[0].cfg.max_positions

    def pending(self) -> int:
        """Requests waiting for a batch."""
        with self._wake:
            return len(self._pending)

    def submit(self, job: ImageJob) -> concurrent.futures.Future:
        """A future of ``job``'s ``n`` images, uint8 [n, height, width, 3]."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the image server is closed")
            self._pending.append((job, future))
            self._wake.notify()
        return future

    def images(self, job: ImageJob) -> list[bytes]:
        """``job``'s PNGs, as ``hypertron diffuse`` makes them (waits for its batch)."""
        return [png_bytes(image) for image in self.submit(job).result()]

    def close(self) -> None:
        """Stop the batch thread once the batch it runs is done (waiting requests fail)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        for _, future in self._pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the image server closed"))

    def _loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
            with self.running:
                batch = self._take_batch()
                if batch:
                    self._run(batch)

    def _take_batch(self) -> list[tuple[ImageJob, concurrent.futures.Future]]:
        """The next batch's requests (:func:`next_batch`), out of the waiting ones and marked running;
        a request whose client went away (its future cancelled) is dropped."""
        with self._wake:
            self._pending = [p for p in self._pending if not p[1].cancelled()]
            if not self._pending:
                return []
            picked = set(next_batch([job for job, _ in self._pending], self.max_batch))
            batch = [p for i, p in enumerate(self._pending) if i in picked]
            self._pending = [p for i, p in enumerate(self._pending) if i not in picked]
        return [(job, future) for job, future in batch if future.set_running_or_notify_cancel()]

    def _run(self, batch: list[tuple[ImageJob, concurrent.futures.Future]]) -> None:
        try:
            images = self._sample([job for job, _ in batch])
        except BaseException as e:  # each request of the batch answers it
            for _, future in batch:
                future.set_exception(e)
            return
        start = 0
        for job, future in batch:
            future.set_result(images[start:start + job.n])
            start += job.n

    def _cond(self, job: ImageJob) -> dict:
        """``job``'s one-row conditioning, from the prompt cache or the text encoders."""
        length = sampling.FLUX_MAX_SEQUENCE_LENGTH
        cond, hit = self.prompts.get(
            (job.prompt, job.negative, length, job.cfg),
            lambda: sampling.prompt_cond(self.pipe, job.prompt, job.negative, cfg=job.cfg, max_sequence_length=length))
        self.metrics.prompt_cache.labels(result="hit" if hit else "miss").inc()
        return cond

    def _sample(self, jobs: list[ImageJob]) -> np.ndarray:
        """The images of ``jobs`` (one group), in order: one program call."""
        first, real = jobs[0], sum(job.n for job in jobs)
        size = next(b for b in self.batch_sizes if b >= real)
        rows = [sampling.request_rows(self.pipe, self._cond(job), count=job.n, seed=job.seed, guidance=job.guidance,
                                      height=job.height, width=job.width) for job in jobs]
        args = sampling.batch_args(self.pipe, rows, steps=first.steps, height=first.height, width=first.width,
                                   size=size)
        fn = sampling.program(self.pipe, sampling.latent_hw(self.pipe.spec, first.height, first.width)).fn
        _, images = fn(*args)
        images = np.asarray(images)[:real]
        self.metrics.batches.inc()
        self.metrics.batch_rows.labels(kind="real").inc(real)
        self.metrics.batch_rows.labels(kind="padded").inc(size - real)
        return images

    def warm(self) -> None:
        """Compile (and run once) each size for each of :func:`batch_sizes` at the default steps and
        guidance."""
        kind = self.pipe.spec.kind
        for width, height in self.sizes:
            start = time.perf_counter()
            for n in self.batch_sizes:
                self.images(ImageJob("", None, n, 0, self.default_steps, kind.guidance, width, height,
                                     sampling.uses_cfg(self.pipe.spec, kind.guidance)))
            print(f"hypertron serve: {width}x{height} compiled for {', '.join(map(str, self.batch_sizes))} "
                  f"image(s) in {time.perf_counter() - start:.1f} s", file=sys.stderr)

    def check(self, req: ImageRequest) -> ImageJob:
        """``req`` as a job, or a 400 naming the field."""
        if req.response_format not in (None, "b64_json"):
            raise ApiError(400, f"'response_format' {req.response_format!r} is not supported: this server "
                                "answers b64_json only", param="response_format")
        if not req.prompt.strip():
            raise ApiError(400, "'prompt' is empty", param="prompt")
        n = 1 if req.n is None else req.n
        if n > self.max_batch:
            raise ApiError(400, f"'n' is {n}; this server makes at most {self.max_batch} image(s) a request",
                           param="n")
        size = self.sizes[0] if req.size is None else parse_size(req.size)
        if size not in self.sizes:
            served = ", ".join(f"{w}x{h}" for w, h in self.sizes)
            raise ApiError(400, f"'size' {req.size!r} is not served (served: {served})", param="size")
        spec = self.pipe.spec
        steps = self.default_steps if req.num_inference_steps is None else req.num_inference_steps
        if steps > self.max_steps:
            raise ApiError(400, f"'num_inference_steps' is {steps}; this server takes at most {self.max_steps}",
                           param="num_inference_steps")
        try:
            sampling.schedule_for(spec, steps, size[1], size[0])
        except DiffusionError as e:
            raise ApiError(400, f"'num_inference_steps': {e}", param="num_inference_steps") from None
        if spec.is_flux and req.negative_prompt is not None:
            raise ApiError(400, f"'negative_prompt': {spec.class_name} takes none", param="negative_prompt")
        guidance = spec.kind.guidance if req.guidance_scale is None else req.guidance_scale
        seed = secrets.randbelow(2**32) if req.seed is None else req.seed
        return ImageJob(req.prompt, req.negative_prompt, n, seed, steps, float(guidance), size[0], size[1],
                        sampling.uses_cfg(spec, guidance))


def create_app(server: ImageServer, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app of ``server`` (compiled already: see :meth:`ImageServer.warm`)."""
    app = FastAPI(title="hypertron images", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = server.metrics

    async def generations(request: Request):
        req = await read_request(request, ImageRequest, max_body_bytes, server.model_name)
        job = server.check(req)
        start = time.perf_counter()
        try:
            images = await asyncio.wrap_future(server.submit(job))
            pngs = await asyncio.to_thread(lambda: [png_bytes(image) for image in images])
        except BaseException:
            metrics.requests.labels(status="error").inc()
            raise
        metrics.latency.observe(time.perf_counter() - start)
        metrics.requests.labels(status="ok").inc()
        metrics.images.inc(len(pngs))
        data = [ImageData(b64_json=base64.b64encode(png).decode("ascii")) for png in pngs]
        return ImagesResponse(created=int(time.time()), data=data).model_dump()

    async def models():  # max_model_len: the prompt tokens the model reads
        card = ModelCard(id=server.model_name, created=server.created, max_model_len=server.prompt_tokens)
        return ModelList(data=[card]).model_dump()

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorizer(api_key))])
    v1.add_api_route("/images/generations", generations, methods=["POST"], summary="Make images from a prompt",
                     responses=responses(ImagesResponse))
    v1.add_api_route("/models", models, methods=["GET"], summary="The model served")
    app.include_router(v1)

    @app.get("/health", summary="Liveness", responses=HEALTH_RESPONSES)
    async def health():
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", summary="Prometheus text", responses=METRICS_RESPONSES)
    async def metrics_text():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_error_handlers(app)
    return app


def build(serve: ServeConfig) -> FastAPI:
    """The app of ``serve.checkpoint``, a diffusers folder: loaded (``--dtype``, ``--quantize``,
    ``--mesh`` as ``hypertron diffuse``'s), its sizes compiled. ``app.state.images`` is its
    :class:`ImageServer`."""
    mesh = placement.mesh_of(serve.mesh)  # the mesh and sizes checked before a weight is read
    spec = read_pipeline(serve.checkpoint)
    sizes = served_sizes(spec, serve.sizes)
    pipe = placement.load_placed(spec, dtype=serve.dtype or DIFFUSION_DTYPE, quantize_mode=serve.quantize,
                                 text_quantize=serve.text_encoder_quantize or "none", mesh=mesh)
    print(f"hypertron serve: {placement.described(pipe)}", file=sys.stderr)
    server = ImageServer(pipe, serve.model_name or served_name(serve.checkpoint), sizes=sizes,
                         max_batch=serve.image_limit("max_batch"), max_steps=serve.image_limit("max_steps"),
                         embedding_cache=serve.image_limit("embedding_cache"))
    server.warm()
    app = create_app(server, api_key=serve.api_key)
    app.state.images = server
    return app


def main(serve: ServeConfig) -> int:
    """``hypertron serve`` of a diffusers folder, until interrupted."""
    if serve.host not in ("127.0.0.1", "localhost", "::1") and not serve.api_key:
        log.warning("serving on %s without an api_key: anyone who can reach it can use it", serve.host)
    run(build(serve), serve.host, serve.port)
    return 0
