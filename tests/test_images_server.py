"""``POST /v1/images/generations`` (issue 39, point 9): the image server over a tiny
``StableDiffusionPipeline`` folder written by diffusers, served by uvicorn on 127.0.0.1 and asked
with the official ``openai`` client. One server for the module (16x16, at most 4 images a batch), its
programs (3 steps, CFG, batches of 1, 2 and 4) compiled at start and shared by the tests.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import time

import httpx
import numpy as np
import pytest
from http_harness import ThreadedServer  # tests/
from prometheus_client.parser import text_string_to_metric_families

from support.cli import one_error_line, run_cli  # tests/support
from support.diffusion_folders import tiny_sd

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

MODEL, KEY = "tiny-sd", "secret"
PROMPT, NEGATIVE = "a photo of a red cat", "blue dog"
MAX_BODY = 8 << 10


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(server url, folder, ImageServer)``: size 16x16, at most 4 images and 3 steps a request, an API key."""
    from hypertron.diffusion.pipeline import load_pipeline
    from hypertron.serve.images import ImageServer, create_app, served_sizes

    folder = tiny_sd(tmp_path_factory.mktemp("images_server"))[0]
    pipe = load_pipeline(folder)
    server = ImageServer(pipe, MODEL, sizes=served_sizes(pipe.spec, "16x16"), max_batch=4, max_steps=3)
    server.warm()  # compiles the programs the tests use: batches of 1, 2 and 4, 3 steps, CFG
    with ThreadedServer(create_app(server, api_key=KEY, max_body_bytes=MAX_BODY)) as s:
        yield s.url, folder, server
    server.close()


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def _post(url: str, body: dict | bytes) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(url + "/v1/images/generations", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      **kwargs)


GOOD = {"model": MODEL, "prompt": PROMPT, "size": "16x16", "n": 1, "num_inference_steps": 3}
BAD = {  # body changes -> (status, param)
    "unserved size": ({"size": "32x32"}, 400, "size"),
    "not WxH": ({"size": "big"}, 400, "size"),
    "n over the limit": ({"n": 5}, 400, "n"),
    "url": ({"response_format": "url"}, 400, "response_format"),
    "empty prompt": ({"prompt": "  "}, 400, "prompt"),
    "too many steps": ({"num_inference_steps": 4}, 400, "num_inference_steps"),
    "guidance not a number": ({"guidance_scale": "high"}, 400, "guidance_scale"),
    "unknown model": ({"model": "dall-e-3"}, 404, "model"),
}


@pytest.mark.slow  # with the module's server (its fixture, ~20 s on 2 cores): the group starts first
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_serves_on(served):
    url = served[0]
    for case, (change, status, param) in BAD.items():
        r = _post(url, GOOD | change)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (case, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = _post(url, GOOD | {"prompt": "x" * MAX_BODY})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    with pytest.raises(openai.BadRequestError) as e:  # the official client sees the same
        _client(url).images.generate(model=MODEL, prompt=PROMPT, size="16x16", response_format="url")
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.AuthenticationError):
        _client(url, key="wrong").images.generate(model=MODEL, prompt=PROMPT, size="16x16")
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    models = _client(url).models.list().data
    assert [m.id for m in models] == [MODEL]


