"""The serving engine: one jitted step per plan over the paged KV cache.

Parity with ``transformers`` through the scheduler and the engine (chunked prefill, mixed
steps, one step ahead, log-probabilities) for every family is in ``test_hf.py``; the
scheduler's own logic (budget, pages, pre-emption, stops) over a fake engine in
``test_scheduler.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serving import run, scheduler_for, teacher_forced_logprobs  # tests/

from hypertron.config import PRESETS, ConfigError, EngineConfig, SchedulerConfig, load_config
from hypertron.models import forward, init_params
from hypertron.models.flops import dense_flops_per_token
from hypertron.models.kv_pages import bytes_per_token
from hypertron.serve import engine as engine_module
from hypertron.padding import bucket
from hypertron.serve.engine import PagedEngine, Shape
from hypertron.serve.sampling import sample_rows
from hypertron.serve.scheduler import LENGTH, STOP, Request, run_until_done
from hypertron.serve.types import Row, SamplingParams, StepPlan

CFG = dataclasses.replace(PRESETS["tiny"], num_layers=2, max_seq_len=64)
GREEDY = SamplingParams(temperature=0.0, seed=0, max_tokens=8)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


# The full forward as one compiled program (eagerly, each of its ops compiles apart: a hundred and more
# compiles for a MoE).
_forward = jax.jit(forward, static_argnames="cfg")


def _is_greedy(params, cfg, prompt, generated) -> bool:
    """Whether each generated token is the argmax of the full forward (no cache) before it."""
    logits = _forward(params, jnp.asarray([list(prompt) + list(generated)]), cfg).logits[0, len(prompt) - 1:-1]
    return list(generated) == [int(t) for t in jnp.argmax(logits, -1)]


@pytest.mark.slow
def test_one_step_ahead_drops_the_token_after_eos_and_frees_everything(params):
    """Greedy tokens equal the full forward's; with the third of them as EOS, the run one step
    ahead stops before it (the step already dispatched after it is dropped) exactly as the run
    collecting each step does, and every slot and page comes back."""
    prompts = [[5, 17, 33, 101, 7], [40, 41, 42]]
    engine = PagedEngine(params, CFG, EngineConfig(max_slots=4, page_size=4, num_pages=20, compile="lazy"))
    seqs, _, _ = run(engine, prompts, [GREEDY, GREEDY])
    full = [s.generated for s in seqs]
    assert all(_is_greedy(params, CFG, p, g) and len(g) == 8 for p, g in zip(prompts, full))
    eos = full[0][2]
    want = [(g[:g.index(eos)], STOP) if eos in g else (g, LENGTH) for g in full]
    for ahead in (False, True):
        engine = PagedEngine(params, CFG, EngineConfig(max_slots=4, page_size=4, num_pages=20, compile="lazy"),
                             eos_ids=frozenset({eos}))
        seqs, outs, sched = run(engine, prompts, [GREEDY, GREEDY], ahead=ahead)
        assert [(s.generated, outs[s.id][-1].finish_reason) for s in seqs] == want
        assert sched.stats().items() >= {"slots_in_use": 0, "slots_total": 4, "pages_free": 19, "pages_total": 19,
                                         "waiting": 0}.items()


def test_a_step_pads_to_few_shapes_and_its_cost_follows_its_rows_lengths(params):
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 11, 13, 16, 17, 33, 100)] == \
        [1, 2, 4, 8, 8, 10, 12, 14, 16, 20, 40, 112]
    assert all(bucket(n) < 1.25 * n for n in range(9, 2000))
    assert [bucket(n, 8) for n in (9, 17, 129, 387)] == [9, 18, 144, 416]
    assert all(bucket(n, 8) < 1.125 * n for n in range(9, 2000))
    engine = PagedEngine(params, CFG, EngineConfig(max_slots=16, page_size=4, compile="lazy"))  # 16 columns a sequence
    rows = tuple(Row(i, i, 9 + i, (), tuple(range(1 + 4 * i, 5 + 4 * i)), GREEDY) for i in range(3))
    plan = StepPlan(0, rows, ())
    assert engine.shape(plan) == Shape(4, 0, 0)  # 3 live rows of 16 slots
    assert engine.context(plan) == 12  # the longest row's tokens: what cost counts its queries against
    batch = engine._batch(plan, engine.shape(plan))[0].fields
    assert batch["slot"].shape == (4,) and "table" not in batch  # the device holds the tables
    # A new prompt: prefill rows to a power of two, at least 16 tokens.
    chunk = Row(7, 7, 0, tuple(range(3, 14)), tuple(range(20, 23)), GREEDY)  # 11 prompt tokens
    plan = StepPlan(1, rows[:1], (chunk,))
    assert engine.shape(plan) == Shape(1, 1, 16)
    batch = engine._batch(plan, engine.shape(plan))[0].fields
    assert (batch["pre_tokens"].shape, batch["slot"].shape) == ((16,), (2,))
    # A chunk after a cached prefix is no other variant, and its length no dimension of a shape.
    later = Row(7, 7, 11, tuple(range(40, 61)), tuple(range(20, 28)), GREEDY)  # 21 tokens, to position 32
    assert engine.shape(StepPlan(2, rows, (later,))) == Shape(4, 1, 22)  # 21 tokens: eighths
    assert engine.context(StepPlan(2, rows, (later,))) == 32
    # Which compiled shape may run a plan, padded: larger in every size.
    assert Shape(4, 2, 32).holds(Shape(4, 1, 24)) and Shape(4, 8, 32).holds(Shape(1, 8, 16))
    assert not Shape(4, 2, 32).holds(Shape(4, 1, 24, logprobs=True)) and not Shape(4, 2, 16).holds(Shape(4, 1, 24))
    assert engine.cost(Shape(4, 2, 32), 32) > engine.cost(Shape(4, 1, 24), 32)
    # The cost by hand (tiny, 2 layers, pages of 4): 852,736 FLOPs a token through the weights
    # (a layer's q, k, v, o 98,304 and MLP 294,912; the unembedding 66,304) and 1,024 a query-key
    # pair (2 layers x 4 heads x 32 dims x 2 matmuls x 2 FLOPs); each query scores its row's pages
    # (the keys given), and each row's last query once more. Rows of 16 prefill queries (15 in blocks,
    # the last going with the decode rows) take the CPU reference's smallest blocks, of 64 queries:
    # 64 / 15 the pairs, each 1.8x as slow.
    assert engine.cost(Shape(4, 2, 32), 32) == pytest.approx(36 * 852_736 + 1_024 * (4 + 2 + 32 * 64 / 15 * 1.8) * 32)
    assert engine.cost(Shape(1, 1, 16), 16) == pytest.approx(17 * 852_736 + 1_024 * (1 + 1 + 16 * 64 / 15 * 1.8) * 16)


@pytest.mark.slow
def test_a_plan_run_padded_to_a_larger_compiled_shape_gives_the_same_tokens(params, monkeypatch):
    """With background compiles and one large shape compiled, every step runs padded to it (the
    background compiler held off, any cost allowed): tokens and log-probabilities are those of an
    engine that runs every plan at its own shape. Then, with the compiler on, no step waits for a
    compile: each new shape compiles in the background."""
    prompts = [[5, 17, 33, 101, 7, 9, 11, 2, 3, 4, 5, 6, 7], [40, 41, 42], [60, 61, 62, 63, 64]]
    sampling = [dataclasses.replace(GREEDY, logprobs=2), dataclasses.replace(GREEDY, logprobs=0),
                SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=8, logprobs=1)]
    kw = dict(max_num_batched_tokens=8, max_prefill_rows=2)
    lazy = EngineConfig(max_slots=4, page_size=4, max_top_logprobs=2, compile="lazy")
    want, want_outs, _ = run(PagedEngine(params, CFG, lazy), prompts, sampling, **kw)
    big = Shape(num_decode=4, prefill_rows=8, prefill_tokens=16, logprobs=True)
    for compiler in (False, True):
        engine = PagedEngine(params, CFG, dataclasses.replace(lazy, compile="background"))
        engine._compile(big)
        with monkeypatch.context() as m:
            m.setattr(engine_module, "COMPILE_AFTER_PADDED", 1)  # a plan's own shape is queued at once
            if not compiler:
                m.setattr(engine, "_enqueue", lambda shape: None)
            got, got_outs, _ = run(engine, prompts, sampling, ahead=True, **kw)
        engine.close()
        assert [s.generated for s in got] == [s.generated for s in want]
        for i in range(len(prompts)):
            for a, b in zip(got_outs[i], want_outs[i], strict=True):
                assert (a.token, a.finish_reason) == (b.token, b.finish_reason)
                if a.logprobs is not None or b.logprobs is not None:
                    assert a.logprobs.top_ids == b.logprobs.top_ids
                    np.testing.assert_allclose(a.logprobs.top_logprobs, b.logprobs.top_logprobs, atol=1e-5)
                    np.testing.assert_allclose(a.logprobs.logprob, b.logprobs.logprob, atol=1e-5)
        assert engine.compiles["sync"] == 0 and engine.compiles["padded"] >= 1
        if compiler:
            assert engine.compiles["background"] >= 1
            assert len(engine.compiled_shapes) == 1 + engine.compiles["background"]
        else:
            assert engine.compiled_shapes == [big]


def test_a_one_row_decode_step_writes_the_pool_in_place(params):
    """A step of one decode row must not copy the page pool (XLA did, in every layer, when the
    row's one-token write became a dynamic-update-slice fused into the attention's read: 98 ms
    a step at 4,737 pages of the HTTP bench's model on CPU against 1.2 ms; ``write_tokens``
    keeps it a scatter). The compiled step has no copy of the pool's shape."""
    engine = PagedEngine(params, CFG, EngineConfig(max_slots=4, page_size=4, compile="lazy"))
    pool = tuple(engine.cache["k_pages"].shape)
    text = engine._compile(Shape(num_decode=1, prefill_rows=0, prefill_tokens=0)).as_text()
    copies = [tuple(int(d) for d in dims.split(",")) for dims in re.findall(r"= \w+\[([\d,]+)\]\{[\d,]*\} copy\(", text)]
    assert copies and pool not in copies  # the pattern finds the step's other copies


