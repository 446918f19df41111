"""Structured output (``response_format``, ``structured_outputs``) through the real engine.

A tiny random model, with the byte tokenizer and with a byte-level BPE trained here: what the model
would say is noise, so every output that holds its grammar held because the mask made it. Each
kind over 10 seeds: JSON schemas validate with ``jsonschema``, regular expressions ``re.fullmatch``, a Lark arithmetic grammar's
outputs parse with Python's ``ast``, a choice is a choice. The official ``openai`` client's
``chat.completions.parse`` with a pydantic model returns the instance. Requests that cannot be
guided are one 400 naming the field, before anything is queued.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import json
import re
from typing import Literal

import httpx
import jax
import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from test_server import MODEL, TOK, Server  # tests/

from hypertron.config import PRESETS, EngineConfig
from hypertron.models import init_params
from hypertron.serve.engine import PagedEngine
from hypertron.tokenizer import get_tokenizer

pytestmark = pytest.mark.slow

CFG = dataclasses.replace(PRESETS["tiny"], num_layers=2, max_seq_len=256)
SEEDS = range(10)
COLOR = {"enum": ["red", "green", "blue"]}
SCHEMAS = {
    # Closed objects (additionalProperties false, as OpenAI's strict mode wants): an open one may go on.
    "enum": {"type": "object", "properties": {"color": COLOR}, "required": ["color"], "additionalProperties": False},
    "bounded integer": {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 120}},
                        "required": ["n"], "additionalProperties": False},
    "array of enums": {"type": "array", "items": COLOR, "minItems": 1, "maxItems": 3},
    "nested": {"type": "object", "required": ["size", "where"], "additionalProperties": False,
               "properties": {"size": {"type": "integer", "minimum": 0, "maximum": 9},
                              "where": {"type": "object", "required": ["x", "ok"], "additionalProperties": False,
                                        "properties": {"x": {"enum": [1, 2]}, "ok": {"type": "boolean"}}}}},
}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
ARITHMETIC = """
start: expr
expr: NUM | "(" expr OP expr ")"
OP: "+" | "-" | "*"
NUM: /[0-9]{1,2}/
"""
CHOICES = ["apple", "banana split", "cherry"]


@pytest.fixture(scope="module", params=["byte", "bpe"])
def server(request, tmp_path_factory):
    """The server of a tiny random model with the byte tokenizer, or with a 400-id byte-level BPE
    (tests/test_tokenizers.py's) and a vocabulary of 512."""
    tok, cfg = TOK, CFG
    if request.param == "bpe":
        from test_tokenizers import train_bpe  # tests/

        tok = get_tokenizer(train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json"))
        cfg = dataclasses.replace(CFG, vocab_size=512)
    engine = PagedEngine(init_params(cfg, jax.random.key(0)), cfg,
                         EngineConfig(max_slots=8, page_size=8, num_pages=400, max_top_logprobs=5,
                                      compile="background"), eos_ids=tok.eos_ids)
    with Server(engine, tokenizer=tok) as s:
        yield s


BYTE_ONLY = pytest.mark.parametrize("server", ["byte"], indirect=True)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)


def _chat(server, seeds, max_tokens: int = 64, **body) -> list[tuple[str, str]]:
    """``(text, finish_reason)`` of a chat request per seed (sampled at temperature 1), all at once."""
    def one(seed):
        r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}], "seed": seed,
                                                   "temperature": 1.0, "max_tokens": max_tokens, **body})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]

    with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(one, seeds))


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_outputs_validate_for_every_seed(server, name):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name.replace(" ", "_"), "schema": schema, "strict": True}}
    outs = _chat(server, SEEDS, response_format=fmt)
    for text, finish in outs:
        assert finish == "stop", text
        assert " " not in text  # compact JSON
        jsonschema.validate(json.loads(text), schema)
    assert len({t for t, _ in outs}) > 1  # sampled, not one answer forced


def test_a_regex_and_a_choice_hold(server):
    for text, finish in _chat(server, SEEDS, structured_outputs={"regex": REGEX}):
        assert finish == "stop" and re.fullmatch(REGEX, text), text
    for text, finish in _chat(server, SEEDS, structured_outputs={"choice": CHOICES}):
        assert finish == "stop" and text in CHOICES, text


