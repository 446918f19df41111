"""Hostile input to the server (issue 48, points 1-3 and 7): one request never fails another's step,
and every bad body, value or method gets its 4xx naming the field or the limit, never a 500 with an
exception's text. The CLI's, the readers' and the launch scripts' half: ``test_hostile_cli.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re

import httpx
import jax
import numpy as np
import pytest
from fake_engine import FakeEngine, reference  # tests/
from http_harness import ThreadedServer  # tests/
from support.cli import one_error_line, run_cli

from hypertron.config import PRESETS, EngineConfig, SchedulerConfig
from hypertron.models import init_params
from hypertron.models.bundle import save_model
from hypertron.serve.api import MAX_JSON_DEPTH
from hypertron.serve.engine import PagedEngine
from hypertron.serve.orchestrator import ERROR, STEP_FAILED, Orchestrator
from hypertron.serve.server import create_app
from hypertron.serve.types import Row, SamplingError, SamplingParams, StepPlan
from hypertron.tokenizer import get_tokenizer

# --- point 1: a step cannot fail for one row ---

TOK = get_tokenizer("byte")
POISON = 4242  # a seed the test hooks make a row fail on, inside the step
PROMPTS = [TOK.encode(t) for t in ("one", "a second", "the third one", "4")]


@pytest.mark.parametrize("field, value", [
    ("top_k", 3_000_000_000), ("top_k", 260), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", 1e300),
    ("top_p", float("nan")), ("seed", -1), ("seed", 2**32), ("max_tokens", 2**31), ("logprobs", 6),
    ("stop_token_ids", (259,))])
def test_sampling_values_the_engine_cannot_hold_are_refused_naming_the_field(field, value):
    with pytest.raises(SamplingError, match=f"'{field}'") as e:
        SamplingParams(**{field: value}).check(vocab_size=259, max_top_logprobs=5)
    assert e.value.field == field


def test_the_api_answers_400_naming_the_field_before_anything_is_queued():
    app = create_app(Orchestrator(FakeEngine(), TOK), TOK, "m")  # not started: nothing may reach it

    async def post(path: str, body: dict) -> tuple[int, dict]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            r = await c.post(path, content=json.dumps({"model": "m", **body}))
            return r.status_code, r.json()["error"]

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [("/v1/completions", {"prompt": "hi", "top_k": 3_000_000_000}, "top_k"),
             ("/v1/completions", {"prompt": "hi", "temperature": 1e300}, "temperature"),  # past a float32
             ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
             ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**12]}, "stop_token_ids"),
             ("/v1/completions", {"prompt": [5, 2**40]}, "prompt"),
             ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 99}, "top_logprobs")]
    for path, body, param in cases:
        status, error = asyncio.run(post(path, body))
        assert (status, error["param"]) == (400, param) and f"'{param}'" in error["message"], (body, error)


def test_generate_refuses_a_top_k_past_int32_in_one_line(tmp_path):
    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=1, embed_dim=32, mlp_dim=64, max_seq_len=32)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))  # refused before any weight is used
    save_model(tmp_path / "m", cfg, jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes))
    r = run_cli(["generate", "--model", tmp_path / "m", "--prompt", "hi", "--max-new-tokens", "2", "--top-k", "3000000000"])
    one_error_line(r, "--top-k", "3000000000")


def _poison_dispatch(engine, monkeypatch) -> list[int]:
    """Make a step holding a row of seed POISON raise in dispatch, before the engine is touched;
    returns the list the refused steps' row counts go to."""
    dispatch, refused = engine.dispatch, []

    def poisoned(plan):
        if any(r.sampling.seed == POISON for r in plan.rows):
            refused.append(len(plan.rows))
            raise OverflowError("Python integer 3000000000 out of bounds for int32")
        return dispatch(plan)

    monkeypatch.setattr(engine, "dispatch", poisoned)
    return refused


