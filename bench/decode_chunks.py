"""The engine's decode step by how many keys its decode batch reads a step
(``hypertron.kernels.ragged_paged_attention.DECODE_CHUNK_TOKENS``).

    python bench/decode_chunks.py [--rows 4 16 64] [--context 128] [--chunks 64 128 256] [--steps 60]

At the HTTP bench's model shape (random weights, 4 layers, hidden 256, 8 / 4 heads x 32, MLP 768,
vocabulary 2,048, float32, 16-token pages): for each ``--rows``, one engine per ``--chunks`` value,
each compiled with it (JAX's caches and the engines' shared programs cleared between them), holds
``rows`` sequences of ``--context`` random prompt tokens decoding greedily; the engines then take
one step each in turn (a busy machine slows each alike), ``--steps`` times after 12 warm-up steps.
One line per case: the median and fastest step, scheduling and the host's side included.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

import hypertron.serve.engine as engine_module
from hypertron.config import PRESETS, EngineConfig, SchedulerConfig
from hypertron.kernels import ragged_paged_attention as rpa
from hypertron.models import init_params
from hypertron.serve.scheduler import Request, Scheduler
from hypertron.serve.types import SamplingParams

MODEL = dataclasses.replace(PRESETS["tiny"], embed_dim=256, num_layers=4, num_heads=8, num_kv_heads=4, mlp_dim=768,
                            vocab_size=2048, max_seq_len=4096, dtype="float32")


def decoding(params, rows: int, context: int, chunk: int):
    """``(engine, scheduler)`` with ``rows`` sequences past their prompts, compiled with ``chunk``."""
    saved, rpa.DECODE_CHUNK_TOKENS = rpa.DECODE_CHUNK_TOKENS, chunk
    jax.clear_caches()
    engine_module._shared.clear()  # programs compiled for another chunk must not be reused
    try:
        engine = engine_module.PagedEngine(params, MODEL, EngineConfig(max_slots=max(rows, 2), compile="lazy"))
        sched = Scheduler(engine, SchedulerConfig(max_num_batched_tokens=max(4096, rows * (context + 1))))
        rng = np.random.default_rng(0)
        greedy = SamplingParams(temperature=0.0, seed=0, max_tokens=100_000, ignore_eos=True)
        for i in range(rows):
            sched.add(Request(i, rng.integers(3, MODEL.vocab_size, context).tolist(), greedy))
        for _ in range(12):  # the prompts, then decode steps: every program compiled here
            step(engine, sched)
    finally:
        rpa.DECODE_CHUNK_TOKENS = saved
    return engine, sched


def step(engine, sched) -> None:
    plan = sched.schedule()
    sched.update(plan, engine.run(plan))
    sched.take_outputs()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--context", type=int, default=128, help="prompt tokens a sequence")
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args(argv)
    params = init_params(MODEL, jax.random.key(1))
    for rows in args.rows:
        runs = {chunk: decoding(params, rows, args.context, chunk) for chunk in args.chunks}
        times = {chunk: [] for chunk in runs}
        for _ in range(args.steps):
            for chunk, (engine, sched) in runs.items():
                start = time.perf_counter()
                step(engine, sched)
                times[chunk].append(time.perf_counter() - start)
        for chunk, t in times.items():
            t = np.sort(t) * 1e3
            print(f"decode rows={rows} context={args.context} chunk={chunk}: median {t[len(t) // 2]:.2f} ms "
                  f"fastest {t[0]:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
