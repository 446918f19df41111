"""One serving load through each layer of the serving stack: what each layer costs.

    python bench/serve_stack.py [--concurrency 16] [--requests 2] [--repeats 5] [--http]

The HTTP bench's shared-prefix workload (``bench/serve_http.py --workload shared-prefix``: prompts
of BOS, one shared ``--prefix-len`` tokens and ``--suffix-len`` of their own, ``--max-tokens`` out,
greedy, ``--concurrency`` streams each sending ``--requests`` one after another, prefix caching on)
at its model's shape (random weights, 4 layers, hidden 256, 8 / 4 heads x 32, MLP 768, vocabulary
2,048, float32, 16-token pages) and its server's settings (``--slots`` sequences with pages for all,
512 tokens a step), each layer's engine readied as ``hypertron serve`` readies it (its step's cost
measured, the largest shape compiled, later ones in the background), run by:

- ``loop``: the :class:`~hypertron.serve.scheduler.Scheduler` and
  :class:`~hypertron.serve.engine.PagedEngine` in a plain loop (``schedule``, ``run``,
  ``update``); a stream's next request joins the step after its last one ended;
- ``orchestrator``: :class:`~hypertron.serve.orchestrator.Orchestrator` on its thread, the streams
  asyncio tasks on this process's event loop consuming its :class:`Generation` chunks (no HTTP, no
  tokenizer: a one-letter-a-token decode);
- ``http`` (``--http``): ``bench/serve_http.py --servers hypertron --workload shared-prefix
  --prefix-caching on`` in a subprocess (a real tokenizer, the server and the client on this
  machine), its median of 3 runs; then ``http-engine-process``, the same with ``hypertron serve
  --engine-process`` (the engine loop in a process of its own: :mod:`hypertron.serve.engine_process`).

Each in-process layer warms up (2 rounds, then until the compiles they queued are done; the prefix
cached), then runs ``--repeats`` rounds of ``concurrency x requests`` requests, the layers taking
turns (a busy machine slows each alike). Per layer: mean time to first token (from when the
request is handed over) and output tokens/s, the median over the rounds and each round's; the
orchestrator's loop turn by phase (``hypertron_step_phase_seconds``); the step shapes each
engine compiled during the measured rounds. The HTTP figures are the client's (``ttft_ms``) and
the server's own TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from hypertron.config import PRESETS, EngineConfig, ServeConfig
from hypertron.models import init_params
from hypertron.serve.engine import PagedEngine
from hypertron.serve.scheduler import Request
from hypertron.serve.readying import orchestrate
from hypertron.serve.types import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_profile import Letters, _times  # bench/serve_profile.py, this directory

MODEL = dataclasses.replace(PRESETS["tiny"], embed_dim=256, num_layers=4, num_heads=8, num_kv_heads=4, mlp_dim=768,
                            vocab_size=2048, max_seq_len=4096, dtype="float32")
BUDGET = 512  # tokens a step, as bench/serve_http.py's servers


class _Prompts:
    """Shared-prefix prompts: one BOS + prefix, then new random tokens each."""

    def __init__(self, args):
        self.rng = np.random.default_rng(0)
        self.prefix = [1] + self.rng.integers(3, MODEL.vocab_size, args.prefix_len).tolist()
        self.suffix_len = args.suffix_len

    def next(self) -> list[int]:
        return self.prefix + self.rng.integers(3, MODEL.vocab_size, self.suffix_len).tolist()


def _ready(params, args):
    """An engine and its orchestrator (not started), readied as ``hypertron serve`` readies them
    (:func:`hypertron.serve.readying.orchestrate`: the step's cost measured, the largest shape compiled
    in the background), with pages for every slot's sequence."""
    page = EngineConfig().page_size
    pages = args.slots * -(-(1 + args.prefix_len + args.suffix_len + args.max_tokens) // page) + 1
    serve = ServeConfig(max_slots=args.slots, num_pages=pages, kv_cache_dtype="float32", max_num_batched_tokens=BUDGET)
    engine = PagedEngine(params, MODEL, serve.engine)
    return engine, orchestrate(engine, Letters(), serve)


def settle(*engines) -> None:
    """Until no engine has a compile queued (what a warm-up round queued, done)."""
    while any(e.queued_compiles for e in engines):
        time.sleep(0.05)


def loop_round(engine, sched, prompts, sampling, streams: int, per_stream: int, ids) -> tuple[list[float], float]:
    """One round through the plain loop: each request's TTFT (s) and the round's seconds; ``ids``
    numbers the requests (on across rounds: the scheduler takes no id twice)."""
    given, first, owner, left = {}, {}, {}, dict.fromkeys(range(streams), per_stream)

    def give(stream: int) -> None:
        i = next(ids)
        owner[i], given[i] = stream, time.perf_counter()
        left[stream] -= 1
        sched.add(Request(i, prompts.next(), sampling))

    start = time.perf_counter()
    for s in range(streams):
        give(s)
    while sched.has_work:
        plan = sched.schedule()
        if plan is None:
            break
        sched.update(plan, engine.run(plan))
        now = time.perf_counter()
        for out in sched.take_outputs():
            i = out.seq.id
            if out.token is not None:
                first.setdefault(i, now)
            if out.finish_reason is not None and left[owner[i]]:
                give(owner[i])
    return [first[i] - given[i] for i in given], time.perf_counter() - start


async def orchestrator_round(orch, prompts, sampling, streams: int, per_stream: int) -> tuple[list[float], float]:
    """One round through the orchestrator: each request's TTFT (s) and the round's seconds."""
    ttfts = []

    async def stream() -> None:
        for _ in range(per_stream):
            t, first = time.perf_counter(), None
            async for _chunk in orch.submit(prompts.next(), sampling):
                if first is None:
                    first = time.perf_counter() - t
            ttfts.append(first)

    start = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(streams)))
    return ttfts, time.perf_counter() - start