@pytest.mark.slow
def test_measuring_the_step_cost_compiles_two_shapes_and_leaves_the_tokens_as_they_were(params):
    """``hypertron serve`` measures a step's cost before it serves (its prefill grouping follows
    it): the two steps run on padding alone, so what the engine then serves is unchanged."""
    prompts = [[5, 17, 33, 101, 7], [40, 41, 42]]
    want, _, _ = run(PagedEngine(params, CFG, EngineConfig(max_slots=4, page_size=4, compile="lazy")), prompts,
                     [GREEDY, GREEDY])
    engine = PagedEngine(params, CFG, EngineConfig(max_slots=4, page_size=4, compile="background"))
    cost = engine.measure_step_cost(24)
    assert cost.fixed >= 0 and cost.per_token >= 0 and cost.overhead_tokens >= 0
    assert sorted(engine.compiled_shapes, key=lambda s: s.num_decode) == [
        Shape(0, 1, 24), Shape(1, 0, 0)]
    assert engine.step_overhead_flops == pytest.approx(
        min(cost.overhead_tokens, engine_module.MAX_OVERHEAD_TOKENS) * dense_flops_per_token(CFG))
    got, _, _ = run(engine, prompts, [GREEDY, GREEDY], step_overhead_tokens=cost.overhead_tokens)
    engine.close()
    assert [s.generated for s in got] == [s.generated for s in want]


