"""Structured output's cost to the streams beside it: ``python bench/serve_guided.py``.

``bench/serve_http.py``'s model (a byte-level BPE trained on the standard library and a random
Llama, ``bench/serve_model.py``), served by one ``hypertron serve`` at ``--streams`` slots. Each run
starts ``--streams`` streamed completions at once (``--max-tokens`` each, greedy, ``ignore_eos``),
distinct prompts of ``--input-len`` tokens; in a *mixed* run ``--guided`` of them carry
``structured_outputs.json`` (:data:`SCHEMA`, a closed schema about as long as ``--max-tokens``),
in a *plain* run the same prompts go unguided (prefix caching off, so the second finds nothing).
Mixed and plain runs alternate (``--repeats`` each, after ``--warmups`` of each that compile their
shapes). Per run, the mean TPOT of the streams that are
unguided in both (each stream's last token time minus its first over its tokens minus one). Each
run starts once the server's background compiler has nothing queued. Prints per pair and then the
medians (the ratio's: the median of the pairs' ratios)::

    guided cC gG: unguided_tpot_ms mixed X plain Y ratio R guided_tpot_ms Z mask_ms p50 A p99 B

(R = X / Y; issue 45's bar is R <= 1.1.) ``mask_ms``: the server's
``hypertron_structured_mask_seconds`` (per step with guided rows) over the mixed runs, its
quantiles interpolated within the histogram's buckets. ``--peer vllm --vllm-python PATH``: then the
same runs against vLLM's server on the same model (its own structured-output backend, float32, as
many sequences, prefix caching off), printed as ``vllm guided ...`` without the mask times (vLLM
exports none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_http_prefix import settle  # bench/serve_http_prefix.py, this directory
from serve_http_servers import Server, script  # bench/serve_http_servers.py, this directory
from serve_http_vllm import add_optional_peer, parse_optional_peer, vllm_env  # bench/, this directory
from serve_model import build_model, write_prompts  # bench/serve_model.py, this directory

from hypertron.launch.local import free_ports

# Twelve integers of up to three digits: closed and bounded, so a guided stream ends by itself after
# about as many tokens as --max-tokens' default (the random model writes long numbers).
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 12,
          "maxItems": 12}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--guided", type=int, default=4, help="streams of a mixed run that carry the schema")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmups", type=int, default=2, help="pairs of runs first, not reported (they compile)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--keep", default=None, help="work in this (new) directory and keep it")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    add_optional_peer(p, "the same runs against vLLM's structured outputs, after hypertron's")
    return parse_optional_peer(p, argv)


def alternate(base: str, prompts: dict, guided: set[int], args, hypertron: bool = True, measured=None) -> list[tuple]:
    """The mixed and plain runs, alternating, after ``--warmups`` pairs: per measured pair ``(unguided
    TPOT mixed, plain, their ratio, guided TPOT)`` in ms, printed as it comes (``hypertron``: each
    run waits for the server's background compiles first; ``measured`` is called before the first
    measured pair)."""
    pairs = []
    for i in range(args.warmups + args.repeats):
        if hypertron:
            settle(base)  # no compile left queued from the run before
        if i == args.warmups and measured is not None:
            measured()
        # The same prompts both ways, the order alternating so that drift falls on both alike.
        order = ("mixed", "plain") if i % 2 == 0 else ("plain", "mixed")
        got = {kind: asyncio.run(one_run(base, prompts[f"run{i}"], guided if kind == "mixed" else set(),
                                         args.max_tokens)) for kind in order}
        if i < args.warmups:
            continue  # compiles the shapes of both
        mixed = tpot_ms([s for k, s in enumerate(got["mixed"]) if k not in guided])
        plain = tpot_ms([s for k, s in enumerate(got["plain"]) if k not in guided])
        pairs.append((mixed, plain, mixed / plain, tpot_ms(got["mixed"], guided=True)))
        print(f"{'' if hypertron else 'vllm '}run {i}: unguided_tpot_ms mixed {mixed:.2f} plain {plain:.2f} ratio "
              f"{mixed / plain:.3f} guided_tpot_ms {pairs[-1][3]:.2f}", flush=True)
    return pairs


async def one_run(base_url: str, prompts: list[str], guided: set[int], max_tokens: int) -> list[dict]:
    """Every stream's token count and first and last token times (and whether it was guided)."""
    async def stream(http, i, prompt):
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        if i in guided:
            body["structured_outputs"] = {"json": SCHEMA}
        times, tokens = [], 0
        async with http.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    times.append(time.perf_counter())
        return {"guided": i in guided, "tokens": tokens, "first": times[0], "last": times[-1]}

    async with httpx.AsyncClient(timeout=600) as http:
        return await asyncio.gather(*(stream(http, i, p) for i, p in enumerate(prompts)))


