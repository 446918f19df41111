"""``POST /v1/images/generations`` (issue 39, point 9): the image server over a tiny
``StableDiffusionPipeline`` folder written by diffusers, served by uvicorn on 127.0.0.1 and asked
with the official ``openai`` client. One server for the module, its one program (16x16, n=2, 3
steps, CFG) compiled at start and shared by the tests.
"""

from __future__ import annotations

import base64
import io

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
    """``(server url, folder)``: sizes 16x16, at most 2 images and 3 steps a request, an API key."""
    from hypertron.diffusion.pipeline import load_pipeline
    from hypertron.serve.images import ImageServer, create_app, served_sizes

    folder = tiny_sd(tmp_path_factory.mktemp("images_server"))[0]
    pipe = load_pipeline(folder)
    server = ImageServer(pipe, MODEL, sizes=served_sizes(pipe.spec, "16x16"), max_batch=2, max_steps=3)
    server.warm()  # compiles the one program the tests use: n=2, 3 steps, guidance 7.5
    with ThreadedServer(create_app(server, api_key=KEY, max_body_bytes=MAX_BODY)) as s:
        yield s.url, folder


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
    "n over the limit": ({"n": 3}, 400, "n"),
    "url": ({"response_format": "url"}, 400, "response_format"),
    "empty prompt": ({"prompt": "  "}, 400, "prompt"),
    "too many steps": ({"num_inference_steps": 4}, 400, "num_inference_steps"),
    "guidance not a number": ({"guidance_scale": "high"}, 400, "guidance_scale"),
    "unknown model": ({"model": "dall-e-3"}, 404, "model"),
}


def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_serves_on(served):
    url, _ = served
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

    url, folder = served
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
])
def test_serve_refuses_bad_image_flags_before_loading(served, flags, words):
    """``hypertron serve`` on a diffusers folder: a bad flag is one error line and exit 2, nothing compiled."""
    one_error_line(run_cli(["serve", "--model", served[1], "--port", "0", *flags]), *words)