def test_a_step_cost_timed_on_a_busy_cpu_is_not_taken_for_free_tokens(params, monkeypatch):
    """A prefill of 24 tokens timed no slower than a 1-row decode (every timing equal, as on a CPU
    another process keeps busy): per_token is NaN, the fixed cost counts nothing, so padding a
    plan to a much larger shape still looks as dear as it is (the same shapes as the test above:
    this process has them compiled)."""
    import types

    engine = PagedEngine(params, CFG, EngineConfig(max_slots=4, page_size=4, compile="background"))
    clock = iter(range(10**6))
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: next(clock) * 0.01))
    cost = engine.measure_step_cost(24)
    assert np.isnan(cost.per_token) and cost.overhead_tokens == float("inf") and engine.step_overhead_flops == 0.0
    assert engine.cost(Shape(4, 2, 24), 32) > engine_module.MAX_PADDED_COST * engine.cost(Shape(1, 0, 0), 32)


@pytest.mark.parametrize("overhead_tokens, queued", [(0, True), (40, False)])
def test_a_near_fit_counting_the_steps_fixed_cost_is_not_compiled(params, overhead_tokens, queued):
    """A 1-row decode runs padded to the compiled 2-row one. By FLOPs alone that costs twice as
    much, so after COMPILE_AFTER_PADDED such steps its own shape is queued for a compile; with a
    step's fixed cost of 40 tokens' worth (about this project's CPU's) it costs 40 + 2 against 40
    + 1 tokens' worth plus attention, under CLOSE_ENOUGH_COST, and stays padded."""
    engine = PagedEngine(params, CFG, EngineConfig(max_slots=4, page_size=4, compile="background"))
    engine.step_overhead_flops = overhead_tokens * dense_flops_per_token(CFG)
    one, two = Shape(1, 0, 0), Shape(2, 0, 0)
    engine._compile(two)
    seen = []
    engine._enqueue = seen.append
    for _ in range(engine_module.COMPILE_AFTER_PADDED):
        assert engine._executable(one)[0] == two
    assert seen == ([one] if queued else [])
    assert engine.compiles == {"sync": 0, "background": 0, "padded": engine_module.COMPILE_AFTER_PADDED}