def tpot_ms(streams: list[dict], guided: bool | None = None) -> float:
    picked = [s for s in streams if (guided is None or s["guided"] == guided) and s["tokens"] > 1]
    return 1e3 * float(np.mean([(s["last"] - s["first"]) / (s["tokens"] - 1) for s in picked]))


def histogram(base_url: str, name: str) -> tuple[list[float], list[float]]:
    """A Prometheus histogram's bucket bounds and cumulative counts from ``/metrics``."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found = re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)
    return [float(le) for le, _ in found], [float(c) for _, c in found]


def quantile(bounds: list[float], counts: list[float], q: float) -> float:
    """The ``q`` quantile, linear within its bucket (as PromQL's histogram_quantile)."""
    total = counts[-1]
    if not total:
        return float("nan")
    rank, below, low = q * total, 0.0, 0.0
    for le, c in zip(bounds, counts):
        if c >= rank:
            return le if not np.isfinite(le) else low + (le - low) * (rank - below) / max(c - below, 1e-12)
        below, low = c, le
    return bounds[-1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not 0 < args.guided < args.streams:
        raise SystemExit("error: --guided must be between 1 and --streams - 1")
    work = args.keep or tempfile.mkdtemp(prefix="serve_guided_")
    os.makedirs(work, exist_ok=args.keep is None)
    hf_dir, run_dir = os.path.join(work, "hf"), os.path.join(work, "run")
    build_model(hf_dir, args.vocab)
    subprocess.run([script("hypertron"), "convert", "--from-hf", hf_dir, "--out", run_dir], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = {f"run{i}": args.streams for i in range(args.warmups + args.repeats)}
    paths = write_prompts(hf_dir, work, runs, args.input_len)
    prompts = {name: [json.loads(line)["prompt"] for line in open(path, encoding="utf-8")]
               for name, path in paths.items()}
    port = free_ports()
    pages = args.streams * -(-(args.input_len + 1 + args.max_tokens + 16) // 16) + 1
    argv_serve = [script("hypertron"), "serve", "--checkpoint", run_dir, "--port", str(port), "--max-slots",
                  str(args.streams), "--page-size", "16", "--num-pages", str(pages), "--kv-cache-dtype", "float32",
                  "--model-name", "bench", "--no-enable-prefix-caching"]  # the same prompts go twice
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    guided = set(range(0, args.streams, args.streams // args.guided))
    guided = set(sorted(guided)[:args.guided])
    with Server("hypertron", argv_serve, port, os.path.join(work, "server.log"), env) as server, \
            server.tail_on_error():
        server.wait_ready(args.ready_timeout)
        before = []
        pairs = alternate(server.base_url, prompts, guided, args, measured=lambda: before.extend(
            histogram(server.base_url, "hypertron_structured_mask_seconds")[1]))
        bounds, after = histogram(server.base_url, "hypertron_structured_mask_seconds")
    counts = [a - b for a, b in zip(after, before)]
    p50, p99 = (1e3 * quantile(bounds, counts, q) for q in (0.5, 0.99))
    mixed, plain, ratio, slow = (float(np.median(v)) for v in zip(*pairs))
    print(f"guided c{args.streams} g{args.guided}: unguided_tpot_ms mixed {mixed:.2f} plain {plain:.2f} ratio "
          f"{ratio:.3f} guided_tpot_ms {slow:.2f} mask_ms p50 {p50:.3f} p99 {p99:.3f}")
    if args.peer == "vllm":  # after hypertron's server stopped; vLLM's own structured-output backend
        port = free_ports()
        argv_vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
                     "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                     "--max-num-seqs", str(args.streams), "--block-size", "32", "--no-enable-prefix-caching"]
        with Server("vllm", argv_vllm, port, os.path.join(work, "vllm.log"),
                    vllm_env(env, args.vllm_python, "cpu")) as server, server.tail_on_error():
            server.wait_ready(max(args.ready_timeout, 900))
            pairs = alternate(server.base_url, prompts, guided, args, hypertron=False)
        mixed, plain, ratio, slow = (float(np.median(v)) for v in zip(*pairs))
        print(f"vllm guided c{args.streams} g{args.guided}: unguided_tpot_ms mixed {mixed:.2f} plain {plain:.2f} "
              f"ratio {ratio:.3f} guided_tpot_ms {slow:.2f}")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
