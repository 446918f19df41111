"""Fuzzing at scale: what ``tests/test_hostile_inputs.py`` and ``tests/test_fuzz_cli.py`` run in the
suite, with far more examples.

    python bench/fuzz.py [--part server|cli|all] [--server-examples 5000] [--engine tiny|fake]
                         [--cli-examples 2000]
                         [--seed 0] [--hang-s 30]

``server``: ``hypertron serve``'s app on 127.0.0.1 (uvicorn in a thread, a free port; a few requests
first so that the common step shapes are compiled before the clock starts) over a
random tiny model (the ``tiny`` preset cut to 2 layers, the byte tokenizer's 259 ids, 64 tokens
of context, 4 slots, a KV page pool of 48 tokens so that prompts past it are refused, compiled in
the background as ``hypertron serve`` compiles) or, with ``--engine fake``, the tests'
deterministic fake engine; schemathesis reads its ``/openapi.json`` and sends about
``--server-examples`` generated requests over every operation, positive and negative
(``tests/support/api_fuzz.py``), each checked: no 5xx, status, content type and body as the
description says, an answer within ``--hang-s``. Then ``/health`` must answer ok and every slot
and KV page must be free. Prints the counts of requests, 2xx, 4xx, 5xx and hangs, and the first
failures. Exit status 1 if any check failed.

``cli``: the CLI's and the run-file readers' half: the hypothesis strategies of
``tests/support/fuzz.py`` (config overrides through ``plan``, a shipped recipe with one field made
hostile, ``embed plan`` files, run files under ``monitor --json``), ``--cli-examples`` in all,
shared between the targets, random (not the suite's derandomized run). Every input must end in
one ``error:`` line and a non-zero exit, a counted skip, or an answer: never a traceback. Prints
each target's outcomes, its slowest example and any failure (hypothesis's shrunk input).
``all``: both.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def tiny_engine():
    """A random 2-layer ``tiny`` model over the byte tokenizer, as :class:`PagedEngine`."""
    import jax

    from hypertron.config import PRESETS
    from hypertron.models import init_params
    from hypertron.config import EngineConfig
    from hypertron.serve.engine import PagedEngine
    from hypertron.tokenizer import get_tokenizer

    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=2, max_seq_len=64,
                              vocab_size=get_tokenizer("byte").vocab_size)
    config = EngineConfig(max_slots=4, page_size=4, num_pages=13, max_top_logprobs=5, compile="background")
    return PagedEngine(init_params(cfg, jax.random.key(0)), cfg, config)


def fuzz_server_part(examples: int, seed: int, hang_s: float, engine_kind: str) -> bool:
    """The server half; prints its counts; True if nothing failed."""
    import httpx
    from fake_engine import FakeEngine
    from http_harness import ThreadedServer
    from support.api_fuzz import fuzz_server

    from hypertron.config import SchedulerConfig
    from hypertron.serve.orchestrator import Orchestrator
    from hypertron.serve.server import create_app
    from hypertron.tokenizer import get_tokenizer

    tok = get_tokenizer("byte")
    engine = tiny_engine() if engine_kind == "tiny" else FakeEngine(max_slots=4, max_seq_len=64, num_pages=12)
    orch = Orchestrator(engine, tok, SchedulerConfig(max_queue=64))
    app = create_app(orch, tok, "fuzz-model", max_tokens_limit=32, max_body_bytes=64 << 10)
    t0 = time.perf_counter()
    with ThreadedServer(app, lifespan="on", log_level="critical", graceful_s=5) as server:
        # The common step shapes compiled first, outside the clock (with log-probabilities, a step
        # is another program): a request that waits for its step's first compile waited 20 s here.
        for n, extra in itertools.product((1, 2, 4, 8, 16, 32, 47), ({}, {"logprobs": 2, "echo": True})):
            httpx.post(server.url + "/v1/completions", timeout=600, json={
                "model": "fuzz-model", "prompt": [5] * n, "max_tokens": 8, "temperature": 0, **extra})
        t0 = time.perf_counter()
        counts = fuzz_server(server.url, examples=examples, seed=seed, hang_s=hang_s)
        health = httpx.get(server.url + "/health", timeout=hang_s).json()
        deadline = time.monotonic() + hang_s
        while (stats := orch.scheduler.stats())["slots_in_use"] and time.monotonic() < deadline:
            time.sleep(0.05)
    took = time.perf_counter() - t0
    idle = stats["slots_in_use"] == 0 and stats["pages_free"] == stats["pages_total"] and stats["waiting"] == 0
    ok_2xx = sum(n for code, n in counts.statuses.items() if 200 <= code < 300)
    print(f"server ({engine_kind} engine): {counts.requests:,} requests in {took:.0f} s: {ok_2xx:,} 2xx, "
          f"{counts.client_errors:,} 4xx, {counts.server_errors:,} 5xx, {counts.hangs} hangs over {hang_s:g} s; "
          f"{counts.failed} failed checks")
    print(f"  statuses: {dict(sorted(counts.statuses.items()))}")
    print(f"  after: /health {health}, {stats['slots_in_use']} slots in use, "
          f"{stats['pages_free']}/{stats['pages_total']} pages free, {stats['waiting']} waiting")
    for failure in counts.failures:
        print("  FAILED " + failure.replace("\n", "\n    "))
    return counts.failed == 0 and health == {"status": "ok"} and idle


def fuzz_cli_part(examples: int, hang_s: float) -> bool:
    from support.fuzz import TARGETS, fuzz

    ok = True
    per_target = max(1, examples // len(TARGETS))
    print(f"cli: {per_target * len(TARGETS):,} examples, {per_target:,} for each of {', '.join(TARGETS)}")
    for target in TARGETS:
        t0 = time.perf_counter()
        try:
            counts, failure = fuzz(target, per_target, derandomize=False), None
        except Exception as e:  # hypothesis re-raises the shrunk example's failure
            counts, failure = {}, f"{type(e).__name__}: {e}"
        took = time.perf_counter() - t0
        slowest = counts.get("slowest_s", 0.0) if isinstance(counts, dict) else 0.0
        outcomes = ", ".join(f"{n:,} {k}" for k, n in sorted(counts.items()) if k != "slowest_s")
        print(f"  {target:9s} {outcomes or 'no outcome'}; {took:.1f} s, slowest example {slowest:.2f} s")
        if failure or slowest > hang_s:
            ok = False
            print("  FAILED " + (failure or f"an example took {slowest:.1f} s").replace("\n", "\n    "))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("server", "cli", "all"), default="all")
    ap.add_argument("--server-examples", type=int, default=5000)
    ap.add_argument("--engine", choices=("tiny", "fake"), default="tiny")
    ap.add_argument("--cli-examples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hang-s", type=float, default=30.0)
    args = ap.parse_args()
    print(f"# hypertron fuzz bench  {datetime.date.today()}  {platform.node()}  "
          f"{os.cpu_count()} CPUs  Python {platform.python_version()}")
    print(f"# command: python bench/fuzz.py {' '.join(sys.argv[1:])}")
    ok = True
    if args.part in ("server", "all"):
        ok &= fuzz_server_part(args.server_examples, args.seed, args.hang_s, args.engine)
    if args.part in ("cli", "all"):
        ok &= fuzz_cli_part(args.cli_examples, args.hang_s)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