class _Letters:
    """A tokenizer's decode, all a Generation needs: one letter a token."""

    @staticmethod
    def decode(ids) -> str:
        return "".join(chr(65 + int(i) % 26) for i in ids)


def test_the_step_breakdown_over_the_engine_adds_up_and_times_its_assembly_and_its_wait(params):
    """Over the real engine each serving loop turn's phases (hypertron_step_phase_seconds) add up to
    the turn, the engine's own split of its dispatch (assembling the step's arrays) and of its
    collect (waiting for the device) included; the tokens are those of the scheduler run alone."""
    import asyncio

    from hypertron.serve.orchestrator import Orchestrator
    from hypertron.serve.metrics import STEP_PHASES

    prompts = [[5, 17, 33, 101, 7], [40, 41, 42]]
    want, _, _ = run(PagedEngine(params, CFG, EngineConfig(max_slots=4, page_size=4, num_pages=20, compile="lazy")),
                     prompts, [GREEDY, GREEDY])
    engine = PagedEngine(params, CFG, EngineConfig(max_slots=4, page_size=4, num_pages=20, compile="lazy"))
    orch = Orchestrator(engine, _Letters(), SchedulerConfig(dispatch_ahead="on")).start()

    async def generate():
        gens = [orch.submit(p, GREEDY) for p in prompts]
        return [[t for c in [c async for c in g] for t in c.token_ids] for g in gens]

    try:
        got = asyncio.run(generate())
    finally:
        orch.stop()
    assert got == [s.generated for s in want]
    get = orch.metrics.registry.get_sample_value
    parts = {p: get("hypertron_step_phase_seconds_sum", {"phase": p}) for p in STEP_PHASES}
    assert sum(parts.values()) == pytest.approx(get("hypertron_step_seconds_sum"), rel=0.1)
    assert parts["assemble"] > 0 and parts["wait"] > 0 and parts["launch"] > 0
    assert get("hypertron_step_seconds_count") >= 8  # a step a token at least, and one to collect the last


