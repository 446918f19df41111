"""The orchestrator and the OpenAI-compatible server, over a deterministic fake engine.

Servers run in a thread on 127.0.0.1 (a free port) and are stopped by each test. The fake
engine (tests/fake_engine.py) makes every request's tokens a function of its own prompt and
seed, so :func:`fake_engine.reference` says exactly what each request must receive.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
from fake_engine import LOGPROBS, TOP, FakeEngine, reference  # tests/
from http_harness import ThreadedServer  # tests/
from prometheus_client.parser import text_string_to_metric_families

from hypertron.config import SchedulerConfig
from hypertron.tokenizer import chat_template_beside, get_tokenizer
from hypertron.errors import UserError
from hypertron.serve.detokenize import IncrementalDetokenizer
from hypertron.serve.orchestrator import Orchestrator
from hypertron.serve.server import create_app
from hypertron.serve.types import SamplingParams

uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

TOK = get_tokenizer("byte")
MODEL = "fake-model"


class Server(ThreadedServer):
    """An orchestrator + app over ``engine``, served by uvicorn in a thread."""

    def __init__(self, engine: FakeEngine, *, max_queue: int = 512, enable_prefix_caching: bool = True,
                 tokenizer=TOK, scheduler: dict | None = None, **app_kwargs):
        self.engine = engine
        self.orch = Orchestrator(engine, tokenizer, SchedulerConfig(max_queue=max_queue, **(scheduler or {}),
                                                                    enable_prefix_caching=enable_prefix_caching))
        super().__init__(create_app(self.orch, tokenizer, MODEL, **app_kwargs), lifespan="on", log_level="warning",
                         graceful_s=2)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        assert not self.orch.running

    def metrics(self) -> dict[str, float]:
        """Every sample of GET /metrics as {"name{label=value}": value}."""
        text = httpx.get(self.url + "/metrics").text
        return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def wait_idle(self, timeout: float = 5.0) -> dict[str, float]:
        """Metrics once every slot and page is free and nothing waits (asserts it happens)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["hypertron_slots_in_use"], m["hypertron_queue_depth"]) == (0, 0) and \
                    m["hypertron_kv_pages_free"] == m["hypertron_kv_pages_total"]:
                return m
            gauges = {k: v for k, v in m.items() if k.split("_")[1] in ("slots", "queue", "kv")}
            assert time.monotonic() < deadline, f"not idle: {gauges}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def server():
    with Server(FakeEngine(max_slots=4, max_seq_len=256, num_pages=256), max_prompt_tokens=200,
                max_tokens_limit=128, max_body_bytes=64 << 10) as s:
        yield s


def expected(prompt: str | list[int], max_tokens: int = 16, seed: int = 0, max_seq_len: int = 256,
             **sampling) -> tuple[str, str, list[int]]:
    """(text, finish reason, token ids) the fake engine must give for a completion request."""
    ids = prompt if isinstance(prompt, list) else [TOK.bos_id] + TOK.encode(prompt)
    out, reason = reference(ids, SamplingParams(max_tokens=max_tokens, seed=seed, **sampling), max_seq_len)
    return TOK.decode(out), reason, out


