"""The engine loop in a process of its own (``hypertron serve --engine-process``,
:mod:`hypertron.serve.engine_process`), over the deterministic fake engine (tests/fake_engine.py)
built in that process: the same answers as the one-process server, the front end's queue bound,
metrics from both processes, and what happens when the engine process ends or cannot start.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import pytest
from fake_engine import FakeEngine  # tests/
from http_harness import ThreadedServer  # tests/
from prometheus_client.parser import text_string_to_metric_families
from support.engine_factories import fake_orchestrator, refuse_to_start  # tests/support
from test_server import MODEL, TOK, Server, _stream, expected, sse_events  # tests/

from hypertron.config import ConfigError
from hypertron.serve.engine_process import ENDED, STOPPED, EngineClient
from hypertron.serve.orchestrator import QueueFull
from hypertron.serve.server import create_app
from hypertron.serve.types import SamplingParams

ENGINE = {"max_slots": 4, "max_seq_len": 4096, "num_pages": 2048}
LIMITS = {"max_prompt_tokens": 3000, "max_tokens_limit": 128}
LONG = "a long prompt " * 160  # 2,240 characters: tokenized off the event loop (server.OFF_LOOP_CHARS)


class ProcessServer(ThreadedServer):
    """An app over an :class:`EngineClient` whose engine process runs ``FakeEngine(**engine)``."""

    def __init__(self, engine: dict, *, scheduler: dict | None = None, max_queue: int = 512, **app_kwargs):
        self.orch = EngineClient(fake_orchestrator, (engine, scheduler), max_queue=max_queue)
        super().__init__(create_app(self.orch, self.orch.tokenizer, MODEL, **app_kwargs), lifespan="on",
                         log_level="warning", graceful_s=2)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        assert not self.orch.running and self.orch._process.poll() is not None

    def metrics(self) -> dict[str, float]:
        return Server.metrics(self)

    def wait_idle(self, timeout: float = 5.0) -> dict[str, float]:
        return Server.wait_idle(self, timeout)


@pytest.fixture(scope="module")
def pair():
    """The one-process server and the two-process one, over the same fake engine."""
    with Server(FakeEngine(**ENGINE), **LIMITS) as one, ProcessServer(ENGINE, **LIMITS) as two:
        yield one, two


def _answers(url: str) -> list:
    """A set of requests' answers (ids and times left out): completions and chats, streamed and not,
    with log-probabilities, stop strings, echo, a grammar, cached prompts."""
    bodies = [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 12, "seed": 7, "logprobs": 2}),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 12, "seed": 7, "stream": True,
                             "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"prompt": "stop here", "max_tokens": 40, "seed": 3, "stop": ["q", "zz"]}),
        ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6, "seed": 1, "echo": True, "logprobs": 1}),
        ("/v1/completions", {"prompt": "pick", "max_tokens": 20, "seed": 2, "ignore_eos": True,
                             "structured_outputs": {"regex": "[0-9]{3}-x"}}),
        ("/v1/completions", {"prompt": "go~3", "max_tokens": 20, "seed": 0}),
        ("/v1/completions", {"prompt": list(range(40, 62)), "max_tokens": 3, "seed": 1}),
        ("/v1/completions", {"prompt": list(range(40, 62)), "max_tokens": 3, "seed": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "seed": 3,
                                  "logprobs": True, "top_logprobs": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "seed": 3,
                                  "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"prompt": LONG, "max_tokens": 5, "seed": 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 5, "seed": 4}),
        ("/v1/completions", {"prompt": "x" * 3500, "max_tokens": 3}),  # past max_prompt_tokens: a 400
        ("/v1/completions", {"prompt": "x", "max_tokens": 3, "logprobs": 99}),  # past max_top_logprobs: a 400
    ]
    out = []
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, body in bodies:
            r = http.post(path, json={"model": MODEL, **body})
            answer = sse_events(r.iter_lines()) if body.get("stream") else r.json()
            out.append((r.status_code, _without_ids(answer)))
    return out


def _without_ids(value):
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "created")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def test_the_two_process_server_answers_as_the_one_process_server_does(pair):
    one, two = pair
    for server in pair:
        httpx.post(server.url + "/reset_prefix_cache")
    want, got = _answers(one.url), _answers(two.url)
    assert got == want
    assert two.wait_idle() and not two.orch._open  # a request stopped by a stop string is forgotten too
    assert want[0][1]["choices"][0]["text"] == expected("Hello", 12, seed=7)[0]  # the fake engine's own tokens
    assert want[10][1]["choices"][0]["text"] == expected(LONG, 5, seed=4, max_seq_len=4096)[0]
    assert want[11][1]["usage"]["prompt_tokens"] == len(TOK.encode(f"<|user|>\n{LONG}\n<|assistant|>\n")) + 1
    assert re.fullmatch("[0-9]{3}-x", want[4][1]["choices"][0]["text"])
    assert [want[i][1]["usage"]["prompt_tokens_details"]["cached_tokens"] for i in (6, 7)] == [0, 20]
    assert [status for status, _ in want[-2:]] == [400, 400]


def test_64_concurrent_streams_each_get_exactly_their_tokens_and_both_sides_count_them(pair):
    server = pair[1]
    before = server.metrics()
    bodies = [{"model": MODEL, "prompt": f"request {i}:", "max_tokens": 4 + i % 13, "seed": i} for i in range(64)]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*(_stream(http, b) for b in bodies))

    for body, (status, text, reason, usage) in zip(bodies, asyncio.run(run())):
        want, want_reason, ids = expected(body["prompt"], body["max_tokens"], body["seed"], max_seq_len=4096)
        assert (status, text, reason, usage["completion_tokens"]) == (200, want, want_reason, len(ids))
    m = server.wait_idle()
    assert not server.orch._open

    def moved(name: str) -> float:
        return m[name] - before.get(name, 0)

    tokens = sum(4 + i % 13 for i in range(64))
    assert moved("hypertron_time_to_first_token_seconds_count") == 64  # the front end's
    assert moved("hypertron_generation_tokens_total") == tokens  # the engine process's
    assert moved("hypertron_prompt_tokens_total") == sum(len(TOK.encode(b["prompt"])) + 1 for b in bodies)
    assert moved("hypertron_step_seconds_count") > 0 and m["hypertron_kv_pages_total"] == 2048
    families = [f.name for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)]
    assert len(families) == len(set(families))  # each metric once: from one side or the other


def test_the_front_end_bounds_the_queue_and_a_stop_aborts_what_is_left():
    """One slot, 0.2 s a step: the first request is taken, the second waits, the third is over
    ``max_queue`` (counted in the front end, before the engine reports anything). Stopping ends the
    two still running with ``abort``."""
    client = EngineClient(fake_orchestrator, ({"max_slots": 1, "step_delay": 0.2},), max_queue=2)

    async def run():
        gens = [client.submit([5, 6], SamplingParams(max_tokens=50, seed=i)) for i in range(2)]
        with pytest.raises(QueueFull, match="2 requests are waiting already"):
            client.submit([5, 6], SamplingParams(max_tokens=50))
        first = await gens[0].__anext__()
        await asyncio.to_thread(client.stop)
        rest = [[c async for c in g] for g in gens]
        return first, rest, gens

    try:
        first, rest, gens = asyncio.run(run())
    finally:
        client.stop()
    assert first.token_ids and [g.finish_reason for g in gens] == ["abort", "abort"]
    assert [r[-1].error for r in rest] == [STOPPED, STOPPED] and not client.running and client._process.returncode == 0


def test_an_engine_process_that_dies_ends_its_streams_and_the_server_says_so():
    with ProcessServer({"step_delay": 0.05}) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 100, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            os.kill(server.orch._process.pid, signal.SIGKILL)
            events = sse_events(lines)
        assert events[-2]["error"]["message"] == ENDED and events[-1] == "[DONE]"
        assert http.get("/health").status_code == 503
        refused = http.post("/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 503 and ENDED in refused.json()["error"]["message"]
        assert http.post("/reset_prefix_cache").status_code == 503
        assert "hypertron_time_to_first_token_seconds" in http.get("/metrics").text  # the front end's side still


def test_an_engine_process_that_cannot_start_says_why():
    with pytest.raises(ConfigError, match="^checkpoint: not a run$"):
        EngineClient(refuse_to_start, (ConfigError, "checkpoint: not a run"), max_queue=1)
    with pytest.raises(RuntimeError, match="OSError: disk on fire"):
        EngineClient(refuse_to_start, (OSError, "disk on fire"), max_queue=1)