def test_a_long_chunk_padded_to_blocks_for_short_rows_gets_one_compile_for_any_decode_rows(params):
    """A server's largest shape has 8 prefill rows of 64 queries: a plan of one 512-token chunk
    (and a few decode rows) padded to it runs the CPU reference's attention in blocks for rows of
    64, each pair 1.8x as slow (docs/benchmarks.md). Counted in FLOPs alone it was a near fit
    (1.03x) and never got its own compile: a load of long prompts ran at 0.7x. Counted by its
    blocks it is queued after COMPILE_AFTER_PADDED padded runs, widened to every decode row the
    slots allow (at 2,048 keys they add 2 %), so one compile holds that chunk beside any of them."""
    engine = PagedEngine(params, CFG, EngineConfig(max_slots=16, page_size=4, compile="background"))
    big, chunk = engine.largest_shape(SchedulerConfig(max_prefill_rows=8, max_num_batched_tokens=512)), Shape(4, 1, 512)
    assert big == Shape(16, 8, 512) and big.holds(chunk) and big.queries_per_row == 64
    assert engine.cost(big, 2048, 512) > engine_module.CLOSE_ENOUGH_COST * engine.cost(chunk, 2048)
    engine._compiled[big] = "big"
    seen = []
    engine._enqueue = seen.append
    for _ in range(engine_module.COMPILE_AFTER_PADDED):
        assert engine._executable(chunk, 2048) == (big, "big")
    assert seen == [Shape(16, 1, 512)]


