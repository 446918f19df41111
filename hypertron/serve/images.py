"""``POST /v1/images/generations`` over a diffusers pipeline folder (``model_index.json``): what
``hypertron serve --model DIR`` serves for such a folder instead of the text server.

The API key, the error shape (``param`` naming the field), ``GET /health``, ``/v1/models`` and
``/metrics`` are the text server's (:mod:`hypertron.serve.server`'s helpers). A request has OpenAI's
``model`` (optional: the model served), ``prompt``, ``n``, ``size`` (``"WxH"``, one of ``--sizes``;
default the first) and ``response_format`` (``b64_json`` only: this server keeps no files to link),
and the extensions ``negative_prompt``, ``num_inference_steps``, ``guidance_scale`` (defaults: the
diffusers pipeline's, the steps at most ``--max-steps``) and ``seed`` (default: a random one). The
answer is ``{"created", "data": [{"b64_json"}]}``, PNGs. Image i of a request is ``hypertron
diffuse``'s image i for the same seed and settings: both run
:func:`hypertron.diffusion.sampling.request_args` and the pipeline's one compiled program.

Requests run one at a time, each one program call. At start each ``--sizes`` size is compiled (and
run once) for ``n = --max-batch`` at the default steps (at most ``--max-steps``) and guidance;
another ``n``, step count, or CFG on/off compiles on its first request.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import sys
import threading
import time

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from hypertron.config import ServeConfig
from hypertron.config.numbers import shown
from hypertron.diffusion import sampling
from hypertron.diffusion.errors import DiffusionError
from hypertron.diffusion.generate import png_bytes
from hypertron.diffusion.pipeline import Pipeline, PipelineSpec, load_pipeline, read_pipeline
from hypertron.serve.api import HEALTH_RESPONSES, METRICS_RESPONSES, ApiError, ModelCard, ModelList, _Strict, responses
from hypertron.serve.metrics import ImageMetrics
from hypertron.serve.model import served_name
from hypertron.serve.server import DEFAULT_MAX_BODY_BYTES, add_error_handlers, authorizer, read_request, run

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


class ImageServer:
    """The pipeline, its limits, and the lock that runs one request at a time."""

    def __init__(self, pipe: Pipeline, model_name: str, *, sizes: list[tuple[int, int]], max_batch: int,
                 max_steps: int):
        self.pipe, self.model_name, self.sizes = pipe, model_name, sizes
        self.max_batch, self.max_steps = max_batch, max_steps
        self.metrics = ImageMetrics()
        self.created = int(time.time())
        self._lock = threading.Lock()

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

    def images(self, prompt: str, negative: str | None, *, n: int, seed: int, steps: int, guidance: float,
               width: int, height: int) -> list[bytes]:
        """``n`` PNGs, as ``hypertron diffuse`` makes them."""
        with self._lock:
            args = sampling.request_args(self.pipe, prompt, negative, count=n, seed=seed, steps=steps,
                                         guidance=guidance, height=height, width=width)
            fn = sampling.program(self.pipe, sampling.latent_hw(self.pipe.spec, height, width)).fn
            _, images = fn(*args)
            images = np.asarray(images)
        return [png_bytes(image) for image in images]

    def warm(self) -> None:
        """Compile (and run once) each size for ``n = max_batch`` at the default steps and guidance."""
        kind = self.pipe.spec.kind
        for width, height in self.sizes:
            start = time.perf_counter()
            self.images("", None, n=self.max_batch, seed=0, steps=self.default_steps,
                        guidance=kind.guidance, width=width, height=height)
            print(f"hypertron serve: {width}x{height} compiled for {self.max_batch} image(s) in "
                  f"{time.perf_counter() - start:.1f} s", file=sys.stderr)

    def check(self, req: ImageRequest) -> dict:
        """``images``' arguments for ``req``, or a 400 naming the field."""
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
        return dict(prompt=req.prompt, negative=req.negative_prompt, n=n, seed=seed, steps=steps,
                    guidance=float(guidance), width=size[0], height=size[1])


def create_app(server: ImageServer, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app of ``server`` (compiled already: see :meth:`ImageServer.warm`)."""
    app = FastAPI(title="hypertron images", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = server.metrics

    async def generations(request: Request):
        req = await read_request(request, ImageRequest, max_body_bytes, server.model_name)
        kwargs = server.check(req)
        start = time.perf_counter()
        try:
            pngs = await asyncio.to_thread(server.images, kwargs.pop("prompt"), kwargs.pop("negative"), **kwargs)
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
    """The app of ``serve.checkpoint``, a diffusers folder: loaded, its sizes compiled."""
    spec = read_pipeline(serve.checkpoint)  # the sizes checked before a weight is read
    sizes = served_sizes(spec, serve.sizes)
    pipe = load_pipeline(serve.checkpoint, spec=spec)
    server = ImageServer(pipe, serve.model_name or served_name(serve.checkpoint), sizes=sizes,
                         max_batch=serve.max_batch, max_steps=serve.max_steps)
    server.warm()
    return create_app(server, api_key=serve.api_key)


def main(serve: ServeConfig) -> int:
    """``hypertron serve`` of a diffusers folder, until interrupted."""
    if serve.host not in ("127.0.0.1", "localhost", "::1") and not serve.api_key:
        log.warning("serving on %s without an api_key: anyone who can reach it can use it", serve.host)
    run(build(serve), serve.host, serve.port)
    return 0
