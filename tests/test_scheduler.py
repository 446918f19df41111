"""The scheduler (token budget, chunked prefill, pages, pre-emption, stops, one step ahead) over the
deterministic fake engine (tests/fake_engine.py): no JAX, so every case is cheap. Each request's
tokens must equal :func:`fake_engine.reference`, computed one token at a time without batching.
"""

from __future__ import annotations

import math

import pytest
from fake_engine import TOP, FakeEngine, reference, token_logprobs  # tests/

from hypertron.serve.scheduler import LENGTH, STOP, Request, Scheduler, group_size, run_until_done
from hypertron.serve.types import SamplingParams
from hypertron.tokenizer import get_tokenizer
from serving import scheduler_for  # tests/
from support import processes  # tests/support

TOK = get_tokenizer("byte")


def _setup(engine: FakeEngine, prompts, samplings, **kw):
    sched = scheduler_for(engine, **kw)
    seqs = [Request(i, list(p), s) for i, (p, s) in enumerate(zip(prompts, samplings))]
    return sched, seqs


def _run(engine, prompts, samplings, *, ahead=True, on_step=None, **kw):
    sched, seqs = _setup(engine, prompts, samplings, **kw)
    for seq in seqs:
        sched.add(seq)
    outs = {s.id: [] for s in seqs}
    run_until_done(engine, sched, lambda o: outs[o.seq.id].append(o), ahead=ahead)
    return seqs, outs, sched


def _check_reference(seqs, outs, max_seq_len):
    for seq in seqs:
        want, reason = reference(seq.prompt, seq.sampling, max_seq_len)
        assert seq.generated == want, seq.id
        assert [o.token for o in outs[seq.id] if o.token is not None] == want
        assert outs[seq.id][-1].finish_reason == reason


def test_a_long_prompt_is_prefilled_in_chunks_while_every_running_stream_gets_a_token_each_step():
    engine = FakeEngine(max_slots=4, max_seq_len=256, page_size=4, num_pages=64)
    streams = [TOK.encode(f"stream {i}") for i in range(3)]
    long_prompt = TOK.encode("a long prompt " * 4)  # 56 tokens
    samplings = [SamplingParams(max_tokens=30, seed=i) for i in range(4)]
    sched, seqs = _setup(engine, streams + [long_prompt], samplings, max_num_batched_tokens=8)
    for seq in seqs[:3]:
        sched.add(seq)
    outs = {s.id: [] for s in seqs}

    def on_output(out):
        outs[out.seq.id].append(out)
        if out.seq.id == 2 and len(outs[2]) == 2:  # all three streams decode: the long prompt arrives
            sched.add(seqs[3])

    run_until_done(engine, sched, on_output)
    _check_reference(seqs, outs, 256)
    records = list(sched.records)
    assert all(r.num_tokens <= 8 for r in records)
    chunks = [(r, start, n) for r in records for i, start, n in r.prefills if i == 3]
    assert len(chunks) >= 56 // 5 and sum(n for _, _, n in chunks) == 56
    assert [start for _, start, _ in chunks] == [sum(n for _, _, n in chunks[:k]) for k in range(len(chunks))]
    for r, _, _ in chunks:  # while it prefills, each running stream decodes in every step
        assert set(r.decodes) == {0, 1, 2}, r


def test_short_prompts_share_a_step_and_pages_follow_the_real_lengths():
    engine = FakeEngine(max_slots=8, page_size=4, num_pages=40)
    prompts = [TOK.encode(f"p{i}") for i in range(6)]  # 2 tokens each
    seqs, outs, sched = _run(engine, prompts, [SamplingParams(max_tokens=9, seed=i) for i in range(6)],
                             max_prefill_rows=4, ahead=False)
    _check_reference(seqs, outs, 256)
    first, second = sched.records[0], sched.records[1]
    assert len(first.prefills) == 4 and first.decodes == ()  # four prompts in one step (max_prefill_rows)
    assert len(second.prefills) == 2 and len(second.decodes) == 4
    assert sched.stats()["pages_free"] == 40 and sched.stats()["slots_in_use"] == 0


