"""Automatic prefix caching in the scheduler (hypertron/serve/prefix_cache.py), over the fake
engine (tests/fake_engine.py), which reads each row's prefix back from the tokens written into its
pages and refuses a row whose pages do not hold it: a wrongly shared page changes the tokens, and
every request's tokens must equal :func:`fake_engine.reference`. No JAX.
"""

from __future__ import annotations

import random

from fake_engine import FakeEngine, reference  # tests/
from serving import scheduler_for  # tests/

from hypertron.serve.prefix_cache import PagePool, page_key
from hypertron.serve.scheduler import LENGTH, Request, Scheduler, run_until_done
from hypertron.serve.types import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, seed=0)


def _serve(sched: Scheduler, engine: FakeEngine, requests: list[Request], ahead: bool = True) -> None:
    """Run ``requests`` one after another (each is queued once the one before has ended), checking
    each against the reference."""
    for seq in requests:
        sched.add(seq)
        run_until_done(engine, sched, lambda o: None, ahead=ahead)
        assert (seq.generated, seq.finish_reason) == reference(seq.prompt, seq.sampling, engine.max_seq_len)


def test_a_key_depends_on_every_earlier_token_and_the_salt_and_is_the_same_in_every_process():
    assert page_key(None, [1, 2, 3, 4]).hex()[:16] == "eaccf80d077b1bed"  # SHA-256, not Python's salted hash
    sched = scheduler_for(FakeEngine(page_size=4))
    prompt = list(range(10, 30))

    def keys(tokens, salt=None):
        seq = Request(0, tokens, GREEDY, cache_salt=salt)
        return [sched._key(seq, i) for i in range(len(tokens) // 4)]

    base = keys(prompt)
    assert len(set(base)) == 5
    for at in (0, 5, 11):  # a token changed: that page's key and every later one change
        changed = keys(prompt[:at] + [99] + prompt[at + 1:])
        assert changed[:at // 4] == base[:at // 4]
        assert all(a != b for a, b in zip(changed[at // 4:], base[at // 4:]))
    assert keys(prompt, "a") != base and not set(keys(prompt, "a")) & set(keys(prompt, "b"))
    assert keys(prompt, "a") == keys(prompt, "a")
    assert page_key(None, [1, 2, 3, 4], "") != page_key(None, [1, 2, 3, 4])


def test_reference_counts_and_lru_order_by_hand():
    pool = PagePool(5)
    a, b, c = (pool.take() for _ in range(3))
    assert (a, b, c) == (1, 2, 3) and pool.num_free == 2
    ka, kb, kc = (page_key(None, [i]) for i in range(3))
    for page, key in ((a, ka), (b, kb), (c, kc)):
        pool.register(page, key)
    pool.register(pool.take(), ka)  # page 4: a key cached already keeps its page; 4 stays unkeyed
    assert pool.cached_prefix([ka, kb, kc]) == [a, b, c] and pool.num_cached == 3
    pool.release([4])
    pool.share([a, b])  # a second sequence shares the first two
    assert pool.refs[1:] == [2, 2, 1, 0, 0]
    pool.release([a, b, c])  # the first ends: c goes free (cached), a and b stay held
    assert pool.refs[1:] == [1, 1, 0, 0, 0] and pool.num_free == 3
    pool.release([a, b])  # the second ends: freed last page first
    assert pool.num_free == 5 and pool.num_cached == 3
    # Unkeyed pages go first, then the least recently freed: c, then b (the tail), then a.
    assert [pool.take() for _ in range(3)] == [4, 5, c]
    assert pool.cached_prefix([ka, kb, kc]) == [a, b]  # c's key went with it
    pool.share([a])  # a cached free page shared: no longer free
    assert pool.num_free == 1 and pool.take() == b and pool.take() is None
    assert pool.cached_prefix([ka, kb]) == [a]
    pool.release([b, c, 4, 5])
    assert pool.reset() == 0 and pool.num_cached == 1  # a is held: kept
    pool.release([a])
    assert pool.reset() == 1 and pool.num_cached == 0 and pool.num_free == 5


def test_the_last_prompt_tokens_page_is_never_shared_and_a_salt_or_caching_off_shares_nothing():
    engine = FakeEngine(page_size=4)
    sched = scheduler_for(engine)
    prompt = list(range(40, 52))  # 12 tokens: 3 full pages
    runs = [Request(i, prompt[:n], GREEDY, cache_salt=salt)
            for i, (n, salt) in enumerate([(12, None), (12, None), (12, "x"), (12, "x"), (9, None), (8, None)])]
    _serve(sched, engine, runs)
    # The first of each salt finds nothing; 12 tokens share 2 pages (the third holds the last
    # token, which is prefilled to sample), 9 share 2, 8 share 1.
    assert [s.cached_tokens for s in runs] == [0, 8, 0, 8, 8, 4]
    starts = {i: start for r in sched.records for i, start, _ in r.prefills}
    assert [starts[i] for i in range(6)] == [0, 8, 0, 8, 8, 4]
    stats = sched.stats()
    assert (stats["prefix_queries"], stats["prefix_hits"]) == (12 * 4 + 9 + 8, 28)
    off = scheduler_for(engine, enable_prefix_caching=False)
    _serve(off, engine, [Request(10 + i, prompt, GREEDY) for i in range(2)])
    assert off.stats()["pages_cached"] == 0 and all(s == 0 for r in off.records for _, s, _ in r.prefills)


def test_generated_pages_are_keyed_and_a_preempted_sequence_finds_its_pages():
    # 10 pages of 4: two sequences of 8 + 20 tokens cannot both finish; the later one is pre-empted.
    engine = FakeEngine(max_slots=2, page_size=4, num_pages=10)
    sched = scheduler_for(engine)
    sampling = SamplingParams(max_tokens=20, seed=3, ignore_eos=True)
    seqs = [Request(i, list(range(60 + i, 68 + i)), sampling) for i in range(2)]
    for seq in seqs:
        sched.add(seq)
    run_until_done(engine, sched, lambda o: None, ahead=True)
    assert sched.preemptions >= 1
    for seq in seqs:
        assert (seq.generated, seq.finish_reason) == reference(seq.prompt, sampling, engine.max_seq_len)
    preempted = {i for r in sched.records for i in r.preempted}
    resumed = [start for r in sched.records for i, start, _ in r.prefills if i in preempted and start > 0]
    assert resumed and all(start % 4 == 0 for start in resumed)  # re-admitted after its cached pages
    assert sched.pool.refs == [0] * 11
    # A prompt that continues a finished sequence's generated tokens shares them too.
    engine = FakeEngine(page_size=4)
    sched = scheduler_for(engine)
    first = Request(0, list(range(60, 68)), SamplingParams(max_tokens=12, seed=3, ignore_eos=True))
    again = Request(1, first.prompt + reference(first.prompt, first.sampling, 256)[0][:9], GREEDY)
    _serve(sched, engine, [first, again])
    assert again.cached_tokens == 16  # 2 pages of prompt, 2 of generated tokens


def test_page_pressure_evicts_before_it_fails_a_request_that_fits_an_empty_pool():
    engine = FakeEngine(max_slots=2, page_size=4, num_pages=8)
    sched = scheduler_for(engine)
    _serve(sched, engine, [Request(0, list(range(70, 90)), GREEDY)])  # 5 pages cached
    assert sched.stats()["pages_cached"] >= 5 and sched.stats()["pages_free"] == 8
    big = Request(1, list(range(100, 127)), SamplingParams(max_tokens=5, seed=1, ignore_eos=True))
    _serve(sched, engine, [big])  # 27 + 5 tokens: every page of the pool
    assert big.finish_reason == LENGTH and len(big.generated) == 5


def test_a_fuzz_of_2000_requests_over_shared_prefixes_gets_every_reference_and_frees_every_page():
    """8 shared prefixes, random suffixes, salts, lengths and aborts; one step ahead; a pool of
    about three sequences' pages, so that eviction and pre-emption are frequent."""
    rng = random.Random(0)
    engine = FakeEngine(max_slots=6, max_seq_len=64, page_size=4, num_pages=30)
    sched = scheduler_for(engine, max_num_batched_tokens=24, max_prefill_rows=3)
    prefixes = [[rng.randrange(3, 259) for _ in range(rng.randrange(4, 24))] for _ in range(8)]
    todo = []
    for i in range(2000):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 259) for _ in range(rng.randrange(0, 8))]
        sampling = SamplingParams(max_tokens=rng.randrange(1, 24), temperature=rng.choice([0.0, 1.0]),
                                  seed=rng.randrange(4))
        todo.append(Request(i, prompt, sampling, cache_salt=rng.choice([None, None, None, "s"])))
    pending, aborted = list(reversed(todo)), set()

    def on_output(out):
        if out.finish_reason is not None and pending:
            sched.add(pending.pop())
        elif out.token is not None and rng.random() < 0.01:
            sched.abort(out.seq)
            aborted.add(out.seq.id)
            if pending:
                sched.add(pending.pop())

    for _ in range(12):
        sched.add(pending.pop())
    run_until_done(engine, sched, on_output, ahead=True)
    assert not pending and len(aborted) > 20 and sched.preemptions > 100
    for seq in todo:
        want, reason = reference(seq.prompt, seq.sampling, engine.max_seq_len)
        if seq.id in aborted:
            assert want[:len(seq.generated)] == seq.generated, seq.id
        else:
            assert (seq.generated, seq.finish_reason) == (want, reason), seq.id
    stats = sched.stats()
    assert stats["prefix_hits"] > stats["prefix_queries"] / 4
    assert sched.pool.refs == [0] * 31 and stats["pages_free"] == 30 and stats["slots_in_use"] == 0
