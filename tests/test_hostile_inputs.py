"""Hostile input (issue 48): every bad request, flag or file gets its one clear refusal, and none
can fail another request. Sections by part."""

from __future__ import annotations

import logging
import re

import httpx
import pytest
from fake_engine import FakeEngine  # tests/
from http_harness import ThreadedServer  # tests/

from hypertron.serve.api import MAX_JSON_DEPTH
from hypertron.serve.orchestrator import Orchestrator
from hypertron.serve.server import create_app
from hypertron.tokenizer import get_tokenizer

# --- server: bodies, the API's description, schemathesis ---

SRV_MODEL = "fake-model"
SRV_POOL = 48 * 4  # the fake engine's KV page pool below, in tokens: shorter than its context (256)


class _Tok:
    """The byte tokenizer; a text holding "<crash>" makes it raise (an internal error to hide)."""

    def __init__(self):
        self._tok = get_tokenizer("byte")

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text: str) -> list[int]:
        if "<crash>" in text:
            raise RuntimeError("secret internals /srv/weights")
        return self._tok.encode(text)


class _Engine(FakeEngine):
    """A step holding the tokens of "<crash-step>" raises, as a broken step on a device would."""

    marker = "".join(f",{t}," for t in get_tokenizer("byte").encode("<crash-step>"))

    def dispatch(self, plan):
        if any(self.marker in "".join(f",{t}," for t in row.tokens) for row in plan.rows):
            raise RuntimeError("secret step internals")
        return super().dispatch(plan)


@pytest.fixture(scope="module")
def srv():
    engine = _Engine(max_slots=4, max_seq_len=256, page_size=4, num_pages=SRV_POOL // 4)
    orch = Orchestrator(engine, _Tok(), max_queue=64)
    app = create_app(orch, _Tok(), SRV_MODEL, max_tokens_limit=64, max_body_bytes=64 << 10)
    with ThreadedServer(app, lifespan="on", graceful_s=2) as s:
        s.orch = orch
        yield s


def _post(srv, path: str, body: bytes | dict) -> httpx.Response:
    kw = {"json": body} if isinstance(body, dict) else {"content": body, "headers": {"content-type": "application/json"}}
    return httpx.post(srv.url + path, timeout=30, **kw)


def _refusal(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("body, says", [
    (b"[" * 5000 + b"]" * 5000, f"at most {MAX_JSON_DEPTH}"),  # 10 KB: a RecursionError and a 500 before
    (b'{"model": "fake-model", "prompt": "hi", "temperature": NaN}', "NaN"),
    (b'{"model": "fake-model", "prompt": "hi", "temperature": Infinity}', "Infinity"),
    (b'{"model": "fake-model", "prompt": "hi", "top_p": -Infinity}', "-Infinity"),
    (b'{"model": "fake-model", "prompt": "hi", "temperature": 1e400}', "1e400"),
])
def test_bodies_past_the_json_limits_get_a_400_naming_the_limit(srv, body, says):
    assert says in _refusal(_post(srv, "/v1/completions", body))["message"]


def test_a_body_past_the_size_limit_gets_a_413_naming_it(srv):
    assert "65536 bytes" in _refusal(_post(srv, "/v1/completions", b" " * (65 << 10)), 413)["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"model": "fake-model", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/chat/completions", b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages"),
    ("/v1/chat/completions", b'{"model": "fake-model", "messages": [{"role": "\\ud800", "content": "hi"}]}',
     "messages"),
])
def test_lone_surrogates_get_a_400_naming_the_field(srv, path, body, param):
    error = _refusal(_post(srv, path, body))
    assert error["param"] == param and "surrogate" in error["message"]


def test_405_keeps_its_allow_header(srv):
    r = httpx.get(srv.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "error" in r.json()


def test_a_prompt_past_the_page_pool_is_refused_at_admission(srv):
    error = _refusal(_post(srv, "/v1/completions", {"model": SRV_MODEL, "prompt": [5] * SRV_POOL}))
    assert error["param"] == "prompt" and f"holds {SRV_POOL} tokens" in error["message"]
    r = _post(srv, "/v1/completions", {"model": SRV_MODEL, "prompt": [5] * (SRV_POOL - 1), "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1  # the longest that fits


@pytest.mark.parametrize("prompt", ["<crash>", "<crash-step>"])  # a handler that raises; a step that raises
def test_a_500_names_a_request_id_and_none_of_the_exceptions_text(srv, prompt, caplog):
    with caplog.at_level(logging.ERROR):
        error = _refusal(_post(srv, "/v1/completions", {"model": SRV_MODEL, "prompt": prompt}), 500)
    assert "secret" not in error["message"] and error["type"] == "server_error"
    rid = re.search(r"request id (\w+)", error["message"]).group(1)
    assert rid in caplog.text and "secret" in caplog.text  # the log keeps what happened


def test_openapi_describes_the_api_behind_the_key_and_can_be_hidden():
    engine, tok = FakeEngine(max_seq_len=256), get_tokenizer("byte")
    app = create_app(Orchestrator(engine, tok), tok, SRV_MODEL, api_key="k", max_tokens_limit=100)
    with ThreadedServer(app) as s:
        assert httpx.get(s.url + "/openapi.json").status_code == 401
        schema = httpx.get(s.url + "/openapi.json", headers={"Authorization": "Bearer k"}).json()
    post = schema["paths"]["/v1/completions"]["post"]
    body = post["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    props = schema["components"]["schemas"][body]["properties"]
    assert {"prompt", "max_tokens", "top_k", "ignore_eos", "stop_token_ids"} <= set(props)
    assert props["max_tokens"]["anyOf"][0]["maximum"] == 100 and "255 tokens" in props["prompt"]["description"]
    assert set(post["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert post["security"] == [{"bearer": []}]
    hidden = create_app(Orchestrator(engine, tok), tok, SRV_MODEL, openapi=False)
    with ThreadedServer(hidden) as s:
        assert httpx.get(s.url + "/openapi.json").status_code == 404


def test_schemathesis_finds_no_5xx_and_no_answer_off_the_schema(srv):
    from support.api_fuzz import fuzz_server  # tests/support

    counts = fuzz_server(srv.url, examples=300, seed=48)
    assert counts.failures == [] and counts.hangs == 0 and counts.server_errors == 0
    assert counts.statuses[200] > 20 and counts.client_errors > 100  # both modes reached the server
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    stats = srv.orch.scheduler.stats()
    assert (stats["slots_in_use"], stats["pages_free"], stats["waiting"]) == (0, stats["pages_total"], 0)


def test_no_openapi_flag_turns_the_description_off():
    from hypertron.cli import build_parser
    from hypertron.cli.serving import serve_config_from_args

    parse = build_parser().parse_args
    assert serve_config_from_args(parse(["serve", "--checkpoint", "x"])).openapi is True
    assert serve_config_from_args(parse(["serve", "--checkpoint", "x", "--no-openapi"])).openapi is False