def test_group_size_is_the_least_mean_time_to_first_token_by_hand():
    # 8 prompts of 129 tokens, a step's fixed cost 200 tokens' worth: groups of 3 end at 587, 1,174 and
    # 1,632 (2 prompts): sum 8,547 x ...; of 4: 716 and 1,432: 8,592; of 5: 845 and 1,432 (3): 8,521, the least
    finish = {g: sum(len(grp) * (200 * (j + 1) + 129 * sum(map(len, groups[:j + 1])))
                     for groups in [[list(range(8))[i:i + g] for i in range(0, 8, g)]] for j, grp in enumerate(groups))
              for g in range(1, 9)}
    assert (finish[3], finish[4], finish[5]) == (200 * 15 + 129 * 43, 200 * 12 + 129 * 48, 200 * 11 + 129 * 49)
    assert group_size(8, 129, 200) == min(finish, key=finish.get) == 5
    assert group_size(3, 129, 57) == 1  # a CPU: one at a time
    assert group_size(3, 129, math.inf) == 3 and group_size(1, 129, 0) == 1 and group_size(64, 129, 30) == 4


@pytest.mark.parametrize("overhead, groups", [(None, [4]), (0.0, [1, 1, 1, 1]), (12.0, [3, 1]), (40.0, [4])])
def test_new_prompts_share_a_step_as_the_step_cost_says(overhead, groups):
    """Four 8-token prompts at once; a step costs its tokens plus a fixed cost. At 12 tokens' worth:
    3 prompts in the first step (their first tokens at 12 + 24 = 36), the fourth in the next (at
    36 + 12 + 3 decodes + 8 = 59): mean 41.75, against 52.5 one at a time (20, 41, 63, 86) and 44
    all four at once. Nothing fixed: one at a time; 40: all at once."""
    engine = FakeEngine(max_slots=4, page_size=4, num_pages=40)
    prompts = [TOK.encode(f"prompt {i}") for i in range(4)]
    seqs, outs, sched = _run(engine, prompts, [SamplingParams(max_tokens=6, seed=i) for i in range(4)],
                             ahead=False, step_overhead_tokens=overhead)
    _check_reference(seqs, outs, 256)
    assert {len(p) for p in prompts} == {8}
    assert [len(r.prefills) for r in sched.records if r.prefills] == groups
    assert sched.stats()["pages_free"] == 40 and sched.stats()["slots_in_use"] == 0


def test_a_prompt_is_split_only_when_it_starts_a_steps_prefill():
    """A prompt that does not fit whole in what is left of the budget waits for the next step, so a
    step's prompts all start at position 0 (or after their cached prefix) unless one is too long
    for a whole step; that one is prefilled in chunks, each the first prefill of its step."""
    engine = FakeEngine(max_slots=4, page_size=4, num_pages=64)
    prompts = [TOK.encode("abcde"), TOK.encode("fghij"), TOK.encode("x" * 20), TOK.encode("kl")]
    seqs, outs, sched = _run(engine, prompts, [SamplingParams(max_tokens=5, seed=i) for i in range(4)],
                             max_num_batched_tokens=8, ahead=False)
    _check_reference(seqs, outs, 256)
    prefills = [r.prefills for r in sched.records if r.prefills]
    assert prefills[:2] == [((0, 0, 5),), ((1, 0, 5),)]  # the second prompt waits whole: 5 > 8 - 5
    assert all(start == 0 for p in prefills for _, start, _ in p[1:])  # only a step's first prefill is split
    chunks = [(start, n) for p in prefills for i, start, n in p if i == 2]
    assert len(chunks) > 2 and sum(n for _, n in chunks) == 20 and chunks[0][0] == 0
    assert sched.stats()["pages_free"] == 64


