"""Driving a serving engine in tests: a scheduler + engine pair, run to the end (importing this
imports no JAX: the fake engine's tests use it too)."""

from __future__ import annotations

import numpy as np

from hypertron.config import SchedulerConfig
from hypertron.serve.scheduler import Request, Scheduler, run_until_done
from hypertron.serve.types import Row, SamplingParams, StepPlan


def scheduler_for(engine, *, step_overhead_tokens=None, **kw) -> Scheduler:
    """A scheduler over ``engine`` with a :class:`SchedulerConfig` of ``kw``."""
    return Scheduler(engine, SchedulerConfig(**kw), step_overhead_tokens=step_overhead_tokens)


def run(engine, prompts, samplings, *, ahead=False, **scheduler_kw):
    """``(sequences, outputs per sequence, scheduler)`` of ``prompts`` run to the end."""
    sched = scheduler_for(engine, **scheduler_kw)
    seqs = [Request(i, list(p), s) for i, (p, s) in enumerate(zip(prompts, samplings))]
    for seq in seqs:
        sched.add(seq)
    outs = {i: [] for i in range(len(seqs))}
    run_until_done(engine, sched, lambda o: outs[o.seq.id].append(o), ahead=ahead)
    return seqs, outs, sched


def padded_engine(params, cfg, config, shapes, draft=None):
    """A paged engine with background compiles, ``shapes`` compiled and its compiler held off: every
    plan runs padded to the cheapest of them that holds it, however much more that costs. For a
    test whose dozen plans would each compile a shape of its own: padding rows and tokens are
    masked out, so the tokens are the same (``test_engine.py``'s padded test holds them to an
    engine that runs each plan at its own shape). ``draft``: the engine's draft model
    (:class:`~hypertron.serve.engine.DraftModel`)."""
    import dataclasses

    from hypertron.serve import engine as engine_module

    engine = engine_module.PagedEngine(params, cfg, dataclasses.replace(config, compile="background"), draft=draft)
    engine._enqueue = lambda shape: None  # no plan's own shape is compiled
    for shape in shapes:
        engine._compile(shape)
    return engine


def teacher_forced_logprobs(params, cfg, kv_dtype: str, tokens: list[int], prefix: int, page_size: int = 4):
    """Log-probabilities ``[len(tokens) - prefix - 1, vocab]`` of the next token at each position
    from ``prefix`` on, read through the pages: ``prefix`` tokens prefilled, then the rest as one
    chunk after that cached prefix, so that every key and value it attends to is read back from
    the cache, in ``kv_dtype`` (the engine's prompt log-probabilities, with every id as a top id).
    The chunk's step shape is compiled first, and the prefix's step runs padded to it (one compile,
    not two: the compiler is held off, as the engine would queue the prefix's own shape)."""
    from hypertron.config import EngineConfig
    from hypertron.serve.engine import PagedEngine

    engine = PagedEngine(params, cfg, EngineConfig(max_slots=1, page_size=page_size, kv_cache_dtype=kv_dtype,
                                                   max_top_logprobs=cfg.vocab_size, compile="background"))
    pages = tuple(range(1, -(-len(tokens) // page_size) + 1))
    greedy = SamplingParams(temperature=0.0, seed=0)
    rest = tuple(tokens[prefix:])
    targets = tuple(tokens[prefix + 1:]) + (-1,)
    chunk = StepPlan(1, (), (Row(0, 0, prefix, rest, pages, greedy, prompt_targets=targets),), prompt_logprobs=True)
    engine._enqueue = lambda shape: None
    engine._compile(engine.shape(chunk))
    engine.run(StepPlan(0, (), (Row(0, 0, 0, tuple(tokens[:prefix]), pages, greedy, sample=False),)))
    result = engine.run(chunk)
    _, top_ids, top_lps = result.prompt[0]
    out = np.empty((len(rest) - 1, cfg.vocab_size), np.float32)
    np.put_along_axis(out, np.asarray(top_ids[:-1]), np.asarray(top_lps[:-1]), axis=1)
    return out