def test_a_step_waits_for_a_compile_only_when_no_compiled_shape_holds_it(params):
    """A plan whose only compiled holder costs over MAX_PADDED_COST times its own still runs
    padded to it, its own shape queued for the background at once (a wait costs every stream a
    compile's seconds); with no holder the step compiles its own now. The largest shape a
    server's settings allow holds every plan under them. (Executables stubbed: nothing compiles.)"""
    engine = PagedEngine(params, CFG, EngineConfig(max_slots=4, page_size=4, compile="background"))
    big, one = engine.largest_shape(SchedulerConfig(max_prefill_rows=2, max_num_batched_tokens=24)), Shape(1, 0, 0)
    assert big == Shape(4, 2, 24)
    assert engine.cost(big) > engine_module.MAX_PADDED_COST * engine.cost(one)
    engine._compiled[big] = "big"
    seen = []
    engine._enqueue = seen.append
    assert engine._executable(one) == (big, "big") and seen == [one]
    assert engine.compiles == {"sync": 0, "background": 0, "padded": 1}
    compiled = []
    engine._compile = lambda shape: compiled.append(shape) or "own"
    other = Shape(1, 0, 0, logprobs=True)  # a variant no compiled shape has
    assert engine._executable(other) == (other, "own") and compiled == [other] and engine.compiles["sync"] == 1
    rng = np.random.default_rng(0)
    cap = engine.pages_per_seq * 4  # positions a slot holds
    for _ in range(200):  # plans within 4 slots, 2 prefill rows and 24 tokens a step
        rows = int(rng.integers(1, 5))
        prefills = int(rng.integers(0, min(rows, 2) + 1))
        sizes = rng.multinomial(int(rng.integers(prefills, 25)) - prefills, [1 / prefills] * prefills) + 1 \
            if prefills else []
        def row(slot, n):  # noqa: E306
            start = int(rng.integers(0, cap - max(n, 1) + 1))
            return Row(slot, slot, start, (5,) * n, tuple(range(1, -(-(start + max(n, 1)) // 4) + 1)), GREEDY)
        plan = StepPlan(0, tuple(row(i, 0) for i in range(rows - prefills)),
                        tuple(row(rows - prefills + i, int(n)) for i, n in enumerate(sizes)))
        shape = engine.shape(plan)
        assert big.holds(shape), shape


def test_logprobs_are_computed_only_in_steps_that_ask_for_them(params):
    engine = PagedEngine(params, CFG, EngineConfig(max_slots=2, page_size=8, max_top_logprobs=4, compile="lazy"))
    row = Row(0, 0, 0, (5, 6, 7), (1,), GREEDY)
    plain = engine.run(StepPlan(0, (), (row,)))
    assert plain.logprobs is None and plain.top_ids is None
    asked = dataclasses.replace(row, slot=1, sampling=dataclasses.replace(GREEDY, logprobs=2), pages=(2,))
    result = engine.run(StepPlan(1, (), (asked,), logprobs=True))
    logp = jax.nn.log_softmax(_forward(params, jnp.asarray([[5, 6, 7]]), CFG).logits[0, -1])
    assert result.tokens[0] == plain.tokens[0] == int(jnp.argmax(logp))
    np.testing.assert_allclose(result.top_logprobs[0], np.sort(np.asarray(logp))[::-1][:4], atol=1e-5)


@pytest.mark.slow
def test_the_same_seed_gives_the_same_tokens_whatever_else_is_in_the_batch(params):
    sampled = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7, max_tokens=6)
    other = SamplingParams(temperature=0.7, seed=1, max_tokens=6)
    engine = lambda: PagedEngine(params, CFG, EngineConfig(max_slots=3, page_size=8, compile="lazy"))  # noqa: E731
    (alone,), _, _ = run(engine(), [[40, 41, 42]], [sampled])
    (_, together), _, _ = run(engine(), [[50, 51, 52, 53, 54], [40, 41, 42]], [other, sampled],
                              max_num_batched_tokens=4)
    assert together.generated == alone.generated
    (reseeded,), _, _ = run(engine(), [[40, 41, 42]], [dataclasses.replace(sampled, seed=8)])
    assert reseeded.generated != alone.generated


def test_sample_rows_applies_each_rows_settings():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4))
    temperature = jnp.array([0.0, 1.0, 1.0, 1.0])
    top_k = jnp.array([0, 1, 0, 2])
    top_p = jnp.array([1.0, 1.0, 0.4, 1.0])
    seeds = jnp.arange(800, dtype=jnp.uint32).reshape(200, 4)  # 200 draws per row, one compiled call
    draw = jax.jit(jax.vmap(lambda s: sample_rows(logits, temperature, top_k, top_p, s, jnp.zeros(4, jnp.int32))))
    draws = np.asarray(draw(seeds))
    assert (draws[:, 0] == 0).all()  # greedy
    assert (draws[:, 1] == 0).all()  # top-1
    assert (draws[:, 2] == 0).all()  # top-p 0.4: the 0.5 token alone reaches it
    assert set(draws[:, 3]) == {0, 1}  # top-2: both kept tokens drawn, nothing else


def test_sample_rows_without_its_conditional_draws_the_same_tokens_and_lowers_to_no_branch():
    """A GPU step samples with ``skip_greedy=False``: no conditional for XLA to read back to the
    host, and the same tokens as the conditional gives, greedy rows and sampled ones alike."""
    logits = jax.random.normal(jax.random.key(3), (4, 64))
    rows = (jnp.array([0.0, 0.8, 0.0, 1.3]), jnp.array([0, 5, 0, 0]), jnp.array([1.0, 1.0, 1.0, 0.9]),
            jnp.arange(4, dtype=jnp.uint32), jnp.arange(10, 14, dtype=jnp.int32))
    all_greedy = (jnp.zeros(4), *rows[1:])
    for skip in (True, False):
        fn = jax.jit(functools.partial(sample_rows, skip_greedy=skip))
        text = fn.lower(logits, *rows).as_text()
        assert ("stablehlo.case" in text or "stablehlo.if" in text) == skip
        if skip:
            mixed, greedy = fn(logits, *rows), fn(logits, *all_greedy)
    branch_free = jax.jit(functools.partial(sample_rows, skip_greedy=False))
    np.testing.assert_array_equal(branch_free(logits, *rows), mixed)
    np.testing.assert_array_equal(branch_free(logits, *all_greedy), greedy)
    np.testing.assert_array_equal(greedy, jnp.argmax(logits, -1))


def test_bytes_per_cached_token_int8_vs_bf16():
    # head_dim 128 (Llama 3, Mistral) and 256 (Gemma): int8 values + one bf16 scale per token and head.
    for name in ("llama3-8b", "mistral-7b", "gemma-7b"):
        ratio = bytes_per_token(PRESETS[name], jnp.int8) / bytes_per_token(PRESETS[name], jnp.bfloat16)
        assert ratio <= 0.53, (name, ratio)
    # What the engine really allocates, for a model with head_dim 64.
    cfg = dataclasses.replace(CFG, num_heads=2, num_kv_heads=2, head_dim=64)
    params = init_params(cfg, jax.random.key(0))
    nbytes = {d: sum(x.nbytes for x in PagedEngine(
        params, cfg, EngineConfig(max_slots=1, page_size=8, kv_cache_dtype=d, compile="lazy")).cache.values())
              for d in ("int8", "bfloat16")}
    assert nbytes["int8"] / nbytes["bfloat16"] <= 0.53


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny model after 60 steps on the embedded corpus (its logits are no longer flat)."""
    from hypertron.checkpoint import load_params
    from hypertron.train.loop import train

    run = tmp_path_factory.mktemp("kv") / "run"
    cfg = load_config(None, ["model=tiny", "model.num_layers=2", "train.steps=60", "train.global_batch=8",
                             "train.seq_len=64", "train.lr=3e-3", "train.warmup_steps=5", f"run_dir={run}",
                             "checkpoint.every=60"])
    train(cfg)
    return load_params(run)


@pytest.mark.slow
@pytest.mark.gpu
def test_int8_kv_cache_stays_close_to_bf16_on_a_trained_model(trained):
    cfg, params = trained
    text = b"def main(argv):\n    for name in sorted(argv):\n        print(name)\n    return 0\n"
    tokens = [b + 3 for b in text]
    ref, bf16, int8 = (teacher_forced_logprobs(params, cfg.model, kv, tokens, 8, page_size=8)
                       for kv in ("float32", "bfloat16", "int8"))
    assert np.mean(np.exp(ref).max(-1)) > 0.2  # trained: the model is fairly sure of its next byte
    # Stated tolerance: over the whole vocabulary at every position, int8 pages put no
    # log-probability more than 0.05 nats from bf16 pages' (measured: 0.014; bf16 vs float32: 0.003).
    assert np.abs(int8 - bf16).max() < 0.05
    assert np.abs(bf16 - ref).max() < 0.02
    assert (int8.argmax(-1) == bf16.argmax(-1)).mean() > 0.95


@pytest.mark.parametrize("preset", ["tiny", "tiny-gemma", "tiny-moe"])
def test_prefix_caching_gives_the_tokens_and_logprobs_of_no_caching(params, preset):
    """Float32 Llama, Gemma and MoE (dropless: a token's experts do not depend on the batch), requests one after another through a pool of 6 pages of 4: a
    prompt, the same prompt again (all its full pages cached; the last one, holding its last token,
    is prefilled), a prompt sharing two pages, one whose full pages are all cached, a long one that
    evicts most of the cache, and the first prompt once more. Greedy tokens and top-5
    log-probabilities equal those of the same requests with caching off."""
    cfg = dataclasses.replace(PRESETS[preset], num_layers=2, max_seq_len=32, dtype="float32")
    weights = params if preset == "tiny" else init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(0)
    base, other, long = (rng.integers(3, cfg.vocab_size, n).tolist() for n in (13, 6, 13))
    prompts = [base, base, base[:8] + other, base[:12], long, base]
    engine = PagedEngine(weights, cfg, EngineConfig(max_slots=2, page_size=4, num_pages=7, max_top_logprobs=5,
                                                    compile="lazy"))
    runs = {}
    for caching in (True, False):
        sched = scheduler_for(engine, enable_prefix_caching=caching)
        runs[caching] = []
        for i, prompt in enumerate(prompts):
            seq, lps = Request(i, prompt, dataclasses.replace(GREEDY, max_tokens=3, logprobs=5)), []
            sched.add(seq)
            run_until_done(engine, sched, lambda o: o.token is not None and lps.append(o.logprobs), ahead=True)
            runs[caching].append((seq.generated, lps, seq.cached_tokens))
    # The long prompt evicted the first prompt's third page: it finds two of its three again.
    assert [c for *_, c in runs[True]] == [0, 12, 8, 8, 0, 8] and {c for *_, c in runs[False]} == {0}
    for (tokens, lps, _), (want, want_lps, _) in zip(runs[True], runs[False]):
        assert tokens == want
        for lp, ref in zip(lps, want_lps):
            assert lp.top_ids == ref.top_ids
            np.testing.assert_allclose([lp.logprob, *lp.top_logprobs], [ref.logprob, *ref.top_logprobs], atol=1e-5)


def test_engine_settings_are_checked(params):
    from hypertron.serve.scheduler import Request, Scheduler

    with pytest.raises(ConfigError, match="kv_cache_dtype=fp8"):
        PagedEngine(params, CFG, EngineConfig(kv_cache_dtype="fp8", compile="lazy"))
    with pytest.raises(ConfigError, match="page_size=6"):
        PagedEngine(params, CFG, EngineConfig(page_size=6, compile="lazy"))
    engine = PagedEngine(params, CFG, EngineConfig(max_slots=2, page_size=8, num_pages=9, compile="lazy"))
    sched = Scheduler(engine, SchedulerConfig())
    with pytest.raises(ValueError, match=f"'prompt' is {CFG.max_seq_len} tokens; expected 1 to {CFG.max_seq_len - 1}"):
        sched.add(Request(0, [3] * CFG.max_seq_len, GREEDY))


@pytest.mark.slow
def test_a_bf16_run_is_served_with_bf16_weights_cast_once_at_load(tmp_path):
    """A run with float32 master weights and bf16 compute, loaded for serving: every matmul and
    embedding weight on the device is bf16 (counted in bytes), norms and the MoE router float32 (the
    model computes them in float32). Its logits over a teacher-forced continuation equal our float32
    model on the same bf16-rounded weights within 2e-2 relative (measured on CPU: 6.4e-3), and its greedy
    tokens equal that reference's."""
    from hypertron.checkpoint import save_params
    from hypertron.config import Config, TrainConfig
    from hypertron.models import declare
    from hypertron.models.params import leaves_with_paths
    from hypertron.serve.loading import load_engine

    model = dataclasses.replace(PRESETS["tiny-moe"], num_layers=2, max_seq_len=64, dtype="bfloat16")
    cfg = Config(run_dir=str(tmp_path / "run"), model=model, train=TrainConfig(seq_len=32))
    master = init_params(model, jax.random.key(3))
    save_params(tmp_path / "run", cfg, master)
    engine, _, _ = load_engine(tmp_path / "run", EngineConfig(max_slots=1, page_size=8, compile="lazy"))

    def at(tree, path):  # the engine holds each layer's weights apart (unstack_layers)
        if path[0] == "layers":
            return [w for layer in tree["layers"] for w in at(layer, path[1:])]
        for key in path:
            tree = tree[key]
        return [tree]

    low = full = 0
    for path, spec in leaves_with_paths(declare(model)):
        for w in at(engine.params, path):
            assert w.dtype == (jnp.bfloat16 if spec.quantize else jnp.float32), path
            assert isinstance(w, jax.Array), path  # on the device, not numpy waiting to be copied each step
            if spec.quantize:
                low += w.nbytes
            full += w.size * 4
    assert {p[-1] for p, s in leaves_with_paths(declare(model)) if not s.quantize} >= {"router", "attn_norm"}
    assert low > 0.9 * full / 2 and sum(x.nbytes for x in jax.tree.leaves(engine.params)) < 0.55 * full

    # The reference: float32 compute on the bf16-rounded weights.
    ref_cfg = dataclasses.replace(model, dtype="float32")
    rounded = jax.jit(lambda p: jax.tree.map(lambda w: w.astype(jnp.float32), p))(engine.params)  # one compile
    prompt = [5, 17, 33, 101, 7]
    (served,), _, _ = run(engine, [prompt], [GREEDY])
    tokens = served.generated
    seq = jnp.asarray([prompt + tokens])
    ref_logits = _forward(rounded, seq, ref_cfg).logits[0, len(prompt) - 1:-1]
    ours = _forward(engine.params, seq, engine.cfg).logits[0, len(prompt) - 1:-1].astype(jnp.float32)
    rel = float(jnp.linalg.norm(ours - ref_logits) / jnp.linalg.norm(ref_logits))
    assert rel < 2e-2, rel
    assert tokens == [int(t) for t in jnp.argmax(ref_logits, -1)]
