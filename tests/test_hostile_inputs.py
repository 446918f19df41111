"""Hostile input (issue 48): one request never fails another; every reader and flag refuses what it
cannot hold. Each section is one point of the issue."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import jax
import numpy as np
import pytest
from fake_engine import FakeEngine, reference  # tests/
from support.cli import one_error_line, run_cli  # tests/

from hypertron.config import PRESETS
from hypertron.models import init_params
from hypertron.models.bundle import save_model
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
             ("/v1/completions", {"prompt": "hi", "temperature": 1e999}, "temperature"),  # JSON's inf
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
    orch = Orchestrator(engine, TOK, ahead=ahead).start()
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

    alone = two_tokens(PagedEngine(params, cfg, max_slots=2, page_size=8), StepPlan.of(0, (), (good,)))
    engine = PagedEngine(params, cfg, max_slots=2, page_size=8)
    row = engine._row

    def poisoned_row(b, i, r, out_idx):
        if r.sampling.seed == POISON:
            raise OverflowError("Python integer 3000000000 out of bounds for int32")
        row(b, i, r, out_idx)

    monkeypatch.setattr(engine, "_row", poisoned_row)
    for _ in range(2):  # dispatched ahead, the loop's way: nothing is collected in between
        with pytest.raises(OverflowError):
            engine.dispatch(plan)
    assert two_tokens(engine, plan.only((good,))) == alone