def test_pages_are_taken_as_sequences_grow_and_given_back_when_they_end():
    engine = FakeEngine(max_slots=2, page_size=4, num_pages=8)
    sched, (seq,) = _setup(engine, [TOK.encode("abcdef")], [SamplingParams(max_tokens=4, seed=0)])
    sched.add(seq)
    free = []
    for _ in range(4):
        plan = sched.schedule()
        free.append(sched.stats()["pages_free"])
        sched.update(plan, engine.collect(engine.dispatch(plan)))
    # 6 prompt tokens (+ the first decode write): 2 pages; positions 6, 7 fit; 8 takes a third.
    assert free == [6, 6, 6, 5] and seq.status == "finished"
    assert sched.stats()["pages_free"] == 8


@pytest.mark.parametrize("ahead", [False, True])
def test_preemption_recomputes_the_latest_sequence_and_holds_admission(ahead):
    engine = FakeEngine(max_slots=4, max_seq_len=64, page_size=4, num_pages=12)
    prompts = [TOK.encode(f"q{i}") for i in range(5)]
    samplings = [SamplingParams(max_tokens=30, seed=i, temperature=0.8) for i in range(5)]
    seqs, outs, sched = _run(engine, prompts, samplings, ahead=ahead)
    _check_reference(seqs, outs, 64)
    records = list(sched.records)
    preempted = [(r.step, i) for r in records for i in r.preempted]
    assert preempted and sched.preemptions >= len(preempted)
    for step, victim in preempted:
        # the victim is the most recently admitted of those running then; no admission until one ends
        r = next(r for r in records if r.step == step)
        assert not r.prefills or all(i == victim or start > 0 for i, start, _ in r.prefills)
    assert engine.prefills > len(prompts) and sched.stats()["pages_free"] == 12


def test_one_step_ahead_gives_what_collecting_each_step_gives_eos_and_stop_ids_included():
    prompts = [TOK.encode(p) for p in ("x~3", "y", "zz~1", "w~0")] + [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    samplings = [SamplingParams(max_tokens=12, seed=i) for i in range(4)]
    stop_at = reference(prompts[4], SamplingParams(max_tokens=12, seed=4), 256)[0][3]
    samplings.append(SamplingParams(max_tokens=12, seed=4, stop_token_ids=(stop_at,)))
    results = {}
    for ahead in (False, True):
        engine = FakeEngine(max_slots=3, page_size=4, num_pages=30)
        seqs, outs, sched = _run(engine, prompts, samplings, ahead=ahead, max_num_batched_tokens=5)
        _check_reference(seqs, outs, 256)
        results[ahead] = [(s.generated, outs[s.id][-1].finish_reason) for s in seqs]
        assert sched.stats()["pages_free"] == 30 and sched.stats()["slots_in_use"] == 0
    assert results[True] == results[False]
    assert [r for _, r in results[True]] == [STOP, LENGTH, STOP, STOP, STOP]
    assert results[True][3][0] == []  # EOS first: nothing returned


def test_prompt_logprobs_come_whole_before_the_first_token_through_chunks():
    engine = FakeEngine(max_slots=2, page_size=4, num_pages=20, max_top_logprobs=5)
    prompt = TOK.encode("twelve chars")
    sched, (seq,) = _setup(engine, [prompt], [SamplingParams(max_tokens=3, seed=0, logprobs=2)],
                           max_num_batched_tokens=5)
    seq.want_prompt_logprobs = True
    sched.add(seq)
    outs = []
    run_until_done(engine, sched, outs.append)
    assert len([r for r in sched.records if r.prefills]) == 3  # 12 tokens in chunks of 5
    lps = outs[0].prompt_logprobs
    assert outs[0].token is None and len(lps) == len(prompt) - 1
    assert lps == [token_logprobs(prompt[i], prompt[i + 1], 2) for i in range(len(prompt) - 1)]
    assert lps[0].top_ids == tuple(TOP[prompt[0], :2])
    assert [o.token for o in outs if o.token is not None] == reference(prompt, seq.sampling, 256)[0]


def test_the_scheduler_the_serving_loop_and_the_api_import_no_jax():
    import sys

    code = ("import sys, hypertron.serve.scheduler, hypertron.serve.orchestrator, hypertron.serve.server; "
            "assert 'jax' not in sys.modules")
    processes.run([sys.executable, "-c", code], check=True)