def client(s: Server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def shown(token_id: int) -> str:
    """How the server names a byte token in logprobs: its text, or ``bytes:\\xNN`` for a lone non-ASCII byte."""
    text = TOK.decode([token_id])
    return f"bytes:\\x{token_id - 3:02x}" if text == "\ufffd" else text


def sse_events(lines) -> list:
    """The JSON payloads of an SSE stream's ``data:`` lines, and "[DONE]"."""
    return [ln[6:] if ln == "data: [DONE]" else json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]


def test_incremental_detokenizer_waits_for_whole_characters():
    text = "aé€😀b"
    pieces = []
    detok = IncrementalDetokenizer(TOK)
    for t in TOK.encode(text):
        pieces.append(detok.add(t))
    assert "".join(pieces) + detok.flush() == text
    assert "\ufffd" not in "".join(pieces) and [p for p in pieces if p] == ["a", "é", "€", "😀", "b"]
    detok = IncrementalDetokenizer(TOK)
    assert detok.add(TOK.encode("€")[0]) == "" and detok.flush() == "\ufffd"  # cut short: replaced at the end


class _PieceTokenizer:
    """SentencePiece-like: "▁" is a space, dropped at the start of what is decoded."""

    pieces = ("▁a", "▁b", "c")

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").lstrip(" ")


def test_incremental_detokenizer_keeps_spaces_that_depend_on_the_left_neighbour():
    detok = IncrementalDetokenizer(_PieceTokenizer(), context=[0])  # the prompt ends in "a"
    assert [detok.add(t) for t in (1, 2, 0)] == [" b", "c", " a"]


def test_a_streamed_events_template_writes_what_its_model_would():
    """The server streams a request's text-only events from a template made once
    (``sse.Template``): the same JSON, byte for byte, as dumping each event's model."""
    from hypertron.serve.api import ChatChunkChoice, ChatCompletionChunk, Completion, CompletionChoice, Delta
    from hypertron.serve.sse import TEXT_MARK, Template, dump_event

    def completion(text):
        return Completion(id="cmpl-1", created=5, model="m", choices=[CompletionChoice(text=text, finish_reason=None)])

    def chat(text):
        return ChatCompletionChunk(id="chatcmpl-1", created=5, model="m", choices=[ChatChunkChoice(delta=Delta(content=text))])

    texts = ["plain", 'a "quote", a \\ backslash', "new\nline\ttab", "h\u00e9llo \u2713 \U0001f389", "\x00\x1f", TEXT_MARK]
    for exclude in (None, {"usage"}):
        for make in (completion, chat):
            template = Template(make(TEXT_MARK), exclude)
            for text in texts:
                assert template(text) == dump_event(make(text), exclude)


def test_openai_client_completes_chats_and_streams(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt="Hello", max_tokens=12, seed=7)
    text, reason, _ = expected("Hello", 12, seed=7)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (text, reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 12, 18)
    pieces = [ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt="Hello", max_tokens=12, seed=7,
                                                                  stream=True)]
    assert "".join(pieces) == text and len(pieces) > 1

    # chat: the default template, BOS first
    prompt = [TOK.bos_id] + TOK.encode("<|user|>\nhi\n<|assistant|>\n")
    text, reason, _ = expected(prompt, 10, seed=3)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10, seed=3)
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.prompt_tokens) == (text, reason, len(prompt))
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                       seed=3, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # token-id prompts, alone or as a one-element list
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, seed=1)
        assert r.choices[0].text == expected([5, 6, 7], 5, seed=1)[0]


def test_a_guided_request_on_the_fake_engine_keeps_its_grammar_one_step_ahead(server):
    """The fake engine takes grammars as the real one does (tests/test_structured_output.py is
    the real engine's): a choice and a regex hold, streamed and not, beside unguided requests."""
    def post(body):
        return httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "pick", "max_tokens": 20,
                                                                "ignore_eos": True, **body}).json()

    for seed in range(3):
        assert post({"seed": seed, "structured_outputs": {"choice": ["yes", "no"]}})["choices"][0]["text"] in (
            "yes", "no")
        text = post({"seed": seed, "structured_outputs": {"regex": "[0-9]{3}-x"}})["choices"][0]["text"]
        assert re.fullmatch("[0-9]{3}-x", text), text