def _run_with_a_hostile_request(orch: Orchestrator, sampling: SamplingParams):
    """Four requests, and a POISON one submitted once the first has its first token: the chunks of each."""
    async def run():
        gens = [orch.submit(p, sampling) for p in PROMPTS]
        first = await gens[0].__anext__()
        hostile = orch.submit(TOK.encode("hostile"), dataclasses.replace(sampling, seed=POISON))
        *chunks, bad = await asyncio.gather(*[_drain(g) for g in [*gens, hostile]])
        return [[first, *chunks[0]], *chunks[1:]], bad

    try:
        return asyncio.run(run())
    finally:
        orch.stop()


async def _drain(gen) -> list:
    return [c async for c in gen]


def _tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _assert_failed_alone(orch: Orchestrator, hostile) -> None:
    assert hostile[-1].finish_reason == ERROR and _tokens(hostile) == []
    assert hostile[-1].error == f"{STEP_FAILED} (request 4)"  # its id; the exception text stays in the log
    stats = orch.scheduler.stats()
    assert (stats["slots_in_use"], stats["waiting"], stats["pages_free"]) == (0, 0, stats["pages_total"])


@pytest.mark.parametrize("ahead", [False, True])
def test_a_row_that_fails_its_step_fails_only_its_request_fake_engine(monkeypatch, ahead):
    engine = FakeEngine(max_slots=8, step_delay=0.002)
    refused = _poison_dispatch(engine, monkeypatch)
    orch = Orchestrator(engine, TOK, SchedulerConfig(dispatch_ahead="on" if ahead else "off")).start()
    greedy = SamplingParams(max_tokens=12, temperature=0.0, seed=0)
    chunks, hostile = _run_with_a_hostile_request(orch, greedy)
    _assert_failed_alone(orch, hostile)
    assert refused[0] == 5 and refused[-1] == 1  # it shared a step with the four, then was run alone
    assert [_tokens(c) for c in chunks] == [reference(p, greedy, engine.max_seq_len)[0] for p in PROMPTS]



@pytest.mark.gpu
def test_a_row_that_fails_the_real_engines_dispatch_leaves_the_device_as_it_was(monkeypatch):
    """What the loop's retry counts on, on the tiny model: a row that raises where a value past
    int32 did (written into the step's arrays) fails the dispatch before the device is touched, so
    the other rows, run again without it, get the tokens they get alone (a prefill, then a decode
    fed from the device; the steps are compiled once, shared by the two engines)."""
    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=1, embed_dim=32, mlp_dim=64, max_seq_len=32)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: (0.5 * rng.standard_normal(x.shape)).astype(x.dtype),
                          jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))
    greedy, prompt = SamplingParams(temperature=0.0, seed=0), PROMPTS[2]
    good = Row(0, 0, 0, tuple(prompt), (1, 2), greedy)
    plan = StepPlan.of(0, (), (good, Row(1, 1, 0, (5, 6), (3,), dataclasses.replace(greedy, seed=POISON))))

    def two_tokens(engine, first: StepPlan) -> list[int]:
        token = int(engine.run(first).tokens[0])
        decode = StepPlan.of(1, (Row(0, 0, len(prompt), (), (1, 2), greedy),), ())
        return [token, int(engine.run(decode).tokens[0])]

    alone = two_tokens(PagedEngine(params, cfg, EngineConfig(max_slots=2, page_size=8, compile="lazy")),
                       StepPlan.of(0, (), (good,)))
    engine = PagedEngine(params, cfg, EngineConfig(max_slots=2, page_size=8, compile="lazy"))
    row = engine._row

    def poisoned_row(b, i, r, *rest):
        if r.sampling.seed == POISON:
            raise OverflowError("Python integer 3000000000 out of bounds for int32")
        row(b, i, r, *rest)

    monkeypatch.setattr(engine, "_row", poisoned_row)
    for _ in range(2):  # dispatched ahead, the loop's way: nothing is collected in between
        with pytest.raises(OverflowError):
            engine.dispatch(plan)
    assert two_tokens(engine, plan.only((good,))) == alone


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
    orch = Orchestrator(engine, _Tok(), SchedulerConfig(max_queue=64))
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
    (b'{"model": "fake-model", "prompt": "hi", "temperature": 1e400}', "'temperature' is a number past"),
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


@pytest.mark.slow
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
