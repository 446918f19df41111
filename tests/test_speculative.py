"""Speculative decoding's parts against references: the n-gram proposer
(``hypertron.serve.speculative``) against a loop on random histories; the engine's rule for its
proposals against sample_rows' draws; the acceptance rule against the
distribution it must give (a chi-square test of the emitted tokens against ``p``) and the
acceptance rate it must have (``sum(min(p, q))``; ``p(x)`` for an n-gram's one draft)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.config import SchedulerConfig
from hypertron.serve.sampling import accept
from hypertron.serve.speculative import propose

# The 0.999 quantile of the chi-square distribution with 5 degrees of freedom (6 tokens): a test
# at p-value 0.001, as scipy.stats.chi2.ppf(0.999, 5) gives it.
CHI2_5_999 = 20.515
DRAWS = 20_000


def _reference_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for j in range(len(tokens) - n):
            if tokens[j:j + n] == suffix:
                return tokens[j + n:j + n + k]
    return []


@pytest.mark.parametrize("k, n_min, n_max", [(4, 2, 5), (1, 1, 3)])
def test_ngram_proposals_equal_a_loop_on_random_histories(k, n_min, n_max):
    rng = np.random.default_rng(k)
    found = 0
    for r in range(512):
        tokens = rng.integers(0, 3, rng.integers(0, 33)).tolist()  # 3 ids: matches are common
        want = _reference_ngram(tokens, k, n_min, n_max)
        assert propose(tokens, k, n_min, n_max) == want, tokens
        found += bool(want)
    assert 0 < found < 512
    # By hand (the first as vLLM's proposer documents it): [2, 3] matches, three tokens follow it;
    # in a run of one token the longest match wins, and the earliest place of it.
    assert propose([1, 2, 3, 4, 2, 3], 4, 2, 3) == [4, 2, 3]
    assert propose([5] * 6, 4, 2, 5) == [5] and propose([5] * 6, 4, 2, 2) == [5] * 4


def _chi2(tokens: np.ndarray, p: np.ndarray) -> float:
    seen = np.bincount(tokens, minlength=len(p))
    expected = p * len(tokens)
    return float(((seen - expected) ** 2 / expected).sum())


P = np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
Q = np.array([0.10, 0.20, 0.30, 0.05, 0.25, 0.10])


def _run(p, q, draft, count):
    rows, k = draft.shape
    fn = jax.jit(accept)
    q = jnp.asarray(np.broadcast_to(q, (rows, k, len(p))) if q.ndim == 1 else q, jnp.float32)
    tokens, emitted = fn(jnp.asarray(np.broadcast_to(p, (rows, k + 1, len(p))), jnp.float32), q,
                         jnp.asarray(draft, jnp.int32), jnp.asarray(count, jnp.int32),
                         jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32))
    return np.asarray(tokens), np.asarray(emitted)


def test_emitted_tokens_are_distributed_as_the_model_and_drafts_kept_at_sum_min_p_q():
    """20,000 rows of one step, k = 2 drafts drawn from q: the first emitted token, and the second
    where there is one, pass a chi-square test against p; the first draft is kept at sum(min(p, q))."""
    rng = np.random.default_rng(0)
    draft = rng.choice(len(Q), size=(DRAWS, 2), p=Q)
    tokens, emitted = _run(P, Q, draft, np.full(DRAWS, 2))
    assert _chi2(tokens[:, 0], P) < CHI2_5_999
    second = emitted >= 2
    assert _chi2(tokens[second, 1], P) < CHI2_5_999
    kept = (emitted >= 2).mean()
    assert abs(kept - np.minimum(P, Q).sum()) < 5 * np.sqrt(kept * (1 - kept) / DRAWS)
    assert set(np.unique(emitted)) == {1, 2, 3}
    assert np.array_equal(tokens[emitted >= 2, 0], draft[emitted >= 2, 0])  # a kept draft is emitted as drafted


def test_an_ngram_proposal_is_kept_at_p_of_it_draws_as_without_one_and_greedy_keeps_the_argmax():
    """verify_proposal (the engine's rule for an n-gram's proposal, a point mass): 20,000 seeded
    rows of one proposed token: it is kept at p(x), the first token passes a chi-square test
    against p, and every token is the draw sample_rows makes at its position with that seed (a
    seeded request's tokens are those it gets without speculation). Greedy rows keep proposals
    while they equal the argmax."""
    from hypertron.serve.sampling import sample_rows, verify_proposal

    logits = np.broadcast_to(np.log(P), (DRAWS, 2, len(P))).astype(np.float32)
    ones, seeds, at = np.ones(DRAWS, np.float32), jnp.arange(DRAWS, dtype=jnp.uint32), jnp.full(DRAWS, 7)
    fn = jax.jit(verify_proposal)
    tokens, emitted = (np.asarray(x) for x in fn(jnp.asarray(logits), ones, jnp.zeros(DRAWS, jnp.int32), ones, seeds,
                                                 at, jnp.full((DRAWS, 1), 2), jnp.ones(DRAWS, jnp.int32)))
    kept = (emitted == 2).mean()
    assert abs(kept - P[2]) < 5 * np.sqrt(kept * (1 - kept) / DRAWS)
    assert _chi2(tokens[:, 0], P) < CHI2_5_999
    for place in (0, 1):
        alone = sample_rows(jnp.asarray(logits[:, place]), ones, jnp.zeros(DRAWS, jnp.int32), ones, seeds, at + place)
        assert np.array_equal(tokens[:, place], np.asarray(alone))
    greedy = np.broadcast_to(np.log(np.eye(len(P))[0] + 1e-3), (4, 4, len(P))).astype(np.float32)
    proposal = np.array([[0, 0, 3], [0, 4, 0], [5, 0, 0], [0, 0, 0]])
    zeros = jnp.zeros(4)
    tokens, emitted = fn(jnp.asarray(greedy), zeros, jnp.zeros(4, jnp.int32), zeros + 1, jnp.arange(4, dtype=jnp.uint32),
                         jnp.zeros(4, jnp.int32), jnp.asarray(proposal), jnp.asarray([3, 3, 3, 2]))
    assert np.asarray(emitted).tolist() == [3, 2, 1, 3] and not np.asarray(tokens).any()  # the argmax, 0, each time


# -- through the scheduler and the engine ---------------------------------------------------------

def _spec_runs(preset: str, eos: int | None = None, draft: str | None = None):
    """Five requests, greedy but the last (seeded, temperature 0.9), three of them repeating
    themselves, through a tiny float32 ``preset``, 3 slots and a pool of 14 pages of 4 (pre-emption), a budget of 24 tokens: with speculation off
    (one step ahead), n-gram k = 4 (one step ahead) and k = 1 (not); with ``draft`` (``"self"``: the
    model itself, ``"small"``: a random model of one layer), a draft model's k = 4 too (one step
    ahead); the small draft has a vocabulary of 2.5 times the model's (a padded one: its ids past
    the model's are never proposed). Returns each run's ``(tokens, log-probabilities, finish reasons,
    scheduler, sampled rows, steps mixing proposals and prefill, the largest id a draft model
    proposed)`` and the engine."""
    from serving import padded_engine  # tests/

    from hypertron.config import PRESETS, EngineConfig
    from hypertron.models import init_params
    from hypertron.serve.engine import DraftModel
    from hypertron.serve.scheduler import Request, Scheduler, run_until_done
    from hypertron.serve.shapes import Shape
    from hypertron.serve.types import SamplingParams

    cfg = dataclasses.replace(PRESETS[preset], num_layers=2, max_seq_len=64, dtype="float32")
    if cfg.sliding_window:  # Mistral's, narrower than the sequences
        cfg = dataclasses.replace(cfg, sliding_window=16)
    shapes = [Shape(3, 0, 0, logprobs=True), Shape(3, 0, 0, logprobs=True, verify=4),
              Shape(3, 2, 32, logprobs=True, verify=4)]
    params = init_params(cfg, jax.random.key(1))
    config = EngineConfig(max_slots=3, page_size=4, num_pages=15, max_top_logprobs=3)
    engine = padded_engine(params, cfg, config, shapes)
    engines = {"off": engine, "ngram": engine}
    if draft is not None:
        small = dataclasses.replace(cfg, num_layers=1, vocab_size=cfg.vocab_size * 5 // 2)
        model = DraftModel(params, cfg, 4) if draft == "self" else DraftModel(init_params(small, jax.random.key(2)),
                                                                              small, 4)
        engines["draft"] = padded_engine(params, cfg, config, shapes, draft=model)
    for e in engines.values():
        if eos is not None:
            e.eos_ids = frozenset({eos})
    rng = np.random.default_rng(0)
    base = rng.integers(3, cfg.vocab_size, 7).tolist()
    prompts = [base * 3, rng.integers(3, cfg.vocab_size, 9).tolist(), base[:4] * 4 + [9],
               rng.integers(3, cfg.vocab_size, 13).tolist(), base[2:] * 2]
    greedy = SamplingParams(temperature=0.0, seed=0, max_tokens=24, logprobs=3, ignore_eos=eos is None)
    seeded = dataclasses.replace(greedy, temperature=0.9, seed=5)  # the last request's: its draws as without
    runs = {}
    methods = (("off", 4, True), ("ngram", 4, True), ("ngram", 1, False)) + ((("draft", 4, True),) if draft else ())
    for spec, k, ahead in methods:
        sched = Scheduler(engines[spec], SchedulerConfig(max_num_batched_tokens=24, max_prefill_rows=2,
                                                         speculative=spec, num_speculative_tokens=k))
        seqs = [Request(i, p, seeded if i == len(prompts) - 1 else greedy) for i, p in enumerate(prompts)]
        for seq in seqs:
            sched.add(seq)
        lps, sampled, update = {i: [] for i in range(len(seqs))}, [0, 0, -1], sched.update

        def counted(plan, result, update=update, sampled=sampled, sched=sched):
            sampled[0] += sum(r.sample and r.request in sched._live for r in plan.rows)
            sampled[1] += bool(plan.prefills and any(r.proposal for r in plan.decodes))  # a mixed step
            if result.proposals is not None:
                sampled[2] = max(sampled[2], int(np.max(result.proposals)))
            update(plan, result)

        sched.update = counted
        run_until_done(engines[spec], sched, lambda o: o.token is not None and lps[o.seq.id].append(o.logprobs),
                       ahead=ahead)
        assert sched.stats()["pages_free"] == 14 and sched.stats()["slots_in_use"] == 0
        runs[spec, k] = ([s.generated for s in seqs], lps, [s.finish_reason for s in seqs], sched, *sampled)
    for e in engines.values():
        assert e.compiled_shapes == shapes and e.compiles["sync"] == 0
    return runs, engine


# Each preset's draft model: the model itself, or a random one-layer model with a padded vocabulary
DRAFTS = {"tiny": "small", "tiny-mistral": "self", "tiny-gemma": "self", "tiny-moe": "small"}


@pytest.mark.parametrize("preset", list(DRAFTS))
def test_greedy_tokens_and_logprobs_equal_with_speculation_off(preset):
    """Llama, Mistral (a window of 16 over sequences of up to 45 tokens), Gemma and a dropless MoE:
    n-gram speculation (k = 4 one step ahead, k = 1 not) and a draft model (k = 4, one step ahead;
    :data:`DRAFTS`: the model itself, whose drafts are mostly kept, or a random one-layer model,
    whose drafts are near all refused and never past the model's ids) give the greedy tokens, a
    seeded sampled request's tokens, and their top-3 log-probabilities (1e-5) of no speculation,
    through pre-emption (a pool of about three sequences' pages) and in steps that prefill too
    (Llama's and Gemma's), n-gram drafts kept at each place; every page and slot back; every token
    emitted is a sampling row's or a kept draft's."""
    runs, engine = _spec_runs(preset, draft=DRAFTS[preset])
    tokens, lps, *_ = runs["off", 4]
    for (spec, k), (got, got_lps, _, sched, sampled, *_) in runs.items():
        assert got == tokens, (spec, k)
        for i in lps:
            for lp, ref in zip(got_lps[i], lps[i], strict=True):
                assert lp.top_ids == ref.top_ids
                np.testing.assert_allclose([lp.logprob, *lp.top_logprobs], [ref.logprob, *ref.top_logprobs], atol=1e-5)
        d = sched.drafter
        if d is not None:
            assert d.drafts > 0 and d.draft_tokens >= d.accepted and sum(map(len, got)) == sampled + d.accepted
        if spec == "ngram":
            assert d.accepted > 0 and d.accepted_per_pos[0] > 0
    assert all(run[3].preemptions for run in runs.values())
    # A step prefills beside a proposal (Mistral's and the MoE's tokens repeat too late for one here)
    assert any(run[5] for run in runs.values()) or preset in ("tiny-mistral", "tiny-moe")
    d, most = runs["draft", 4][3].drafter, runs["draft", 4][6]
    assert 0 <= most < engine.cfg.vocab_size
    if DRAFTS[preset] == "self":
        assert d.accepted > d.draft_tokens / 3


def test_a_draft_that_is_the_model_has_every_greedy_draft_kept():
    """The model as its own draft, greedy, pages to spare: every proposal is kept, whole (the draft's
    pool holds what the model's does: the step's tokens, then its own proposal's, in pages taken
    ahead), and proposals stop at ``max_tokens``."""
    from serving import padded_engine  # tests/

    from hypertron.config import PRESETS, EngineConfig
    from hypertron.models import init_params
    from hypertron.models.flops import dense_flops_per_token
    from hypertron.serve.engine import DraftModel
    from hypertron.serve.scheduler import Request, Scheduler, run_until_done
    from hypertron.serve.shapes import Shape
    from hypertron.serve.types import SamplingParams

    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=2, max_seq_len=64, dtype="float32")
    params = init_params(cfg, jax.random.key(1))
    engine = padded_engine(params, cfg, EngineConfig(max_slots=3, page_size=4, num_pages=60),
                           [Shape(3, 0, 0, verify=4), Shape(3, 2, 32, verify=4)], draft=DraftModel(params, cfg, 4))
    rng = np.random.default_rng(0)
    sched = Scheduler(engine, SchedulerConfig(max_num_batched_tokens=24, max_prefill_rows=2, speculative="draft"))
    seqs = [Request(i, rng.integers(3, cfg.vocab_size, 9).tolist(),
                    SamplingParams(temperature=0.0, seed=0, max_tokens=24, ignore_eos=True)) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    run_until_done(engine, sched, lambda o: None)
    d = sched.drafter
    assert d.accepted == d.draft_tokens > 40 and d.accepted_per_pos[3] > 0
    assert all(len(s.generated) == 24 for s in seqs) and sched.stats()["pages_free"] == 59
    # Its cost model counts the draft: 3 decode rows' tokens, then again in the draft, then 4 draft steps
    flops = 3 * dense_flops_per_token(cfg)
    assert engine.cost(Shape(3, 0, 0)) == pytest.approx(flops * (1 + 1 + 4))


def test_a_draft_model_needs_the_served_models_tokenizer():
    """A draft whose tokenizer's vocabulary, end-of-sequence ids or any id's bytes differ is refused,
    naming what differs (its model's vocabulary may be padded otherwise); an engine without a draft cannot schedule ``speculative: draft``."""
    from hypertron.config import PRESETS
    from hypertron.errors import UserError
    from hypertron.serve.model import check_draft
    from hypertron.tokenizer import get_tokenizer

    cfg, tok = PRESETS["tiny"], get_tokenizer("byte")
    check_draft(cfg, tok, cfg, tok)
    check_draft(dataclasses.replace(cfg, vocab_size=512), tok, cfg, tok)  # a padded vocabulary: the same ids
    with pytest.raises(UserError, match="its max_seq_len is 64, under the served model's"):
        check_draft(dataclasses.replace(cfg, max_seq_len=64), tok, cfg, tok)

    class Other:  # the byte tokenizer but for one id
        def __init__(self, eos_ids=tok.eos_ids):
            self.vocab_size, self.eos_ids = tok.vocab_size, eos_ids

        def token_bytes(self, i):
            return b"?" if i == 65 else tok.token_bytes(i)

    with pytest.raises(UserError, match=re.escape("writes id 65 as b'?', the served model's as b'>'")):
        check_draft(cfg, Other(), cfg, tok)
    with pytest.raises(UserError, match="end-of-sequence ids"):
        check_draft(cfg, Other(frozenset({7})), cfg, tok)
    from fake_engine import FakeEngine  # tests/

    from hypertron.serve.scheduler import Scheduler
    with pytest.raises(ValueError, match="speculative='draft' needs an engine with a draft model"):
        Scheduler(FakeEngine(), SchedulerConfig(speculative="draft"))


def test_eos_inside_kept_drafts_ends_the_request_there():
    """A model whose next token depends on its last one alone (attention's output zeroed: a map
    f), a prompt holding x f(x) .. f^4(x) y and ending in x, and EOS f^4(x), one step ahead: the
    prompt's sample f(x) and a decode row's f^2(x) (dispatched before f(x) was known), then a
    verify row of f^3(x) f^4(x) y x, which keeps the first two and emits f^5(x) after them. The
    request stops at EOS, the second token of that row, with the tokens it gets without
    speculation, and every page and slot comes back."""
    from serving import padded_engine  # tests/

    from hypertron.config import PRESETS, EngineConfig
    from hypertron.models import forward, init_params
    from hypertron.serve.scheduler import STOP, Request, Scheduler, run_until_done
    from hypertron.serve.shapes import Shape
    from hypertron.serve.types import SamplingParams

    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=2, max_seq_len=64, dtype="float32")
    params = init_params(cfg, jax.random.key(1))
    params["layers"]["wo"] = jnp.zeros_like(params["layers"]["wo"])
    f = np.asarray(jnp.argmax(forward(params, jnp.arange(cfg.vocab_size)[:, None], cfg).logits[:, 0], -1))
    chains = [[x] for x in range(3, cfg.vocab_size)]
    for chain in chains:
        while len(chain) < 6:
            chain.append(int(f[chain[-1]]))
    x, *fx = next(c for c in chains if len(set(c)) == 6)
    y = next(t for t in range(3, cfg.vocab_size) if t not in (x, *fx))
    engine = padded_engine(params, cfg, EngineConfig(max_slots=2, page_size=4, num_pages=9),
                           [Shape(2, 0, 0), Shape(2, 0, 0, verify=4), Shape(2, 2, 32, verify=4)])
    engine.eos_ids = frozenset({fx[3]})
    got = {}
    for spec in ("off", "ngram"):
        sched = Scheduler(engine, SchedulerConfig(speculative=spec))
        seq = Request(0, [x, *fx[:4], y, x], SamplingParams(temperature=0.0, seed=0, max_tokens=12))
        sched.add(seq)
        run_until_done(engine, sched, lambda o: None, ahead=True)
        assert seq.finish_reason == STOP and sched.stats()["pages_free"] == 8 and sched.stats()["slots_in_use"] == 0
        got[spec] = seq.generated
    assert got["off"] == got["ngram"] == fx[:3]
    d = sched.drafter
    assert (d.drafts, d.draft_tokens, d.accepted) == (1, 4, 2)


@pytest.mark.parametrize("num_pages, max_tokens, ahead", [(9, 20, ()), (12, 20, (10, 11)), (12, 4, (10,))])
def test_a_draft_models_pages_ahead_evict_no_cached_prefix_and_stop_at_its_room(num_pages, max_tokens, ahead):
    """Pages taken ahead for a draft model's keys (page size 2, k = 4) come from the empty ones
    while more are empty than sequences run, never from a cached prefix (the first request's 4
    pages stay cached), and only for the drafts the next row may verify (``max_tokens``)."""
    from fake_engine import FakeEngine  # tests/

    from hypertron.serve.scheduler import Request, Scheduler, run_until_done
    from hypertron.serve.types import SamplingParams

    engine = FakeEngine(max_slots=2, page_size=2, num_pages=num_pages, max_seq_len=64)
    engine.draft_k = 4
    sched = Scheduler(engine, SchedulerConfig(max_num_batched_tokens=64, speculative="draft"))
    greedy = functools.partial(SamplingParams, temperature=0.0, seed=0, ignore_eos=True)
    first = Request(0, list(range(10, 18)), greedy(max_tokens=1))
    sched.add(first)
    run_until_done(engine, sched, lambda o: None)
    assert sched.stats()["pages_cached"] == 4
    sched.add(Request(1, list(range(30, 39)), greedy(max_tokens=max_tokens)))  # 9 tokens, sampling at 9
    (row,) = sched.schedule().rows
    assert row.pages == (5, 6, 7, 8, 9) + ahead  # its prompt's and its sample's, then those ahead
    assert sched.stats()["pages_cached"] == 8 and sched.pool.cached_prefix(
        [sched._key(first, i) for i in range(4)]) == [1, 2, 3, 4]