def test_seeds_greedy_stops_and_lengths(server):
    c = client(server)

    def complete(**kw):
        r = c.completions.create(model=MODEL, **{"prompt": "seeded", "max_tokens": 20, **kw})
        return r.choices[0].text, r.choices[0].finish_reason

    a, b, other = complete(seed=11), complete(seed=11), complete(seed=12)
    assert a == b == expected("seeded", 20, seed=11)[:2] and other != a
    assert complete(temperature=0, seed=1) == complete(temperature=0, seed=2)  # greedy: no seed involved
    # EOS ("~3": the fake emits EOS 3 tokens later) ends with "stop" and is not returned; ignore_eos goes on
    assert complete(prompt="go~3", seed=0) == (expected("go~3", 20)[0], "stop")
    assert len(expected("go~3", 20)[0]) == 3
    assert complete(prompt="go~3", seed=0, extra_body={"ignore_eos": True}) == (
        expected("go~3", 20, ignore_eos=True)[0], "length")
    # a stop string is cut off (also when split over tokens, also while streaming); stop_token_ids
    full = expected("seeded", 20, seed=11)[0]
    stop = full[5:7]
    want = full[:full.find(stop)]
    assert complete(seed=11, stop=[stop, "never"]) == (want, "stop")
    streamed = list(c.completions.create(model=MODEL, prompt="seeded", max_tokens=20, seed=11, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == want and streamed[-1].choices[0].finish_reason == "stop"
    ids = expected("seeded", 20, seed=11)[2]
    stop_ids = {"stop_token_ids": [ids[4]]}
    assert complete(seed=11, extra_body=stop_ids) == (TOK.decode(ids[:ids.index(ids[4])]), "stop")
    # the sequence reaching max_seq_len (256) ends with "length"
    r = c.completions.create(model=MODEL, prompt=[5] * 195, max_tokens=100, seed=0)
    assert (len(r.choices[0].text), r.choices[0].finish_reason, r.usage.completion_tokens) == (61, "length", 61)
    server.wait_idle()


def test_logprobs_and_echo(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "seed": 5, "logprobs": 3, "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=body).json()
    choice = r["choices"][0]
    prompt = [TOK.bos_id] + TOK.encode("abc")
    text, _, out = expected("abc", 6, seed=5)
    assert choice["text"] == "abc" + text
    lp = choice["logprobs"]
    seq = prompt + out
    assert lp["tokens"] == [shown(t) for t in seq] and lp["tokens"][0] == ""
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [0, 0, 1, 2] + [3 + i for i in range(6)]
    for i in range(1, len(seq)):
        prev, tok = seq[i - 1], seq[i]
        assert lp["token_logprobs"][i] == pytest.approx(LOGPROBS[prev, tok], abs=1e-6)
        want = {shown(t): LOGPROBS[prev, t] for t in TOP[prev, :3]} | {shown(tok): LOGPROBS[prev, tok]}
        assert len(want) == 4 or tok in TOP[prev, :3]
        assert lp["top_logprobs"][i] == pytest.approx(want, abs=1e-6)
    assert r["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                          "prompt_tokens_details": {"cached_tokens": 0}}  # echo: prompt logprobs, no sharing

    # streamed, the same numbers arrive chunk by chunk
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as resp:
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert "".join(ch["text"] for ch in chunks) == choice["text"]
    joined = {k: [v for ch in chunks for v in ch["logprobs"][k]] for k in lp}
    assert joined == lp

    # chat: logprobs bool + top_logprobs
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "seed": 2,
            "logprobs": True, "top_logprobs": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat).json()
    content = r["choices"][0]["logprobs"]["content"]
    prompt = [TOK.bos_id] + TOK.encode("<|user|>\nx\n<|assistant|>\n")
    _, _, out = expected(prompt, 4, seed=2)
    seq = prompt + out
    assert [e["token"] for e in content] == [shown(t) for t in out]
    for k, e in enumerate(content):
        prev, tok = seq[len(prompt) - 1 + k], out[k]
        assert e["logprob"] == pytest.approx(LOGPROBS[prev, tok], abs=1e-6) and e["bytes"] == [tok - 3]
        assert [t["token"] for t in e["top_logprobs"]] == [shown(t) for t in TOP[prev, :2]]
        assert [t["bytes"] for t in e["top_logprobs"]] == [[t - 3] for t in TOP[prev, :2]]


LLAMA2_LIKE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]{% else %} {{ m['content'] }}{% endif %}"
    "{% endfor %}"
)


def test_chat_template_from_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA2_LIKE}))
    template = chat_template_beside(str(tmp_path / "tokenizer.json"))
    assert template == LLAMA2_LIKE and TOK.chat_template is None
    with Server(FakeEngine(), chat_template=template) as s:
        messages = [{"role": "user", "content": "hi "}, {"role": "assistant", "content": "yo"},
                    {"role": "user", "content": [{"type": "text", "text": "more"}]}]
        r = client(s).chat.completions.create(model=MODEL, messages=messages, max_tokens=5, seed=4)
        prompt = TOK.encode("[INST] hi [/INST] yo[INST] more [/INST]")  # the template's text, no BOS added
        assert r.usage.prompt_tokens == len(prompt) and r.choices[0].message.content == expected(prompt, 5, 4)[0]
        bad = httpx.post(s.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages[1:]})
        assert bad.status_code == 400 and "alternate" in bad.json()["error"]["message"]
    with pytest.raises(UserError, match="chat_template"):
        create_app(Orchestrator(FakeEngine(), TOK), TOK, MODEL, chat_template="{% for %}")