def http_figures(args, engine_process: bool = False) -> dict:
    """bench/serve_http.py's shared-prefix figures for hypertron (median of 3 runs), its engine in a
    process of its own with ``engine_process``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "http.json")
        here = os.path.dirname(os.path.abspath(__file__))
        done = subprocess.run([sys.executable, os.path.join(here, "serve_http.py"), "--servers", "hypertron",
                               "--workload", "shared-prefix", "--prefix-caching", "on", "--concurrency",
                               str(args.concurrency), "--num-requests", str(args.concurrency * args.requests),
                               "--repeats", "3", "--no-interference", "--prefix-len", str(args.prefix_len),
                               "--suffix-len", str(args.suffix_len), "--max-tokens", str(args.max_tokens),
                               "--output", out, *(["--hypertron-args=--engine-process"] if engine_process else [])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            sys.exit("error: bench/serve_http.py failed:\n" + "\n".join(done.stderr.splitlines()[-20:]))
        with open(out) as f:
            got = json.load(f)["results"][f"shared-prefix c{args.concurrency}"]["hypertron on"]
    return {"ttft_ms": got["ttft_mean_ms"], "out_tok_s": got["out_tok_s"],
            "server_ttft_ms": got["step_breakdown"].get("server_ttft")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=2,
                   help="requests a stream sends, one after another (--http: at least 2, serve_http.py's least)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--http", action="store_true", help="also bench/serve_http.py's figures (a subprocess)")
    args = p.parse_args(argv)
    sys.setswitchinterval(0.0005)  # as hypertron serve sets it (hypertron.serve.server)
    params = init_params(MODEL, jax.random.key(1))
    sampling = SamplingParams(temperature=0.0, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = _Prompts(args)
    engine, unused = _ready(params, args)
    sched = unused.scheduler  # the plain loop drives the scheduler orchestrate made, not its thread
    orch_engine, orch = _ready(params, args)
    orch.start()
    n, c, ids = args.requests, args.concurrency, itertools.count()
    results = {"loop": [], "orchestrator": []}
    try:
        before: dict[str, float] = {}
        warm: dict[str, dict] = {}
        for r in range(args.repeats + 2):  # the first two warm up
            loop = loop_round(engine, sched, prompts, sampling, c, n, ids)
            orchestrated = asyncio.run(orchestrator_round(orch, prompts, sampling, c, n))
            if r == 1:
                settle(engine, orch_engine)
                before = _times(orch)  # the measured rounds' turns and compiles from here
                warm = {"loop": dict(engine.compiles), "orchestrator": dict(orch_engine.compiles)}
            elif r > 1:
                results["loop"].append(loop)
                results["orchestrator"].append(orchestrated)
        after = _times(orch)
        compiles = {name: {k: e.compiles[k] - warm[name][k] for k in e.compiles}
                    for name, e in (("loop", engine), ("orchestrator", orch_engine))}
    finally:
        orch.stop()
        unused.stop()
    print(f"# jax {jax.__version__}, {jax.devices()[0].platform}; {c} streams x {n} requests, {args.prefix_len} shared "
          f"+ {args.suffix_len} tokens, {args.max_tokens} out; medians of {args.repeats} rounds")
    for name, rounds in results.items():
        ttft = [1e3 * np.mean(t) for t, _ in rounds]
        rate = [c * n * args.max_tokens / s for _, s in rounds]
        print(f"stack {name}: ttft_mean_ms {np.median(ttft):.1f} out_tok_s {np.median(rate):.1f} "
              f"(rounds: {' '.join(f'{t:.0f}' for t in ttft)} ms; {' '.join(f'{r:.0f}' for r in rate)} tok/s)")
    turns = after["turns"] - before["turns"]
    parts = " ".join(f"{k} {1e3 * (v - before[k]) / max(turns, 1):.2f}" for k, v in after.items() if k != "turns")
    print(f"stack orchestrator turn_ms: {parts}")
    print("stack compiles in the measured rounds:", json.dumps(compiles))
    for name, engine_process in (("http", False), ("http-engine-process", True)) if args.http else ():
        h = http_figures(args, engine_process)
        print(f"stack {name}: ttft_mean_ms {h['ttft_ms']:.1f} out_tok_s {h['out_tok_s']:.1f} "
              f"server_ttft_ms {h['server_ttft_ms']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