def test_images_are_hypertron_diffuses(served, tmp_path):
    """``images.generate(n=2, size="16x16", response_format="b64_json")`` gives two 16x16 PNGs, byte for
    byte ``hypertron diffuse --batch 2``'s for the same seed, prompts, steps and guidance (a request without
    steps runs the pipeline's default capped at ``--max-steps``)."""
    from PIL import Image

    url, folder, _ = served
    extra = {"negative_prompt": NEGATIVE, "seed": 5}  # the steps: the default, 50 capped at --max-steps 3
    answer = _client(url).images.generate(model=MODEL, prompt=PROMPT, n=2, size="16x16",
                                          response_format="b64_json", extra_body=extra)
    pngs = [base64.b64decode(d.b64_json) for d in answer.data]
    assert len(pngs) == 2 and answer.created > 0
    r = run_cli(["diffuse", "--model", folder, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--steps", "3",
                 "--seed", "5", "--batch", "2", "--out", tmp_path / "img.png"])
    assert r.rc == 0, r.describe()
    for i, png in enumerate(pngs):
        with Image.open(io.BytesIO(png)) as image:
            assert image.format == "PNG" and image.size == (16, 16)
            pixels = np.asarray(image)
        assert png == (tmp_path / f"img-{i}.png").read_bytes(), (i, pixels.mean())
    assert pngs[0] != pngs[1]
    text = httpx.get(url + "/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["hypertron_images_total"] >= 2, samples


@pytest.mark.parametrize("flags, words", [
    (["--sizes", "15x16"], ["sizes=", "width=15", "multiples of 2"]),
    (["--sizes", "16by16"], ["sizes=", "not WxH"]),
    (["--max-batch", "0"], ["max-batch"]),
    (["--embedding-cache", "-1"], ["embedding-cache", "0 (off)"]),
    (["--mesh", "data=99"], ["mesh=", "needs 99 devices"]),
    (["--engine-process"], ["--engine-process", "only a text model's engine runs in a process of its own"]),
])
def test_serve_refuses_bad_image_flags_before_loading(served, flags, words):
    """``hypertron serve`` on a diffusers folder: a bad flag is one error line and exit 2, nothing compiled."""
    one_error_line(run_cli(["serve", "--model", served[1], "--port", "0", *flags]), *words)


def _metrics(url: str) -> dict:
    """``/metrics`` as {(name, sorted label items): value}."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0) - before.get(key, 0)


def _pixels(b64: str) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        return np.asarray(image).astype(np.int16)


def test_concurrent_requests_share_batches_and_each_image_is_its_own(served):
    """8 requests of n=1 (two prompts, two guidance scales, some with a negative prompt), all waiting
    while a batch runs, run in 2 program calls of 4 (``--max-batch``); each request's image is the one
    it gets alone (batch of 1) within one uint8 level. The prompt embeddings are encoded once per
    (prompt, negative prompt): the repeats, and every request alone, skip the text encoders."""
    url, _, server = served
    bodies = [dict(prompt=("a green hill", "two boats")[i % 2], n=1, size="16x16", response_format="b64_json",
                   extra_body={"seed": 10 + i, "num_inference_steps": 3, "guidance_scale": (7.5, 3.0)[i % 2],
                               **({"negative_prompt": NEGATIVE} if i % 4 == 0 else {})}) for i in range(8)]
    one = lambda body: _client(url).images.generate(model=MODEL, **body).data[0].b64_json  # noqa: E731
    before = _metrics(url)
    pool = concurrent.futures.ThreadPoolExecutor(len(bodies))
    with server.running:  # a batch runs: the 8 requests wait together
        futures = [pool.submit(one, body) for body in bodies]
        deadline = time.monotonic() + 60
        while server.pending() < len(bodies):
            assert time.monotonic() < deadline and not any(f.done() for f in futures), server.pending()
            time.sleep(0.01)
    batched = [f.result(timeout=120) for f in futures]
    pool.shutdown()
    after = _metrics(url)
    assert _delta(before, after, "hypertron_image_batches_total") == 2
    assert _delta(before, after, "hypertron_image_batch_rows_total", kind="padded") == 0
    alone = [one(body) for body in bodies]
    for i, (a, b) in enumerate(zip(batched, alone)):
        assert np.abs(_pixels(a) - _pixels(b)).max() <= 1, i
    assert len({a for a in batched}) == len(bodies)  # a seed each
    last = _metrics(url)
    assert _delta(before, last, "hypertron_image_batches_total") == 2 + len(bodies)
    # 3 distinct (prompt, negative prompt): a miss each, then hits
    assert _delta(before, last, "hypertron_image_prompt_cache_total", result="miss") == 3
    assert _delta(before, last, "hypertron_image_prompt_cache_total", result="hit") == 2 * len(bodies) - 3


def test_a_batch_is_padded_to_a_compiled_size(served):
    """``n=3`` runs padded to the compiled batch of 4 (no compile: the padding counted in ``/metrics``);
    its images 0 and 2 are the same seed's ``n=1`` image and ``hypertron diffuse``'s third image."""
    url, _, server = served
    body = dict(prompt=PROMPT, size="16x16", response_format="b64_json",
                extra_body={"seed": 21, "num_inference_steps": 3})
    before = _metrics(url)
    three = _client(url).images.generate(model=MODEL, n=3, **body).data
    after = _metrics(url)
    assert len(three) == 3 and _delta(before, after, "hypertron_image_batch_rows_total", kind="padded") == 1
    one = _client(url).images.generate(model=MODEL, n=1, **body).data[0].b64_json
    assert np.abs(_pixels(three[0].b64_json) - _pixels(one)).max() <= 1
    assert np.abs(_pixels(three[2].b64_json) - _pixels(one)).max() > 8  # its own seed's row, not a copy


def test_next_batch_never_mixes_sizes_steps_or_cfg_and_keeps_to_max_batch():
    from hypertron.serve.images import ImageJob, batch_sizes, next_batch

    def job(n=1, size=16, steps=3, cfg=True):
        return ImageJob("p", None, n, 0, steps, 7.5 if cfg else 1.0, size, size, cfg)

    pending = [job(), job(size=32), job(steps=2), job(cfg=False), job(n=2), job(n=2), job()]
    assert next_batch(pending, 4) == [0, 4, 6]  # the oldest's group, in order, while it fits
    assert next_batch(pending[1:], 4) == [0]
    assert next_batch([job(n=3), job(n=2), job(n=1)], 4) == [0, 2]
    assert [batch_sizes(n) for n in (1, 2, 4, 6)] == [(1,), (1, 2), (1, 2, 4), (1, 2, 4, 6)]


def test_prompt_cache_is_least_recently_used_and_0_keeps_nothing():
    from hypertron.serve.images import PromptCache

    made = []
    make = lambda key: lambda: made.append(key) or key.upper()  # noqa: E731
    cache = PromptCache(2)
    got = [cache.get(k, make(k)) for k in ("a", "b", "a", "c", "a", "b")]
    assert got == [("A", False), ("B", False), ("A", True), ("C", False), ("A", True), ("B", False)]
    assert made == ["a", "b", "c", "b"]  # c dropped b (least recently used), then b dropped c
    off = PromptCache(0)
    assert [off.get("a", make("a"))[1] for _ in range(2)] == [False, False]


def test_serve_places_and_quantizes_as_diffuse(served, monkeypatch):
    """``hypertron serve --mesh data=2 --quantize int8`` on a diffusers folder loads the pipeline
    ``hypertron diffuse`` would run (``placement.load_placed``): int8 denoiser matmul weights on the
    mesh. (Its program on a mesh and in int8 is test_diffusion_mesh's and test_diffusion_pipeline's;
    nothing is compiled here.)"""
    import jax

    from hypertron.config import ServeConfig
    from hypertron.quant import QArray
    from hypertron.serve.images import ImageServer, build

    monkeypatch.setattr(ImageServer, "warm", lambda self: None)
    app = build(ServeConfig(checkpoint=str(served[1]), sizes="16x16", mesh="data=2", quantize="int8"))
    server = app.state.images
    server.close()
    pipe = server.pipe
    assert dict(pipe.mesh.shape)["data"] == 2 and pipe.quantize == "int8"
    int8 = [leaf for leaf in jax.tree.leaves(pipe.denoiser_params, is_leaf=lambda x: isinstance(x, QArray))
            if isinstance(leaf, QArray)]
    assert int8 and all(leaf.values.sharding.mesh == pipe.mesh for leaf in int8)


@pytest.mark.parametrize("dtype, quantize, text", [("bfloat16", "none", None), (None, "fp8", "int8")])
def test_serve_dtype_and_fp8_load_as_diffuse(served, monkeypatch, capsys, dtype, quantize, text):
    """``hypertron serve --dtype bfloat16``, ``--quantize fp8`` and ``--text-encoder-quantize int8`` on
    a diffusers folder load what ``hypertron diffuse`` runs with the same flags
    (``placement.load_placed``): the denoiser's and the VAE's weights bf16 (float32 when not given),
    the denoiser's matmuls through the fp8 hook, the text encoders' int8, said by the start's log line. (Nothing is compiled here: a bf16 or fp8 program's images are
    test_diffusion_pipeline's and test_diffusion_mesh's, and the server runs the program it loads.)"""
    import jax
    import jax.numpy as jnp

    from hypertron.config import ServeConfig
    from hypertron.serve.images import ImageServer, build

    monkeypatch.setattr(ImageServer, "warm", lambda self: None)
    server = build(ServeConfig(checkpoint=str(served[1]), sizes="16x16", dtype=dtype, quantize=quantize,
                               text_encoder_quantize=text)).state.images
    server.close()
    pipe, want = server.pipe, jnp.dtype(dtype or "float32")
    assert (pipe.quantize, pipe.dtype) == (quantize, want)
    assert {e.quantize for e in pipe.text_encoders} == {text or "none"}
    for params in (pipe.denoiser_params, pipe.vae_params):
        assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {want}
    assert f"{want.name}, quantize {quantize}, " + (f"text encoders {text}, " if text else "") \
        in capsys.readouterr().err


def test_a_cancelled_request_is_dropped_and_a_failed_batch_fails_its_requests():
    """The batch thread (its program call stubbed): a request cancelled while waiting is left out of
    the batch, the others get their rows; an error in a batch reaches each of its requests, and the
    thread runs on."""
    from hypertron.serve.images import ImageJob, ImageServer

    server = ImageServer(None, MODEL, sizes=[(16, 16)], max_batch=4, max_steps=3)
    calls = []

    def sample(jobs):
        calls.append([job.seed for job in jobs])
        if jobs[0].seed == 99:
            raise RuntimeError("device lost")
        return np.concatenate([np.full((job.n, 1, 1, 3), job.seed, np.uint8) for job in jobs])

    server._sample = sample
    job = lambda seed, n=1: ImageJob("p", None, n, seed, 3, 7.5, 16, 16, True)  # noqa: E731
    try:
        with server.running:
            futures = [server.submit(job(seed, n)) for seed, n in ((1, 1), (2, 2), (3, 1))]
            assert futures[1].cancel()
        assert [f.result(timeout=10)[:, 0, 0, 0].tolist() for f in (futures[0], futures[2])] == [[1], [3]]
        with server.running:
            failing = [server.submit(job(99)), server.submit(job(98))]
        for f in failing:
            with pytest.raises(RuntimeError, match="device lost"):
                f.result(timeout=10)
        assert server.submit(job(4)).result(timeout=10)[:, 0, 0, 0].tolist() == [4]
        assert calls == [[1, 3], [99, 98], [4]]
    finally:
        server.close()