BAD = [  # (endpoint, body or raw bytes, status, param)
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"prompt": "hi"}, 400, "model"),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("chat/completions", {"model": MODEL}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "messages"),
    ("completions", {"model": MODEL, "prompt": "x" * 300}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": [3, 999]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 129}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
    ("completions", {"model": MODEL, "prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "hi", "stop": [1]}, 400, "stop"),
    ("completions", {"model": MODEL, "prompt": "hi", "cache_salt": 7}, 400, "cache_salt"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "cache_salt": "s" * 257}, 400, "cache_salt"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("completions", {"model": MODEL, "prompt": "x" * (80 << 10)}, 413, None),
]


def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(server):
    good = {"model": MODEL, "prompt": "ok", "max_tokens": 3, "seed": 0}
    with httpx.Client(base_url=server.url) as http:
        for endpoint, body, status, param in BAD:
            kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body}
            r = http.post(f"/v1/{endpoint}", **kw)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
            assert error["param"] == param, error
            ok = http.post("/v1/completions", json=good)
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected("ok", 3)[0]
        r = http.get("/v1/nowhere")
        assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client(server).completions.create(model=MODEL, prompt="x", temperature=-1)


def test_api_key_guards_v1_only():
    with Server(FakeEngine(), api_key="sekrit") as s:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        wrong = httpx.post(s.url + "/v1/completions", headers={"Authorization": "Bearer nope"}, json={})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}
        assert httpx.get(s.url + "/metrics").status_code == 200
        assert httpx.post(s.url + "/reset_prefix_cache").status_code == 401
        assert httpx.post(s.url + "/reset_prefix_cache", headers={"Authorization": "Bearer sekrit"}).json() == \
            {"pages_dropped": 0}
        with pytest.raises(openai.AuthenticationError):
            client(s, api_key="nope").completions.create(model=MODEL, prompt="a", max_tokens=2)
        r = client(s, api_key="sekrit").completions.create(model=MODEL, prompt="a", max_tokens=2, seed=0)
        assert r.choices[0].text == expected("a", 2)[0]


