"""``hypertron bench serve`` against a stub OpenAI-compatible server started in this file.

The stub (FastAPI + uvicorn on 127.0.0.1, a free port, a background thread
that stops at the end of the module) streams ``max_tokens`` one-token chunks,
the first after ``TTFT_S`` and the rest ``ITL_S`` apart, then the usage chunk
and ``[DONE]``. A marker in a text prompt makes it fail: ``FAIL429`` answers
HTTP 429, ``ERRMID`` sends an error event after two tokens, ``DROP`` closes
the connection after two tokens, ``CUTOFF`` ends the stream cleanly after two
tokens with no choice finished; ``NODONE`` (not a failure) leaves out
``[DONE]``, as ``transformers serve`` does. It records every body and header it saw and
the most requests it ever had in flight, so the tests check what reached the
server, not only what the client says. The official ``openai`` client reads
the stub's stream, so the stub speaks the real protocol.

Metric formulas are checked exactly on hand-made timings through the pure
``summarize``; timings measured against the stub only within generous bounds.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
from collections import Counter

import numpy as np
import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import Request  # at module level: the stub's annotations are strings
from http_harness import ThreadedServer  # tests/

from hypertron.cli import main
from hypertron.launch.local import free_ports
from hypertron import loadgen
from hypertron.loadgen import BenchSettings, Prompt, RequestRecord
from support import processes  # tests/support

TTFT_S = 0.05
ITL_S = 0.02
MODEL = "stub-model"


class StubState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.bodies: list[dict] = []
            self.auth: list[str | None] = []
            self.in_flight = 0
            self.max_in_flight = 0
            self.ttft_s = TTFT_S

    def enter(self, body: dict, auth: str | None) -> None:
        with self.lock:
            self.bodies.append(body)
            self.auth.append(auth)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


def _sse(obj) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def make_app(state: StubState):
    from fastapi.responses import JSONResponse, StreamingResponse

    app = fastapi.FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state.enter(body, request.headers.get("authorization"))
        prompt, n = body["prompt"], body["max_tokens"]
        marker = prompt if isinstance(prompt, str) else ""
        if "FAIL429" in marker:
            state.leave()
            return JSONResponse({"error": {"message": "rate limited", "type": "rate_limit"}}, status_code=429)

        def chunk(text, finish=None):
            return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        async def stream():
            # leave() before the last bytes go out, so a client that starts its next request as
            # soon as this one ends can never be counted as one more in flight
            try:
                await asyncio.sleep(state.ttft_s)
                for i in range(n):
                    if i:
                        await asyncio.sleep(ITL_S)
                    if i == 2 and ("ERRMID" in marker or "CUTOFF" in marker):
                        break
                    if i == 2 and "DROP" in marker:
                        raise RuntimeError("stub drops the connection")
                    yield _sse(chunk(f"t{i} "))
            finally:
                state.leave()
            if "ERRMID" in marker:
                yield _sse({"error": {"message": "engine died", "code": 500}})
                return
            if "CUTOFF" in marker:
                return
            yield _sse(chunk("", "length"))
            n_in = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            yield _sse({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
                        "choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n,
                                                 "total_tokens": n_in + n}})
            if "NODONE" not in marker:
                yield _sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


class Stub(ThreadedServer):
    def __init__(self) -> None:
        self.state = StubState()
        super().__init__(make_app(self.state))


@pytest.fixture(scope="module")
def stub():
    with Stub() as s:
        yield s


@pytest.fixture
def server(stub):
    stub.state.reset()
    return stub


def _run(settings: BenchSettings, prompts: list[Prompt]) -> loadgen.BenchRun:
    settings.validate()
    return asyncio.run(loadgen.run_benchmark(settings, prompts))


# ---------------------------------------------------------------- pure pieces


def test_arrival_schedule_is_seeded_poisson():
    a = loadgen.arrival_schedule(2000, rate=50.0, seed=7)
    assert a.shape == (2000,) and a[0] == 0.0 and np.all(np.diff(a) >= 0)
    np.testing.assert_array_equal(a, loadgen.arrival_schedule(2000, rate=50.0, seed=7))
    assert not np.array_equal(a, loadgen.arrival_schedule(2000, rate=50.0, seed=8))
    gaps = np.diff(a)
    assert abs(gaps.mean() - 1 / 50) < 0.1 / 50  # exponential: mean 1/rate, sd 1/rate
    assert abs(gaps.std() - 1 / 50) < 0.15 / 50
    np.testing.assert_array_equal(loadgen.arrival_schedule(5, math.inf, 0), np.zeros(5))
    # the arrivals do not depend on the prompts drawn from the same seed
    p1 = loadgen.random_prompts(3, 4, 3, 259, 8, seed=7)
    assert p1 == loadgen.random_prompts(3, 4, 3, 259, 8, seed=7)
    assert all(len(p.prompt) == 4 and all(3 <= t < 259 for t in p.prompt) for p in p1)


def test_metric_formulas_on_hand_made_timings():
    # request 0: sent at 10.0, chunks at 10.1, 10.15, 10.25, 10.3, done at 10.4, usage says 5 tokens
    r0 = RequestRecord(0, start=10.0, end=10.4, chunk_times=[10.1, 10.15, 10.25, 10.3], output_tokens=5,
                       input_tokens=7)
    # request 1: one token only: TTFT and latency count, no TPOT, no ITL
    r1 = RequestRecord(1, start=10.2, end=10.5, chunk_times=[10.45], output_tokens=1, input_tokens=3)
    # request 2: failed mid-stream after a chunk: left out of every figure
    r2 = RequestRecord(2, start=10.0, end=10.3, chunk_times=[10.05], output_tokens=0, status=200)
    r2.fail("stream", "engine died")
    r3 = RequestRecord(3, start=10.0, end=10.01, status=429)
    r3.fail("HTTP 429", "rate limited")
    s = loadgen.summarize([r0, r1, r2, r3], duration_s=0.5)
    assert (s["completed"], s["failed"]) == (2, 2)
    assert s["errors"] == {"stream": 1, "HTTP 429": 1}
    assert s["first_error"] == "HTTP 429: rate limited"  # the first to end
    assert s["request_throughput"] == pytest.approx(2 / 0.5)
    assert s["total_output_tokens"] == 6 and s["output_throughput"] == pytest.approx(6 / 0.5)
    assert s["total_input_tokens"] == 10
    ttft = [100.0, 250.0]
    assert s["ttft_ms"]["mean"] == pytest.approx(np.mean(ttft))
    assert s["ttft_ms"]["p50"] == pytest.approx(175.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(100 + 0.9 * 150)
    assert s["tpot_ms"]["mean"] == pytest.approx((400 - 100) / 4)  # (latency - TTFT) / (tokens - 1)
    itl = [50.0, 100.0, 50.0]
    assert s["itl_ms"]["mean"] == pytest.approx(np.mean(itl)) and s["itl_ms"]["p50"] == pytest.approx(50.0)
    assert s["itl_ms"]["p99"] == pytest.approx(np.percentile(itl, 99))
    assert s["e2e_latency_ms"]["mean"] == pytest.approx((400 + 300) / 2)
    empty = loadgen.summarize([r3], duration_s=0.1)
    assert empty["completed"] == 0 and empty["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}


# ---------------------------------------------------------------- against the stub


def test_stub_speaks_the_openai_protocol(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k")
    assert [m.id for m in client.models.list()] == [MODEL]
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "t0 t1 t2 "
    assert chunks[-1].usage.completion_tokens == 3


def test_fixed_concurrency_accounts_for_every_request(server):
    n, conc, max_tokens = 16, 3, 5
    markers = {3: " FAIL429", 9: " FAIL429", 5: " ERRMID", 11: " DROP", 13: " CUTOFF", 7: " NODONE"}
    prompts = [Prompt(f"req-{i}" + markers.get(i, ""), max_tokens) for i in range(n)]
    settings = BenchSettings(base_url=server.url, num_requests=n, concurrency=conc, max_tokens=max_tokens)
    run = _run(settings, prompts)
    assert run.model == MODEL
    seen = Counter(b["prompt"] for b in server.state.bodies)
    assert seen == Counter(p.prompt for p in prompts)  # every prompt sent exactly once
    assert server.state.max_in_flight == conc
    assert [r.index for r in run.records] == list(range(n))
    failed = {r.index: r.error_kind for r in run.records if not r.ok}
    assert failed == {3: "HTTP 429", 9: "HTTP 429", 5: "stream", 11: "RemoteProtocolError", 13: "stream"}
    assert run.records[3].status == 429 and "rate limited" in run.records[3].error
    assert "engine died" in run.records[5].error and "before any choice finished" in run.records[13].error
    assert run.records[7].ok and run.records[7].output_tokens == max_tokens  # no [DONE], finished: complete
    s = loadgen.summarize(run.records, run.duration_s)
    assert s["completed"] + s["failed"] == n and s["failed"] == 5
    assert s["total_output_tokens"] == 11 * max_tokens
    # the stub's sleeps are lower bounds server-side; a client late to read a chunk (a loaded
    # machine) shortens the gap after it, hence the loose lower bounds on ITL and TPOT
    assert TTFT_S * 1e3 <= s["ttft_ms"]["p50"] < TTFT_S * 1e3 + 500
    assert 0.25 * ITL_S * 1e3 <= s["itl_ms"]["mean"] < ITL_S * 1e3 + 200
    assert 0.25 * ITL_S * 1e3 <= s["tpot_ms"]["mean"] < ITL_S * 1e3 + 200
    expected_e2e = (TTFT_S + (max_tokens - 1) * ITL_S) * 1e3
    assert expected_e2e <= s["e2e_latency_ms"]["p50"] < expected_e2e + 1000
    # 11 successes of >= 0.13 s, 3 at a time: some worker spent at least 4 of them
    assert run.duration_s >= 4 * expected_e2e / 1e3
    body = server.state.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["model"] == MODEL and "ignore_eos" not in body


def test_all_at_once_random_prompts(server):
    n = 20
    server.state.ttft_s = 1.0  # room for all 20 to arrive before the first one ends, on a busy machine too
    settings = BenchSettings(base_url=server.url + "/v1/", num_requests=n, random_input_len=6, max_tokens=3,
                             seed=3, ignore_eos=True, model="named", api_key="sekrit")
    run = _run(settings, loadgen.build_prompts(settings))
    expected = loadgen.random_prompts(n, 6, 3, 259, 3, seed=3)
    assert Counter(tuple(b["prompt"]) for b in server.state.bodies) == Counter(tuple(p.prompt) for p in expected)
    assert server.state.max_in_flight == n  # no client-side connection cap
    assert all(r.ok and r.output_tokens == 3 and r.input_tokens == 6 for r in run.records)
    assert all(b["ignore_eos"] is True and b["model"] == "named" for b in server.state.bodies)
    assert set(server.state.auth) == {"Bearer sekrit"}


def test_poisson_rate_spreads_the_requests(server):
    n, rate = 8, 40.0
    settings = BenchSettings(base_url=server.url, num_requests=n, request_rate=rate, max_tokens=2, seed=1)
    run = _run(settings, loadgen.build_prompts(settings))
    offsets = loadgen.arrival_schedule(n, rate, 1)
    starts = np.array([r.start for r in run.records])
    assert np.all(starts - run.t0 >= offsets)  # none leaves before its time
    assert starts[-1] - run.t0 < offsets[-1] + 0.5  # nor waits long after it
    assert len(server.state.bodies) == n


def test_cli_writes_the_json_report(server, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n\n{"prompt": [5, 6, 7], "max_tokens": 2}\n'
                       '{"prompt": "x FAIL429"}\n')
    out = tmp_path / "report.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--prompts", str(prompts), "--num-requests", "5",
               "--concurrency", "2", "--max-tokens", "4", "--api-key", "sekrit", "--output", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "TTFT" in stdout and "ITL" in stdout and "HTTP 429" in stdout
    report = json.loads(out.read_text())
    for key in ("date", "hypertron_version", "base_url", "model", "settings", "completed", "failed",
                "duration_s", "request_throughput", "output_throughput", "total_input_tokens",
                "total_output_tokens", "ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms", "errors",
                "first_error", "requests"):
        assert key in report, key
    assert report["base_url"] == server.url and report["model"] == MODEL
    assert (report["completed"], report["failed"]) == (4, 1) and report["errors"] == {"HTTP 429": 1}
    assert report["total_output_tokens"] == 4 + 2 + 4 + 2  # prompts cycled: 0, 1, (2 fails), 0, 1
    assert report["total_input_tokens"] == 2 + 3 + 2 + 3
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert set(report[key]) == {"mean", "p50", "p90", "p99"} and report[key]["p50"] > 0
    settings = report["settings"]
    assert settings["concurrency"] == 2 and settings["mode"] == "concurrency" and settings["num_requests"] == 5
    assert "sekrit" not in out.read_text() and settings["api_key"] == "(set)"
    assert [r["index"] for r in report["requests"]] == list(range(5))
    assert report["requests"][2]["status"] == 429


@pytest.mark.parametrize("args, names", [
    (["--num-requests", "0"], "--num-requests=0"),
    (["--concurrency", "-2"], "--concurrency=-2"),
    (["--request-rate", "0"], "--request-rate=0"),
    (["--request-rate", "nan"], "--request-rate=nan"),
    (["--max-tokens", "0"], "--max-tokens=0"),
    (["--random-input-len", "0"], "--random-input-len=0"),
    (["--random-vocab-low", "9", "--random-vocab-high", "9"], "--random-vocab-low=9"),
    (["--request-rate", "2", "--concurrency", "2"], "not both"),
    (["--prompts", "MISSING"], "no such file"),
    (["--prompts", "BAD_JSON"], "bad.jsonl:2: not valid JSON"),
    (["--prompts", "BAD_PROMPT"], 'bad.jsonl:1: "prompt" must be'),
    (["--prompts", "BAD_MAX"], 'bad.jsonl:1: "max_tokens" must be'),
    (["--prompts", "EMPTY"], "no prompts"),
    (["--output", "NODIR"], "does not exist"),
    (["--base-url", "DEAD"], "cannot reach the server"),
])
def test_cli_user_errors_are_one_line(tmp_path, capsys, args, names):
    bad = tmp_path / "bad.jsonl"
    fill = {
        "MISSING": str(tmp_path / "missing.jsonl"), "NODIR": str(tmp_path / "no" / "r.json"),
        "DEAD": f"http://127.0.0.1:{free_ports()}", "EMPTY": str(tmp_path / "empty.jsonl"),
    }
    contents = {"BAD_JSON": '{"prompt": "a"}\n{"prompt": \n', "BAD_PROMPT": '{"prompt": [1, "x"]}\n',
                "BAD_MAX": '{"prompt": "a", "max_tokens": 0}\n', "EMPTY": "\n"}
    for key, text in contents.items():
        if key in args:
            (bad if key != "EMPTY" else tmp_path / "empty.jsonl").write_text(text)
            fill.setdefault(key, str(bad))
    argv = ["bench", "serve", "--base-url", fill["DEAD"], *[fill.get(a, a) for a in args]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and names in err, err


def test_cli_subprocess_one_line_and_no_jax():
    # the real command: exit 2, one line, no traceback; and neither the CLI nor loadgen imports JAX
    r = processes.run([sys.executable, "-m", "hypertron.cli", "bench", "serve", "--base-url",
                        f"http://127.0.0.1:{free_ports()}", "--num-requests", "2"],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot reach" in r.stderr, r.stderr
    code = "import sys, hypertron.cli, hypertron.loadgen; assert 'jax' not in sys.modules"
    processes.run([sys.executable, "-c", code], check=True, timeout=60)