@BYTE_ONLY
def test_a_lark_grammar_and_json_object_hold(server):
    """These may run to ``max_tokens``: then what they wrote is a prefix the grammar allows (the
    byte tokenizer's ids are its bytes, so the text gives them back); every completed output
    holds it."""
    import llguidance

    for body, check in (({"structured_outputs": {"grammar": ARITHMETIC}}, lambda t: ast.parse(t, mode="eval")),
                        ({"response_format": {"type": "json_object"}}, lambda t: json.loads(t).keys())):
        outs = _chat(server, SEEDS, max_tokens=32, **body)
        assert any(finish == "stop" for _, finish in outs)
        grammar = (llguidance.LLMatcher.grammar_from_lark(ARITHMETIC) if "structured_outputs" in body else
                   llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults={"whitespace_flexible": False}))
        for text, finish in outs:
            if finish == "stop":
                check(text)
            else:
                matcher = llguidance.LLMatcher(_lltokenizer(), grammar)
                assert matcher.consume_tokens(TOK.encode(text)), (text, matcher.get_error())


def _lltokenizer():
    from hypertron.serve.structured import Grammars

    return Grammars(TOK, CFG.vocab_size)._lltokenizer()


@BYTE_ONLY
def test_unguided_rows_beside_guided_ones_get_their_own_tokens_and_logprobs_stay_the_models(server):
    """A greedy request's tokens are the same alone and in steps shared with six guided requests;
    a guided answer's log-probabilities are the model's (its top alternatives are ids the grammar
    did not allow)."""
    def plain():
        r = _post(server, "/v1/completions", {"prompt": "abc", "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        return r.json()["choices"][0]["text"]

    alone = plain()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        guided = pool.submit(_chat, server, range(6), structured_outputs={"regex": REGEX})
        shared = pool.submit(plain)
        assert shared.result() == alone
        assert all(re.fullmatch(REGEX, t) for t, _ in guided.result())
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}], "logprobs": True,
                                               "top_logprobs": 5, "structured_outputs": {"choice": CHOICES}})
    first = r.json()["choices"][0]["logprobs"]["content"][0]
    assert first["token"] in "abc" and first["logprob"] < 0
    assert {t["token"] for t in first["top_logprobs"]} - set("abc")  # the model's alternatives, not the mask's
    assert server.metrics()["hypertron_structured_mask_seconds_count"] > 0


@BYTE_ONLY
def test_completions_take_response_format_and_a_grammar_ends_its_request_despite_ignore_eos(server):
    """``response_format`` on completions (vLLM takes it there too); with ``ignore_eos`` a guided
    request still ends where its grammar does, its end-of-sequence token not returned; ``json:
    true`` is any JSON value and ``json_object: false`` no grammar at all."""
    body = {"prompt": "go", "max_tokens": 40, "temperature": 1.0, "ignore_eos": True}
    ended = 0
    for seed in range(6):  # the grammar accepts from the first letter on: EOS is allowed, and drawn, early
        r = _post(server, "/v1/completions", {**body, "seed": seed, "structured_outputs": {"regex": "[a-c]{1,30}"}})
        text = r.json()["choices"][0]["text"]
        assert re.fullmatch("[a-c]{1,30}", text) and r.json()["choices"][0]["finish_reason"] == "stop", r.text
        assert r.json()["usage"]["completion_tokens"] == len(TOK.encode(text))  # no end-of-sequence token among them
        ended += len(text) < 30
    assert ended  # some ended at the grammar's EOS, not at its longest
    for seed in range(3):
        fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["enum"]}}
        r = _post(server, "/v1/completions", {**body, "seed": seed, "response_format": fmt}).json()
        jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMAS["enum"])
    for outputs in ({"json": True}, {"json_object": False}):
        assert _post(server, "/v1/completions", {**body, "structured_outputs": outputs}).status_code == 200


def test_the_official_client_parses_a_pydantic_model(server):
    class Answer(pydantic.BaseModel):
        mood: Literal["calm", "busy"]
        count: int = pydantic.Field(ge=0, le=20)

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for seed in range(3):
        done = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "how?"}],
                                             response_format=Answer, seed=seed, temperature=1.0, max_tokens=64)
        parsed = done.choices[0].message.parsed
        assert isinstance(parsed, Answer) and parsed.mood in ("calm", "busy") and 0 <= parsed.count <= 20