def test_a_shared_prompt_reports_its_cached_pages_and_a_salt_or_caching_off_none(server):
    """The fake engine's pages are 4 tokens: a 22-token prompt run again finds its first 5 pages
    (20 tokens; the sixth holds its last token, which is prefilled); another cache_salt finds
    nothing; the counters move; /reset_prefix_cache drops what no request holds."""
    prompt = list(range(40, 62))
    server.wait_idle()
    with httpx.Client(base_url=server.url) as http:
        http.post("/reset_prefix_cache")
        before = server.metrics()

        def cached(stream=False, **kw) -> int:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "seed": 1, **kw}
            if not stream:
                r = http.post("/v1/completions", json=body).json()
                assert r["choices"][0]["text"] == expected(prompt, 3, seed=1)[0]
                return r["usage"]["prompt_tokens_details"]["cached_tokens"]
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/completions", json=body) as resp:
                return sse_events(resp.iter_lines())[-2]["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert [cached(), cached(), cached(stream=True), cached(cache_salt="a"), cached(cache_salt="a")] == \
            [0, 20, 20, 0, 20]
        m = server.wait_idle()
        queries, hits = (m[f"hypertron_prefix_cache_{k}_total"] - before[f"hypertron_prefix_cache_{k}_total"]
                         for k in ("queries", "hits"))
        assert (queries, hits) == (5 * 22, 60) and m["hypertron_kv_pages_cached"] >= 10
        assert http.post("/reset_prefix_cache").json()["pages_dropped"] == m["hypertron_kv_pages_cached"]
        assert server.wait_idle()["hypertron_kv_pages_cached"] == 0 and cached() == 0
    with Server(FakeEngine(), enable_prefix_caching=False) as off, httpx.Client(base_url=off.url) as http:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "seed": 1}
        usage = [http.post("/v1/completions", json=body).json()["usage"] for _ in range(2)]
        assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == [0, 0]
        assert off.metrics()["hypertron_kv_pages_cached"] == 0


def test_client_that_disconnects_frees_its_slot(server):
    abort = "hypertron_requests_total{finish_reason=abort}"
    before = server.metrics().get(abort, 0)
    server.engine.step_delay = 0.05  # 100 tokens would take five seconds
    try:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            assert server.metrics()["hypertron_slots_in_use"] == 1
        assert server.wait_idle(timeout=3.0)[abort] == before + 1  # freed long before the 100 tokens
        with pytest.raises(httpx.ReadTimeout):  # not streaming: noticed while waiting for the answer
            httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.2)
        assert server.wait_idle(timeout=3.5)[abort] == before + 2  # polled each 0.5 s; a busy CI took 1.5
    finally:
        server.engine.step_delay = 0.0
    calls = server.engine.calls
    time.sleep(0.2)
    assert server.engine.calls == calls  # idle: the loop sleeps instead of polling the engine


def test_orchestrator_ends_a_lone_sequence_past_the_pool_and_drops_cancelled_ones():
    # 16 tokens of KV in all. Each step takes 10 ms: the loop thread, given the GIL between the
    # two submissions and the cancel, could otherwise finish the first request and prefill the
    # second before the cancel is made (seen on a loaded machine).
    engine = FakeEngine(max_slots=1, max_seq_len=64, page_size=4, num_pages=4, step_delay=0.01)
    orch = Orchestrator(engine, TOK, SchedulerConfig(max_queue=4)).start()
    prompt = TOK.encode("ten tokens")

    async def run():
        alone = orch.submit(prompt, SamplingParams(max_tokens=40, seed=0))
        queued = orch.submit(prompt, SamplingParams(max_tokens=5, seed=0))
        queued.cancel()  # behind the first in the queue: never prefilled
        return [c async for c in alone], [c async for c in queued]

    try:
        chunks, cancelled = asyncio.run(run())
    finally:
        orch.stop()
    out, _ = reference(prompt, SamplingParams(max_tokens=40, seed=0), 64)
    # 10 prompt tokens + 6 fed back fill the 16 tokens of KV: 7 tokens, then "length"
    assert [t for c in chunks for t in c.token_ids] == out[:7] and chunks[-1].finish_reason == "length"
    assert cancelled == [] and engine.prefills == 1 and orch.scheduler.stats()["pages_free"] == 4
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(_submit_one(orch))


def phase_seconds(registry) -> tuple[dict[str, float], float, float]:
    """``(seconds by phase, seconds of the turns, turns)`` from a server's metrics."""
    from hypertron.serve.metrics import STEP_PHASES

    get = registry.get_sample_value
    return ({p: get("hypertron_step_phase_seconds_sum", {"phase": p}) for p in STEP_PHASES},
            get("hypertron_step_seconds_sum"), get("hypertron_step_seconds_count"))


