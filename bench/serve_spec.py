"""Speculative decoding on a workload that repeats itself: ``python bench/serve_spec.py``.

A code-edit corpus written from the standard library's top-level ``*.py`` files: each example is a
snippet (``--snippet`` bytes from a line's start), a marker line, and the snippet again with one
identifier upper-cased. ``tiny`` (the byte tokenizer) is trained on it (``--steps``, batch 32 x 128
bytes, a few minutes here; ``--keep DIR`` keeps the run, and a second call with the same ``--keep``
trains nothing). The snippets of files held out of training are the prompts (snippet and marker);
each asks for as many tokens as its snippet, greedy.

One ``hypertron serve`` per method (``off``, and each of ``--methods`` with ``--k``: ``ngram``, and
``draft`` with a ``tiny`` of ``--draft-layers`` layers trained the same way as its draft model), all
up at once and warmed up (their shapes compiled), then the same requests at each ``--concurrency``,
``--repeats`` runs each way, each method first in turn; prints the medians (the speedup's: the median
of the runs' ratios)::

    copy accuracy A (held-out snippets, greedy, speculation off)
    speculative METHOD cC: out_tok_s on A off B speedup S acceptance R tokens_per_step T

``acceptance``: proposed tokens kept over those proposed; ``tokens_per_step``: tokens a verify
row emits, 1 + kept over verify rows (both from the server's ``hypertron_spec_decode_*``
counters; docs/serving.md). Issue 45's bar: speedup at least 1.5 at concurrency 1. ``--peer vllm
--vllm-python PATH`` then serves the same runs with vLLM's own speculation, the same lines prefixed
``vllm`` (``bench/serve_spec_vllm.py``). Distinct
prompts (issue 45's other bar): ``bench/serve_http.py`` with and without ``--hypertron-args
"--speculative ngram"``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
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
from serve_http_servers import (Server, breakdown_line, compile_counts, counts_since, script, step_breakdown,
                                step_times)  # bench/serve_http_servers.py, this directory
from serve_model import stdlib_files  # bench/serve_model.py, this directory

import serve_spec_vllm  # bench/serve_spec_vllm.py, this directory
from serve_http_vllm import add_optional_peer, parse_optional_peer, vllm_env  # bench/, this directory

from hypertron.launch.local import free_ports

MARKER = "\n#>\n"
IDENTIFIER = re.compile(r"\b[a-z_][a-z0-9_]{2,}\b")
SPEC = "hypertron_spec_decode_"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="training steps")
    p.add_argument("--snippet", type=int, default=48, help="bytes per snippet")
    p.add_argument("--held-out", type=int, default=20, help="standard-library files kept out of training")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--num-requests", type=int, default=16, help="per concurrency and run")
    p.add_argument("--repeats", type=int, default=3, help="runs per concurrency and method (medians)")
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--methods", nargs="+", default=["ngram", "draft"], choices=["ngram", "draft"],
                   help="against off (draft: a one-layer tiny trained the same way, --draft-layers)")
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--keep", default=None, help="work in this directory and keep it (a trained run is reused)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    add_optional_peer(p, "vLLM's speculation on the same models, after hypertron's (bench/serve_spec_vllm.py)")
    return parse_optional_peer(p, argv)


def examples(files: list[str], size: int, rng: random.Random) -> list[tuple[str, str]]:
    """``(snippet, edited)`` pairs: snippets of ``size`` ASCII bytes from line starts, each with an
    identifier, and the snippet with that identifier upper-cased."""
    out = []
    for path in files:
        text = open(path, encoding="utf-8", errors="replace").read()
        starts = [m.start() for m in re.finditer(r"^\S", text, re.M)]
        for at in starts[::3]:
            snippet = text[at:at + size]
            if len(snippet) < size or not snippet.isascii() or MARKER.strip() in snippet:
                continue
            names = IDENTIFIER.findall(snippet)
            if names:
                name = rng.choice(names)
                out.append((snippet, re.sub(rf"\b{name}\b", name.upper(), snippet)))
    return out


def train(work: str, pairs: list[tuple[str, str]], steps: int, layers: int | None = None) -> str:
    """The run directory of ``tiny`` (``layers``: with that many layers, the draft model) trained on
    ``pairs`` (trained once per ``work``)."""
    name = "run" if layers is None else f"draft{layers}"
    run_dir = os.path.join(work, name)
    if os.path.isdir(run_dir):
        return run_dir
    corpus = os.path.join(work, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("".join(f"{s}{MARKER}{e}\n\n" for s, e in pairs))
    config = os.path.join(work, f"train-{name}.yaml")
    model = "tiny" if layers is None else f"{{preset: tiny, num_layers: {layers}}}"
    with open(config, "w", encoding="utf-8") as f:
        f.write(f"run_dir: {run_dir}\nmodel: {model}\ndata:\n  source: text\n  paths: [{corpus}]\n"
                f"train:\n  steps: {steps}\n  global_batch: 32\n  seq_len: 128\n  lr: 3.0e-3\n  warmup_steps: 20\n"
                f"  log_every: 50\ncheckpoint:\n  every: {steps}\n")
    start = time.perf_counter()
    subprocess.run([script("hypertron"), "train", config], check=True, stdout=subprocess.DEVNULL)
    print(f"trained {name}: {steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
    return run_dir


async def serve_all(base_url: str, prompts: list[tuple[str, int]], concurrency: int) -> tuple[list[str], int, float]:
    """Each prompt's text (greedy, its own max_tokens), the completion tokens, and the wall time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(http, prompt, n):
        async with gate:
            body = {"model": "bench", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            resp = await http.post(f"{base_url}/v1/completions", json=body)
            resp.raise_for_status()
            answer = resp.json()
            return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as http:
        start = time.perf_counter()
        got = await asyncio.gather(*(one(http, p, n) for p, n in prompts))
        return [t for t, _ in got], sum(n for _, n in got), time.perf_counter() - start


def measure_peer(base_url: str, prompts: list[tuple[str, int]], concurrency: int):
    """One run of a peer: as :func:`measure`, without hypertron's breakdown and compiles."""
    counts = serve_spec_vllm.spec_counts(base_url)
    texts, tokens, seconds = asyncio.run(serve_all(base_url, prompts, concurrency))
    return texts, tokens / seconds, [a - b for a, b in zip(serve_spec_vllm.spec_counts(base_url), counts)], "", {}


def serve_methods(named: dict[str, list[str]], name: str, work: str, env: dict, prompts, args, measure_fn) -> dict:
    """Each method's server (``named``: its command line, its port after ``--port``), all up and warmed
    up, then the same requests every way, each method first in turn, so that this machine's drift
    falls on each: ``{(method, c): [measure_fn's run, ...]}``."""
    runs, methods = {}, list(named)
    with contextlib.ExitStack() as stack:
        servers = {}
        for method, argv_serve in named.items():
            port = int(argv_serve[argv_serve.index("--port") + 1])
            server = stack.enter_context(Server(name, argv_serve, port, os.path.join(work, f"{name}-{method}.log"), env))
            stack.enter_context(server.tail_on_error())
            server.wait_ready(args.ready_timeout)
            asyncio.run(serve_all(server.base_url, prompts[:args.num_requests], max(args.concurrency)))  # warm-up
            servers[method] = server.base_url
        for r in range(args.repeats):
            for i, c in enumerate(args.concurrency):
                batch = prompts[(i + 1) * args.num_requests:(i + 2) * args.num_requests]
                for method in methods[r % len(methods):] + methods[:r % len(methods)]:
                    runs.setdefault((method, c), []).append(measure_fn(servers[method], batch, c))
    return runs


def report(runs: dict, methods, concurrency, prefix: str = "") -> None:
    """The speedup lines of ``runs`` (see the module docstring), each method against ``off``."""
    for c in concurrency:
        off = [run[1] for run in runs["off", c]]
        for m in methods:
            on = [run[1] for run in runs[m, c]]
            drafts, proposed, kept = np.sum([run[2] for run in runs[m, c]], axis=0)
            print(f"speculative {prefix}{m} c{c}: out_tok_s on {np.median(on):.1f} off {np.median(off):.1f} speedup "
                  f"{np.median(np.divide(on, off)):.2f} acceptance {kept / max(proposed, 1):.3f} tokens_per_step "
                  f"{1 + kept / max(drafts, 1):.2f}", flush=True)


def measure(base_url: str, prompts: list[tuple[str, int]], concurrency: int):
    """One run: ``(texts, output tokens/s, speculative counts, the loop's breakdown, compiles)``."""
    settle(base_url)
    counts, loop, compiles = spec_counts(base_url), step_times(base_url), compile_counts(base_url)
    texts, tokens, seconds = asyncio.run(serve_all(base_url, prompts, concurrency))
    return (texts, tokens / seconds, [a - b for a, b in zip(spec_counts(base_url), counts)],
            breakdown_line(step_breakdown(loop, step_times(base_url))),
            counts_since(compiles, compile_counts(base_url)))


def spec_counts(base_url: str) -> tuple[float, float, float]:
    """hypertron's speculative counters (verify rows, tokens proposed, kept); zeros with speculation off."""
    return serve_spec_vllm.spec_counts(base_url, SPEC)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.keep or tempfile.mkdtemp(prefix="serve_spec_")
    os.makedirs(work, exist_ok=True)
    files, rng = stdlib_files(), random.Random(0)
    held = set(rng.sample(range(len(files)), args.held_out))
    pairs = examples([f for i, f in enumerate(files) if i not in held], args.snippet, rng)
    run_dir = train(work, pairs, args.steps)
    draft_dir = train(work, pairs, args.steps, args.draft_layers) if "draft" in args.methods else None
    tests = examples([f for i, f in enumerate(files) if i in held], args.snippet, rng)
    rng.shuffle(tests)
    need = args.num_requests * (1 + len(args.concurrency))
    tests = (tests * -(-need // len(tests)))[:need]
    prompts = [(s + MARKER, len(e)) for s, e in tests]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    methods = ("off", *args.methods)
    first = free_ports(len(methods))
    named = {m: [script("hypertron"), "serve", "--checkpoint", run_dir, "--port", str(first + i), "--max-slots",
                 str(max(args.concurrency)), "--model-name", "bench", "--speculative", m, "--num-speculative-tokens",
                 str(args.k), "--no-enable-prefix-caching", *(["--draft-model", draft_dir] if m == "draft" else [])]
             for i, m in enumerate(methods)}
    runs = serve_methods(named, "hypertron", work, env, prompts, args, measure)
    texts = [runs["off", c][0][0] for c in args.concurrency]
    wanted = [[e for _, e in tests[(i + 1) * args.num_requests:(i + 2) * args.num_requests]]
              for i in range(len(args.concurrency))]
    same = sum(a == b for ts, es in zip(texts, wanted) for t, e in zip(ts, es) for a, b in zip(t, e))
    print(f"copy accuracy {same / sum(len(e) for es in wanted for e in es):.3f} (held-out snippets, greedy, "
          "speculation off)")
    for c in args.concurrency:
        assert all(run[0] == runs["off", c][0][0] for m in methods for run in runs[m, c]), "greedy text differs"
        for m in methods:
            print(f"{m} c{c}, last run: compiles {runs[m, c][-1][4]}; {runs[m, c][-1][3]}")
    report(runs, args.methods, args.concurrency)
    if args.peer == "vllm":  # after hypertron's servers stopped: each side has the machine to itself
        hf_dir = serve_spec_vllm.export(run_dir, os.path.join(work, "hf-run"))
        hf_draft = draft_dir and serve_spec_vllm.export(draft_dir, os.path.join(work, f"hf-draft{args.draft_layers}"))
        serve_spec_vllm.check_ids(hf_dir, [p for p, _ in prompts])
        first = free_ports(len(methods))
        named = {m: serve_spec_vllm.argv(args.vllm_python, hf_dir, first + i, m, args.k, max(args.concurrency),
                                         hf_draft) for i, m in enumerate(methods)}
        peer = serve_methods(named, "vllm", work, vllm_env(os.environ, args.vllm_python, "cpu"), prompts, args,
                             measure_peer)
        for c in args.concurrency:  # vLLM's greedy text against hypertron's (float32 both: near-ties may differ)
            same = sum(a == b for m in methods for run in peer[m, c] for a, b in zip(run[0], runs["off", c][0][0]))
            print(f"vllm c{c}: {same} of {len(methods) * args.repeats * args.num_requests} texts as hypertron's")
        report(peer, args.methods, args.concurrency, prefix="vllm ")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