@BYTE_ONLY
@pytest.mark.parametrize("body, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "needs"),
    ({"response_format": {"type": "yaml"}}, "response_format", "'response_format.type'"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", "foo"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "takes one of"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "both"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "Extra inputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}}, "response_format",
     "allows no value"),
    ({"guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
])
def test_a_grammar_that_cannot_be_used_is_one_400_naming_its_field(server, body, param, says):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"] and "\n" not in error["message"], error
    assert server.wait_idle()["hypertron_queue_depth"] == 0


def test_guided_rows_sample_in_every_step_one_step_ahead_and_keep_their_grammar_through_preemption():
    """The engine alone, one step ahead and not: a guided sequence has a row in every step while it
    runs (its sample waits for its mask, not its row for the token before), its outputs hold the
    grammar, and a page pool too small for all of them pre-empts some, whose guides carry on; the
    tokens are the same either way."""
    from serving import scheduler_for  # tests/

    from hypertron.serve.scheduler import Request, run_until_done
    from hypertron.serve.structured import Grammars, grammar_for
    from hypertron.serve.types import SamplingParams

    grammars, grammar = Grammars(TOK, CFG.vocab_size), grammar_for(None, {"regex": REGEX})
    params = init_params(CFG, jax.random.key(0))
    got = {}
    for ahead in (False, True):
        engine = PagedEngine(params, CFG, EngineConfig(max_slots=4, page_size=4, num_pages=10, compile="lazy"),
                             eos_ids=TOK.eos_ids)
        sched = scheduler_for(engine, enable_prefix_caching=False)
        seqs = [Request(i, TOK.encode(f"prompt {i}:"), SamplingParams(temperature=1.0, seed=i, max_tokens=12),
                        guide=grammars.guide(grammar) if i % 3 else None) for i in range(6)]
        for seq in seqs:
            sched.add(seq)
        run_until_done(engine, sched, lambda out: None, ahead=ahead)
        got[ahead] = [(s.generated, s.finish_reason) for s in seqs]
        assert sched.preemptions > 0
        for s in seqs:
            if s.guide is not None:
                assert s.finish_reason == "stop" and re.fullmatch(REGEX, TOK.decode(s.generated)), s.generated
        decoding = [set(r.decodes) for r in sched.records]
        for s in seqs:  # from its first decode to its last, in every step (pre-empted: until then)
            steps = [k for k, d in enumerate(decoding) if s.id in d]
            first_gap = next((b for a, b in zip(steps, steps[1:]) if b != a + 1), None)
            assert first_gap is None or any(s.id in {p for p in sched.records[k].preempted}
                                            for k in range(steps[0], first_gap)), (s.id, steps)
    assert got[True] == got[False]


def test_a_steps_masks_through_llguidances_thread_pool_are_each_guides_own(monkeypatch):
    """The pool (used on many-core hosts: ``EXECUTOR_MIN_CPUS``) writes each guide's mask where one
    by one does, the model's ids past the tokenizer's never allowed."""
    from hypertron.serve import structured

    grammars = structured.Grammars(TOK, 300)
    guides = [grammars.guide(structured.grammar_for(None, {"regex": r})) for r in (REGEX, "[x-z]+", REGEX)]
    for t in TOK.encode("ab"):  # then "-" is allowed too
        guides[2].consume(t)
    alone = np.stack([g.mask() for g in guides])
    monkeypatch.setattr(structured, "EXECUTOR_MIN_CPUS", 0)
    monkeypatch.setattr(structured, "EXECUTOR_MIN_ROWS", 1)
    pooled = structured.Guide.masks_of(guides)
    assert np.array_equal(pooled, alone) and pooled.shape == (3, 10)
    assert not pooled[:, TOK.vocab_size // 32 + 1:].any() and len({m.tobytes() for m in pooled}) == 3


def test_free_text_needs_no_llguidance(monkeypatch):
    """A server whose machine lacks llguidance (the GPU machines' wheels leave it out) serves free
    text: only a grammar imports it (every completion once failed there, reading its fields)."""
    import sys

    from hypertron.serve.structured import grammar_for

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance: ImportError
    assert grammar_for(None, None) is grammar_for({"type": "text"}, None) is grammar_for(None, {"json": None}) is None
    with pytest.raises(ImportError):
        grammar_for(None, {"regex": "a+"})