def test_the_step_breakdown_charges_the_engines_wait_and_adds_up_to_each_turn():
    """Each serving loop turn's time by phase (hypertron_step_phase_seconds) adds up to the turn
    (hypertron_step_seconds); an engine whose steps take 10 ms on the "device" (the fake sleeps in
    collect) shows them as "wait", every step's, and the turns as at least that long."""
    engine = FakeEngine(max_slots=4, step_delay=0.01)
    orch = Orchestrator(engine, TOK, SchedulerConfig()).start()

    async def run():
        gens = [orch.submit(TOK.encode(f"prompt {i}"), SamplingParams(max_tokens=6, seed=i, ignore_eos=True))
                for i in range(4)]
        return [[c async for c in g] for g in gens]

    try:
        asyncio.run(run())
    finally:
        orch.stop()
    parts, total, turns = phase_seconds(orch.metrics.registry)
    assert turns >= engine.steps >= 6
    assert sum(parts.values()) == pytest.approx(total, rel=0.1)
    assert parts["wait"] >= 0.01 * engine.steps and total >= parts["wait"]
    assert parts["assemble"] == 0  # the fake times nothing of its dispatch: all of it is "launch"


async def _submit_one(orch: Orchestrator):
    return orch.submit([5], SamplingParams())


async def _stream(http: httpx.AsyncClient, body: dict) -> tuple[int, str, str | None, dict | None]:
    """(status, streamed text, finish reason, usage) of one streaming completion."""
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            return r.status_code, "", None, None
        events = sse_events([ln async for ln in r.aiter_lines()])
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
    return 200, "".join(c["text"] for c in choices), choices[-1]["finish_reason"], events[-2]["usage"]


def test_256_concurrent_streams_each_get_exactly_their_tokens(server):
    bodies = [{"model": MODEL, "prompt": f"request {i}:", "max_tokens": 4 + i % 13, "seed": i} for i in range(256)]

    async def run():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as http:
            return await asyncio.gather(*(_stream(http, b) for b in bodies))

    prefills = server.engine.prefills
    results = asyncio.run(run())
    for body, (status, text, reason, usage) in zip(bodies, results):
        want, want_reason, ids = expected(body["prompt"], body["max_tokens"], body["seed"])
        assert (status, text, reason) == (200, want, want_reason)
        assert usage["completion_tokens"] == len(ids)
    assert server.engine.prefills - prefills == 256  # nothing pre-empted, nothing recomputed
    server.wait_idle()


async def _stream_all(url: str, bodies: list[dict]) -> list:
    """Every body streamed at once: ``_stream``'s ``(status, text, reason, usage)`` for each."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await asyncio.gather(*(_stream(http, b) for b in bodies))


def test_preemption_under_a_small_page_pool_keeps_the_streamed_text():
    # One sequence fits, four do not. Each step takes 20 ms, so the six streams overlap however slowly
    # the loaded machine sends them (without it, a busy CI could serve them one after another).
    engine = FakeEngine(max_slots=4, max_seq_len=64, page_size=4, num_pages=16, step_delay=0.02)
    with Server(engine) as s:
        bodies = [{"model": MODEL, "prompt": f"p{i}", "max_tokens": 40, "seed": i, "temperature": 0.8}
                  for i in range(6)]
        results = asyncio.run(_stream_all(s.url, bodies))
        for body, (status, text, reason, usage) in zip(bodies, results):
            want, want_reason, ids = expected(body["prompt"], 40, body["seed"], max_seq_len=64, temperature=0.8)
            assert (status, text, reason, usage["completion_tokens"]) == (200, want, want_reason, len(ids))
        m = s.wait_idle()
        assert m["hypertron_preemptions_total"] > 0 and engine.prefills > len(bodies)
        assert m["hypertron_kv_pages_free"] == 16


def test_speculation_keeps_each_streams_text_through_preemption_and_counts_in_metrics():
    """n-gram speculation on the fake engine (a verify row keeps the drafts it would have given),
    prompts that repeat themselves, a pool that pre-empts, each step collected before the next
    (the fake's letters seldom repeat, so a proposal made one step behind seldom holds): each
    stream gets the reference text, and /metrics counts the proposals, what was kept, and what was
    kept at each place."""
    engine = FakeEngine(max_slots=4, max_seq_len=64, page_size=4, num_pages=16, step_delay=0.01)
    with Server(engine, scheduler={"speculative": "ngram", "dispatch_ahead": "off"}) as s:
        bodies = [{"model": MODEL, "prompt": "abcab" * 3 + f"{i}", "max_tokens": 30, "seed": i} for i in range(6)]
        for body, (status, text, reason, usage) in zip(bodies, asyncio.run(_stream_all(s.url, bodies))):
            want, want_reason, ids = expected(body["prompt"], 30, body["seed"], max_seq_len=64)
            assert (status, text, reason, usage["completion_tokens"]) == (200, want, want_reason, len(ids))
        m, d = s.wait_idle(), s.orch.scheduler.drafter
        spec = "hypertron_spec_decode_num_"
        assert (m[spec + "drafts_total"], m[spec + "draft_tokens_total"], m[spec + "accepted_tokens_total"]) == (
            d.drafts, d.draft_tokens, d.accepted)
        assert d.drafts > 0 and sum(m[f"{spec}accepted_tokens_per_pos_total{{position={i}}}"] for i in range(4)) \
            == d.accepted
        assert m["hypertron_preemptions_total"] > 0 and m["hypertron_kv_pages_free"] == 16


def test_full_queue_answers_429_with_retry_after():
    # The first request holds the only slot for up to 30 x 1 s, so the queue fills however slow the
    # machine is; once the third is refused, the engine runs at full speed.
    engine = FakeEngine(max_slots=1, step_delay=1.0)
    with Server(engine, max_queue=2) as s:
        async def until(what, name, value):
            deadline = time.monotonic() + 20
            while s.metrics()[name] < value:
                assert time.monotonic() < deadline, f"{what}: {name} stayed under {value}"
                await asyncio.sleep(0.01)

        async def run():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
                body = {"model": MODEL, "prompt": "q", "max_tokens": 30, "seed": 0}
                first = asyncio.create_task(_stream(http, body))
                await until("the first request", "hypertron_slots_in_use", 1)
                waiting = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(2)]
                await until("two waiting requests", "hypertron_queue_depth", 2)
                refused = await http.post("/v1/completions", json=body)
                engine.step_delay = 0.0
                return refused, await first, [await w for w in waiting]

        refused, first, waiting = asyncio.run(run())
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        want = expected("q", 30)[0]
        assert first[:2] == (200, want) and [w.json()["choices"][0]["text"] for w in waiting] == [want, want]
        s.wait_idle()


@pytest.mark.parametrize("argv, message", [
    (["--max-slots", "0"], "--max-slots=0: must be positive"),
    (["--port", "70000"], "--port=70000: must be 0 to 65535"),
])
def test_serve_cli_refuses_bad_options_in_one_line(argv, message, capsys):
    from hypertron.cli import main

    assert main(["serve", "--checkpoint", "nowhere", *argv]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_metrics_show_compiles_that_end_while_the_loop_waits_for_work():
    """A background compile ends while no request is in: GET /metrics counts it and the queue it
    left (``hypertron_step_compiles_queued``), with no loop turn between."""
    engine = FakeEngine()
    engine.compiles, engine.queued_compiles = {"sync": 0, "background": 0, "padded": 0}, 2
    with Server(engine) as s:
        m = s.metrics()
        assert (m["hypertron_step_compiles_queued"], m["hypertron_step_compiles_total{mode=background}"]) == (2, 0)
        engine.compiles["background"], engine.queued_compiles = 2, 0  # as the compiler thread leaves them
        m = s.metrics()
        assert (m["hypertron_step_compiles_queued"], m["hypertron_step_compiles_total{mode=background}"]) == (0, 2)
