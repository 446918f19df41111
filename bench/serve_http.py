"""Serving over HTTP: ``hypertron bench serve`` against ``hypertron serve`` and ``transformers serve``, one model.

    pip install -e ".[serve-bench]"   # the peer: torch (CPU), transformers, accelerate, openai
    python bench/serve_http.py [--concurrency 1 4 16 64] [--num-requests 32] [--repeats 3] [--max-tokens 64]
                               [--input-len 128] [--max-num-batched-tokens 512] [--warmup-requests N]
                               [--device cpu|cuda] [--no-continuous-batching] [--no-interference]
                               [--streams 8] [--stream-tokens 384] [--long-prompts 8] [--long-len 2000]
                               [--long-interval 0.3] [--peer-pythonpath DIR] [--keep DIR] [--output FILE]

One model, written once in Hugging Face format into a temporary directory, nothing downloaded:

- tokenizer: byte-level BPE trained with ``tokenizers`` on the standard library's top-level
  ``*.py`` files (vocab 2,048, specials ``<pad>`` ``<s>`` ``</s>``), with a post-processor that
  puts ``<s>`` first, saved as ``tokenizer.json`` + ``tokenizer_config.json``
  (``PreTrainedTokenizerFast.save_pretrained``). transformers' ``tokenizer(prompt)`` then gives
  ``<s>`` + the ids, as hypertron's server does for a text prompt (BOS + ``encode``); the two
  reports' ``usage.prompt_tokens`` totals are compared to show it.
- weights: ``LlamaForCausalLM`` with random weights (``torch.manual_seed(0)``): hidden 256,
  4 layers, 8 heads / 4 KV heads (head_dim 32), MLP 768, max_position_embeddings 4,096,
  untied, float32 (4.2M parameters; ``--model-size llama-1b``: that preset's, bf16), safetensors.
  The ``lm_head`` rows of the special tokens (EOS among them) and the byte tokens that are not whole
  UTF-8 are zeroed: their logits are 0 against ~1,900 random ones, greedy never picks them. Every
  request then generates exactly ``--max-tokens`` tokens on both servers (checked from the
  reports' ``usage.completion_tokens``), which replaces ``--ignore-eos`` (transformers' server
  answers HTTP 422 to fields outside OpenAI's schema); and every token is text of its own, so both
  servers stream text from the first token on (the load generator's TTFT is the first chunk
  with text: a random model repeating a lone UTF-8 continuation byte streams none, and its TTFT
  would be the end of the request on one server and missing on the other).
- ``hypertron convert --from-hf`` makes hypertron's model bundle (it copies the tokenizer).

Prompts: text cut from the standard library's sources at seeded random offsets, each
``--input-len`` tokens of the tokenizer (cut at a token boundary; re-encoding may differ by a
token or so), plus BOS. Every run (the warm-up and each concurrency) gets its own prompts, so no
prompt is sent twice to a server (both may share KV pages between prompts with a common prefix);
the two servers get the same runs. ``--workload [--peer vllm]``: prefix caching on and off (bench/serve_http_prefix.py).

Per server, in turn: start it on 127.0.0.1 on a free port (its own process group, stopped with
SIGTERM, then SIGKILL, in a ``finally``), wait for ``GET /health`` = 200, send the warm-up
(``--warmup-requests`` at the largest concurrency; compiles and the continuous-batching manager
start there; not reported; default twice the largest concurrency), one non-streaming greedy
request for the first prompt (its text is compared between the servers, to show they run the same
model), then for each concurrency C a warm-up run of 2 N requests (not reported: hypertron compiles the
step shapes each load meets often, in the background, and a compile takes one of this machine's two cores
for about a second; the figures are of the server in its steady state), for hypertron up to 4 more of N
while the last one compiled anything (its ``/metrics`` count), and ``--repeats`` runs of
``hypertron bench serve --prompts FILE --concurrency C --num-requests N --max-tokens M --temperature 0
--model NAME --output JSON`` (N = max(--num-requests, 2 C), new
prompts each run): streaming ``/v1/completions``, C requests in flight, TTFT = first text chunk -
send, TPOT = (end to end - TTFT) / (tokens - 1), throughput over the run (see
``hypertron/loadgen.py``). The tables show each figure's median over the runs, and every run's
output tokens/s. hypertron keeps compiled steps in its compile cache, vLLM in ``~/.cache/vllm``: a first run compiles more.

Both servers get the same batch and pool: ``--max-num-batched-tokens`` tokens per step
(``--cb-max-batch-tokens`` for transformers) and 16-token pages enough for every slot's prompt
and output (max(C) x ceil((input + 1 + max_tokens + 16) / 16)).

- hypertron: ``hypertron serve --max-slots max(C) --page-size 16 --kv-cache-dtype float32
  --num-pages P --max-num-batched-tokens B`` (``float32`` on CPU, where compute is float32;
  ``bfloat16`` with ``--device cuda``), JAX on the device asked for.
- transformers: ``transformers serve HF_DIR --continuous-batching --cb-block-size 16
  --cb-num-blocks P --cb-max-batch-tokens B --device cpu --dtype float32``
  (``--no-continuous-batching``: one ``generate`` at a time; left alone its pool takes 90% of
  the free RAM on CPU), torch's default thread count,
  an empty ``HF_HUB_CACHE`` (its ``GET /v1/models`` lists that cache and answers 500 when there is
  none). It needs ``transformers[serving]`` (fastapi, uvicorn, pydantic, openai, accelerate); the
  script looks them up first, in the server's environment, and stops with one line (exit status 2)
  if any is missing. ``--peer-pythonpath DIR`` adds a directory holding them (e.g. ``accelerate``
  installed with ``pip install --no-deps --target DIR``) to the server's ``PYTHONPATH``.

Interference (hypertron only; ``--no-interference`` skips it): ``--streams`` streaming requests
of ``--stream-tokens`` tokens each decode; once all have their first token, ``--long-prompts``
prompts of ``--long-len`` tokens arrive, one every ``--long-interval`` s (4 tokens each). The
figure is the streams' inter-token gaps from the first long prompt on (p50, p99, max), median of
``--repeats`` runs after two warm-up runs (they compile the steps' shapes), for two servers: at
``--max-num-batched-tokens`` (a long prompt is prefilled in chunks while the streams decode) and at
4,096 (each long prompt whole, in one step).

The servers and the load generator share the machine. Prints one table per concurrency
(request throughput, output tokens/s, TTFT / TPOT mean p50 p99, end to end p50 p99, errors),
then the checks (hypertron's loop by phase in each concurrency's measured runs, from its
``/metrics``), the device, versions and command lines; ``--output``: all of it, reports too, as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import TextIO

import httpx
import numpy as np

from hypertron.launch.local import free_ports

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_model import MAX_SEQ_LEN, add_model_args, build_model, write_prompts  # bench/serve_model.py, this directory
from serve_http_prefix import add_workload_args, run_workloads  # bench/serve_http_prefix.py, this directory
from serve_http_vllm import check_peer  # bench/serve_http_vllm.py, this directory
from serve_http_servers import (Server, bench, breakdown_line, compile_counts, counts_since,  # bench/, here
                                greedy_text, missing_serve_deps, script, step_breakdown, step_times)

SERVERS = ("hypertron", "transformers")
# hypertron, per concurrency: after the warm-up run of 2 N requests, up to this many more of N while
# the last one compiled a step shape (the figures are of a server in its steady state).
EXTRA_WARMUPS = 4


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(c: int, reports: dict[str, dict], args, num: int) -> None:
    names = [n for n in SERVERS if n in reports]
    print(f"\nconcurrency {c}: {num} requests a run, max_tokens {args.max_tokens}, ~{args.input_len + 1}-token "
          f"prompts; medians of {args.repeats} runs")
    print(f"{'':<24}" + "".join(f"{n:>14}" for n in names) + (f"{'hyp / hf':>10}" if len(names) == 2 else ""))
    rows = [("requests/s", lambda r: r["request_throughput"], ".2f"),
            ("output tokens/s", lambda r: r["output_throughput"], ".1f")]
    for metric, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms")):
        for q in ("mean", "p50", "p99"):
            rows.append((f"{metric} {q} (ms)", lambda r, key=key, q=q: r[key][q], ".1f"))
    for q in ("p50", "p99"):
        rows.append((f"end to end {q} (ms)", lambda r, q=q: r["e2e_latency_ms"][q], ".1f"))
    for label, get, spec in rows:
        vals = [get(reports[n]) for n in names]
        ratio = f"{vals[0] / vals[1]:>10.2f}" if len(vals) == 2 and None not in vals and vals[1] else ""
        print(f"{label:<24}" + "".join(f"{fmt(v, spec):>14}" for v in vals) + ratio)
    print(f"{'runs output tokens/s':<24}" + "".join(
        f"{'/'.join(f'{v:.0f}' for v in reports[n]['runs_output_throughput']):>14}" for n in names))
    errs = [", ".join(f"{k} x{v}" for k, v in reports[n]["errors"].items()) or "0" for n in names]
    print(f"{'errors':<24}" + "".join(f"{e:>14}" for e in errs))
    for n in names:
        if reports[n]["first_error"]:
            print(f"  {n} first error: {reports[n]['first_error']}")


def median_report(reports: list[dict]) -> dict:
    """Several runs' reports as one: each figure the median over the runs (token totals and error
    counts summed); ``runs_output_throughput`` lists every run's output tokens/s."""
    def merge(values: list):
        if isinstance(values[0], dict):
            return {k: merge([v.get(k) for v in values]) for k in values[0]}
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            return float(np.median(values))
        return next((v for v in values if v is not None), None)

    out = merge([{k: v for k, v in r.items() if k != "requests"} for r in reports])
    for key in ("total_input_tokens", "total_output_tokens", "completed", "failed"):
        out[key] = sum(r[key] for r in reports)
    out["errors"] = {k: sum(r["errors"].get(k, 0) for r in reports) for r in reports for k in r["errors"]}
    out["runs_output_throughput"] = [r["output_throughput"] for r in reports]
    return out


async def _interference_run(base_url: str, model: str, streams: list[str], longs: list[str], stream_tokens: int,
                            interval: float) -> dict:
    """``streams`` decode (streaming, ``stream_tokens`` each); once every one has its first token, the
    ``longs`` prompts arrive one every ``interval`` s (4 tokens each). Returns the gaps between the
    streams' tokens from the first long prompt on (ms) and the long prompts' latencies (ms)."""
    import asyncio

    gaps, t_first_long = [], None
    started = asyncio.Event()
    ready = 0

    async def stream(http, prompt):
        nonlocal ready
        body = {"model": model, "prompt": prompt, "max_tokens": stream_tokens, "temperature": 0, "stream": True}
        last = None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is None:
                    ready += 1
                    if ready == len(streams):
                        started.set()
                elif t_first_long is not None and now >= t_first_long:
                    gaps.append((now - last) * 1e3)
                last = now

    async def long_prompt(http, prompt, delay):
        await asyncio.sleep(delay)
        t0 = time.perf_counter()
        r = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                                      "temperature": 0})
        r.raise_for_status()
        return (time.perf_counter() - t0) * 1e3

    async def longs_after_start(http):
        nonlocal t_first_long
        await started.wait()
        t_first_long = time.perf_counter()
        return await asyncio.gather(*(long_prompt(http, p, i * interval) for i, p in enumerate(longs)))

    limits = httpx.Limits(max_connections=len(streams) + len(longs) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        *_, latencies = await asyncio.gather(*(stream(http, p) for p in streams), longs_after_start(http))
    return {"gaps_ms": gaps, "long_latency_ms": list(latencies)}


def interference(base_url: str, model: str, prompts: dict[str, str], args, repeats: int) -> dict:
    """The interference workload ``repeats`` times (after one warm-up run): p50 / p99 / max of the
    streams' token gaps, and the long prompts' mean latency, each the median over the runs."""
    import asyncio

    def read(name):
        with open(prompts[name], encoding="utf-8") as f:
            return [json.loads(line)["prompt"] for line in f]

    runs, before = [], {}
    for rep_i in range(repeats + 2):
        if rep_i == 2:
            before = compile_counts(base_url)
        r = asyncio.run(_interference_run(base_url, model, read(f"streams{rep_i}"), read(f"longs{rep_i}"),
                                          args.stream_tokens, args.long_interval))
        if rep_i >= 2:  # the first two are a warm-up (they compile the steps' shapes)
            g = np.asarray(r["gaps_ms"])
            runs.append({"itl_p50": float(np.percentile(g, 50)), "itl_p99": float(np.percentile(g, 99)),
                         "itl_max": float(g.max()), "gaps": len(g),
                         "long_latency_mean": float(np.mean(r["long_latency_ms"]))})
    return ({k: float(np.median([r[k] for r in runs])) for k in runs[0]}
            | {"runs": runs, "compiles": counts_since(before, compile_counts(base_url))})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (``None``: ``sys.argv``), its counts checked positive."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--num-requests", type=int, default=32, help="per concurrency C and run (at least 2 C)")
    p.add_argument("--repeats", type=int, default=3, help="runs per concurrency; the tables show medians")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="both servers' tokens per step (--cb-max-batch-tokens for transformers)")
    p.add_argument("--no-interference", action="store_true", help="skip the long-prompt interference workload")
    p.add_argument("--streams", type=int, default=8, help="interference: decode streams")
    p.add_argument("--stream-tokens", type=int, default=384, help="interference: tokens per stream")
    p.add_argument("--long-prompts", type=int, default=8, help="interference: long prompts per run")
    p.add_argument("--long-len", type=int, default=2000, help="interference and --workload long: tokens per long prompt")
    p.add_argument("--long-interval", type=float, default=0.3, help="interference: seconds between long prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens, before BOS")
    p.add_argument("--warmup-requests", type=int, default=None, help="default: twice the largest concurrency")
    add_model_args(p)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--no-continuous-batching", action="store_true", help="transformers serve without it")
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--peer-pythonpath", default=None, help="prepended to transformers serve's PYTHONPATH "
                   "(a directory holding accelerate, if this environment lacks it)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--hypertron-args", default="", help="more flags for hypertron serve, one string "
                   "(e.g. \"--max-prefill-rows 1\"); the interference servers get them too")
    p.add_argument("--keep", default=None, help="work in this (new) directory and keep it (default: a temp dir)")
    p.add_argument("--output", default=None, help="write the results as JSON")
    add_workload_args(p)  # and the peer's
    args = check_peer(p.parse_args(argv))
    if min(args.concurrency + [args.num_requests, args.max_tokens, args.input_len, args.repeats]) <= 0:
        p.error("--concurrency, --num-requests, --max-tokens, --input-len and --repeats must be positive")
    return args


def peer_deps(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """When transformers serve is measured: the modules it lacks (named in one line on stderr) and its
    ``accelerate`` version; ``([], None)`` when it is not."""
    if "transformers" not in args.servers:
        return [], None
    missing, accelerate = missing_serve_deps(args.peer_pythonpath)
    if missing:
        print(f"error: transformers serve needs {', '.join(missing)}: pip install -e '.[serve-bench]' (or "
              f"pip install {' '.join(missing)}, or --peer-pythonpath DIR holding them)", file=sys.stderr)
    else:
        script("transformers")
    return missing, accelerate


def versions_of(accelerate: str | None) -> dict[str, str | None]:
    """The versions the report names (this imports torch and transformers)."""
    import torch
    import transformers

    return {"python": platform.python_version(), "jax": version("jax"), "torch": torch.__version__,
            "transformers": transformers.__version__, "accelerate": accelerate}


def command_line(argv: list[str]) -> str:
    """A server's command line as the report shows it: the program's name without its directory."""
    return " ".join([os.path.basename(argv[0]), *argv[1:]])


@dataclass
class Setup:
    """What the measurements and the report share: the arguments, the work directory with the model
    (Hugging Face's in ``hf_dir``, hypertron's in ``run_dir``) and every run's prompts, the servers'
    environments, their page pool and their command lines."""

    args: argparse.Namespace
    t_start: float
    work: str
    hf_dir: str
    run_dir: str
    banned: int                   # lm_head rows zeroed
    prompts: dict[str, str]       # run name -> prompts file
    probe: str                    # the first warm-up prompt (its greedy text is compared)
    warmup: int                   # requests of the warm-up run
    n_requests: dict[int, int]    # concurrency -> requests per run
    env: dict                     # hypertron serve's environment
    peer_env: dict                # transformers serve's
    kv: str                       # hypertron's --kv-cache-dtype
    dtype: str                    # transformers' --dtype
    pages: int                    # 16-token pages for every slot's prompt and output
    cb: list[str]                 # transformers' continuous-batching flags (none without it)

    @property
    def max_c(self) -> int:
        return max(self.args.concurrency)

    def hypertron_argv(self, port: int, slots: int, num_pages: int | None, budget: int) -> list[str]:
        return [script("hypertron"), "serve", "--checkpoint", self.run_dir, "--port", str(port), "--max-slots",
                str(slots), "--page-size", "16", "--kv-cache-dtype", self.kv, "--model-name", "bench",
                "--max-num-batched-tokens", str(budget),
                *([] if num_pages is None else ["--num-pages", str(num_pages)]),
                *shlex.split(self.args.hypertron_args)]

    def server_argv(self, name: str, port: int) -> tuple[list[str], str, dict]:
        """A measured server's command line, the model name it answers to, and its environment."""
        args = self.args
        if name == "hypertron":
            budget = max(args.max_num_batched_tokens, self.max_c)
            return self.hypertron_argv(port, self.max_c, self.pages + 1, budget), "bench", self.env
        return ([script("transformers"), "serve", self.hf_dir, *self.cb, "--device", args.device, "--dtype",
                 self.dtype, "--host", "127.0.0.1", "--port", str(port)], self.hf_dir, self.peer_env)


def run_sizes(args: argparse.Namespace, warmup: int) -> tuple[dict[int, int], dict]:
    """Requests per run at each concurrency, and every run's prompt count (for ``write_prompts``)."""
    n_requests = {c: max(args.num_requests, 2 * c) for c in args.concurrency}
    runs = {"warmup": warmup, **{f"c{c}{r}": n_requests[c] * (2 if r == "w" else 1) for c in args.concurrency
                                 for r in ["w", *(f"x{k}" for k in range(EXTRA_WARMUPS)),
                                           *(f"r{i}" for i in range(args.repeats))]}}
    if not args.no_interference:
        for i in range(args.repeats + 2):
            runs |= {f"streams{i}": args.streams, f"longs{i}": (args.long_prompts, args.long_len)}
    return n_requests, runs


def prepare(args: argparse.Namespace) -> Setup:
    """Writes the model (both formats) and the prompts into the work directory; the servers' settings."""
    t_start = time.perf_counter()
    work = args.keep or tempfile.mkdtemp(prefix="serve_http_")
    os.makedirs(work, exist_ok=bool(args.keep is None))
    hf_dir, run_dir = os.path.join(work, "hf"), os.path.join(work, "run")
    banned = build_model(hf_dir, args.vocab, args.model_size)
    convert = [script("hypertron"), "convert", "--from-hf", hf_dir, "--out", run_dir]
    subprocess.run(convert, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    max_c = max(args.concurrency)
    warmup = args.warmup_requests or 2 * max_c
    n_requests, runs = run_sizes(args, warmup)
    prompts = write_prompts(hf_dir, work, runs, args.input_len)
    with open(prompts["warmup"], encoding="utf-8") as f:
        probe = json.loads(f.readline())["prompt"]
    print(f"model and prompts ready in {time.perf_counter() - t_start:.1f} s ({work})", file=sys.stderr)

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    kv, dtype = ("float32", "float32") if args.device == "cpu" else ("bfloat16", "bfloat16")
    # GET /v1/models of transformers serve lists the Hugging Face cache and fails (500, and a dropped
    # keep-alive connection) when there is none; an empty one makes it answer an empty list.
    peer_env = {**env, "HF_HUB_CACHE": os.path.join(work, "hf-cache")}
    os.makedirs(peer_env["HF_HUB_CACHE"], exist_ok=True)
    if args.peer_pythonpath:
        peer_env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.peer_pythonpath, env.get("PYTHONPATH")]))
    # transformers' continuous batching sizes its KV cache to 90% of free memory (of the RAM, on CPU:
    # tens of GB, zero-filled on the first request); it gets hypertron's pool instead: 16-token pages,
    # every slot at max_seq_len.
    # Both servers get the same pool, 16-token pages enough for every slot's prompt and output, and
    # the same tokens per step.
    pages = max_c * -(-(args.input_len + 1 + args.max_tokens + 16) // 16)
    pool = ["--cb-block-size", "16", "--cb-num-blocks", str(pages),
            "--cb-max-batch-tokens", str(args.max_num_batched_tokens)]
    cb = [] if args.no_continuous_batching else ["--continuous-batching", *pool]
    return Setup(args=args, t_start=t_start, work=work, hf_dir=hf_dir, run_dir=run_dir, banned=banned,
                 prompts=prompts, probe=probe, warmup=warmup, n_requests=n_requests, env=env, peer_env=peer_env,
                 kv=kv, dtype=dtype, pages=pages, cb=cb)


@dataclass
class Measured:
    """Every figure of the report, filled server by server."""

    results: dict[str, dict[int, dict]] = field(default_factory=dict)  # server -> concurrency -> medians
    texts: dict[str, str] = field(default_factory=dict)                # server -> greedy text of the probe
    commands: dict[str, str] = field(default_factory=dict)             # server -> its command line
    ready_s: dict[str, float] = field(default_factory=dict)
    interference: dict[str, dict] = field(default_factory=dict)        # "chunked" / "whole" -> figures


@dataclass
class Target:
    """A measured server while it runs: ``bench`` sends it one load, the report and log in the work directory."""

    setup: Setup
    name: str
    base_url: str
    model: str
    log: TextIO

    def bench(self, run: str, concurrency: int, num: int, out: str) -> dict:
        """The load of prompts ``run``; its report is kept as ``{name}-{out}.json``."""
        s = self.setup
        return bench(self.base_url, self.model, s.prompts[run], concurrency, num, s.args.max_tokens,
                     os.path.join(s.work, f"{self.name}-{out}.json"), self.log)


def extra_warmups(t: Target, c: int, before: dict[str, float]) -> int:
    """hypertron: more warm-up runs of N at concurrency ``c`` while the last one compiled something
    (``before``: the compile counts before it), at most ``EXTRA_WARMUPS``; how many ran."""
    extra = 0
    while True:
        k = counts_since(before, after := compile_counts(t.base_url))
        if k["sync"] + k["background"] == 0 or extra == EXTRA_WARMUPS:
            return extra
        before = after
        t.bench(f"c{c}x{extra}", c, t.setup.n_requests[c], f"c{c}-warmup{extra + 1}")
        extra += 1


def measure_concurrency(t: Target, c: int) -> dict:
    """The warm-up runs at concurrency ``c``, then the median report of ``--repeats`` runs (hypertron's
    with the compiles during them and the extra warm-ups before)."""
    n, hyp = t.setup.n_requests[c], t.name == "hypertron"
    t0 = time.perf_counter()
    before = compile_counts(t.base_url) if hyp else {}
    t.bench(f"c{c}w", c, 2 * n, f"c{c}-warmup")  # this load's step shapes
    extra = extra_warmups(t, c, before) if hyp else 0
    before, steps = (compile_counts(t.base_url), step_times(t.base_url)) if hyp else ({}, {})
    report = median_report([t.bench(f"c{c}r{i}", c, n, f"c{c}-r{i}") for i in range(t.setup.args.repeats)])
    if hyp:
        report |= {"compiles": counts_since(before, compile_counts(t.base_url)), "extra_warmups": extra,
                   "step_breakdown": step_breakdown(steps, step_times(t.base_url))}
    print(f"  ... {t.name} concurrency {c}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return report


def measure_server(s: Setup, name: str, m: Measured) -> None:
    """One server: started, warmed up, its greedy text of the probe, then each concurrency."""
    args = s.args
    port = free_ports()
    argv_s, model, senv = s.server_argv(name, port)
    m.commands[name] = command_line(argv_s)
    with Server(name, argv_s, port, os.path.join(s.work, f"{name}.log"), senv) as srv, \
            open(os.path.join(s.work, f"{name}-bench.log"), "w") as log:
        m.ready_s[name] = srv.wait_ready(args.ready_timeout)
        print(f"{name}: ready in {m.ready_s[name]:.1f} s; warm-up ...", file=sys.stderr)
        with srv.tail_on_error():
            t = Target(s, name, srv.base_url, model, log)
            t.bench("warmup", s.max_c, s.warmup, "warmup")
            m.texts[name] = greedy_text(srv.base_url, model, s.probe, args.max_tokens)
            m.results[name] = {}
            for c in args.concurrency:
                m.results[name][c] = measure_concurrency(t, c)


def measure_interference(s: Setup, m: Measured) -> None:
    """The interference workload, hypertron only, into ``m.interference``: at ``--max-num-batched-tokens``
    (chunked prefill) and at ``MAX_SEQ_LEN``, a budget that takes a whole long prompt in a step (no chunking)."""
    args = s.args
    if args.no_interference or "hypertron" not in args.servers:
        return
    slots = args.streams + args.long_prompts
    for label, budget in (("chunked", args.max_num_batched_tokens), ("whole", MAX_SEQ_LEN)):
        port = free_ports()
        argv_s = s.hypertron_argv(port, slots, None, budget)
        m.commands[f"hypertron interference, {label}"] = command_line(argv_s)
        with Server("hypertron", argv_s, port, os.path.join(s.work, f"interference-{label}.log"), s.env) as srv:
            srv.wait_ready(args.ready_timeout)
            t0 = time.perf_counter()
            with srv.tail_on_error():
                m.interference[label] = interference(srv.base_url, "bench", s.prompts, args, args.repeats)
            print(f"  ... interference, {label} prefill: {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def print_interference(chunked: dict[str, dict], args: argparse.Namespace) -> None:
    """The interference table (nothing when it was not measured)."""
    if not chunked:
        return
    print(f"\ninterference: {args.streams} streams of {args.stream_tokens} tokens, then {args.long_prompts} "
          f"prompts of {args.long_len} tokens one every {args.long_interval} s (hypertron; medians of "
          f"{args.repeats} runs; the streams' token gaps from the first long prompt on, ms)")
    print(f"{'prefill':<34}{'ITL p50':>10}{'ITL p99':>10}{'ITL max':>10}{'long e2e':>10}")
    for label, r in chunked.items():
        name = (f"chunked (budget {args.max_num_batched_tokens})" if label == "chunked"
                else f"whole prompts (budget {MAX_SEQ_LEN})")
        print(f"{name:<34}{r['itl_p50']:>10.1f}{r['itl_p99']:>10.1f}{r['itl_max']:>10.1f}"
              f"{r['long_latency_mean']:>10.1f}")
    if len(chunked) == 2:
        print(f"ITL p99 chunked / whole: {chunked['chunked']['itl_p99'] / chunked['whole']['itl_p99']:.2f}")


def print_checks(s: Setup, m: Measured) -> None:
    """The compiles during the measured runs, the token totals, and whether the greedy texts agree."""
    args, results = s.args, m.results
    for c in args.concurrency:
        if "compiles" in results.get("hypertron", {}).get(c, {}):
            k = results["hypertron"][c]["compiles"]
            print(f"concurrency {c}: hypertron's measured runs (after {results['hypertron'][c]['extra_warmups']} "
                  f"more warm-up runs): {k['sync']} compiles waited for, {k['background']} in the background, "
                  f"{k['padded']} steps run padded\nconcurrency {c}: "
                  + breakdown_line(results["hypertron"][c]["step_breakdown"]))
    for label, r in m.interference.items():
        k = r.get("compiles", {})
        print(f"interference, {label}: measured runs: {k.get('sync', 0)} compiles waited for, "
              f"{k.get('background', 0)} in the background, {k.get('padded', 0)} steps run padded")
    for c in args.concurrency:
        want = s.n_requests[c] * args.max_tokens * args.repeats
        counts = {n: (results[n][c]["total_input_tokens"], results[n][c]["total_output_tokens"]) for n in results}
        print(f"concurrency {c}: input / output tokens " +
              ", ".join(f"{n} {i:,} / {o:,}" for n, (i, o) in counts.items()) + f" (output wanted {want:,})")
    if len(m.texts) == 2:
        a, b = m.texts.values()
        print(f"greedy completion of the first warm-up prompt: {'equal' if a == b else 'DIFFERENT'} "
              f"on both servers ({len(a)} vs {len(b)} characters)")


def print_settings(s: Setup, m: Measured, versions: dict, argv: list[str] | None) -> None:
    """The servers' settings and command lines, the device, the versions and this command."""
    import torch

    args, v = s.args, versions
    print(f"hypertron: --max-slots {s.max_c} --page-size 16 --kv-cache-dtype {s.kv} --num-pages {s.pages + 1} "
          f"--max-num-batched-tokens {max(args.max_num_batched_tokens, s.max_c)}; transformers: "
          f"{'continuous batching' if s.cb else 'no continuous batching'}, --dtype {s.dtype}, "
          f"torch {torch.get_num_threads()} threads (default); no ignore_eos: {s.banned} lm_head rows zeroed "
          f"(special tokens, EOS among them, and partial UTF-8 bytes)")
    print(f"device: {args.device} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
          + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    print(f"versions: python {v['python']}, jax {v['jax']}, torch {v['torch']}, transformers {v['transformers']}"
          + (f", accelerate {v['accelerate']} (transformers serve's)" if v["accelerate"] else ""))
    for name, cmd in m.commands.items():
        print(f"{name} server: {cmd.replace(s.work, '$WORK')}")
    print(f"load: hypertron bench serve --base-url URL --model NAME --prompts $WORK/prompts-cCrR.jsonl "
          f"--concurrency C --num-requests max({args.num_requests}, 2C) --max-tokens {args.max_tokens} "
          f"--temperature 0 --output JSON, {args.repeats} runs (R) per C")
    print(("command: python bench/serve_http.py " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip())


def write_output(path: str, s: Setup, m: Measured, versions: dict, elapsed: float) -> None:
    """Everything the tables show, with each server's full median reports, as JSON."""
    with open(path, "w") as f:
        json.dump({"args": vars(s.args), "commands": m.commands, "ready_s": m.ready_s, "greedy_texts": m.texts,
                   "elapsed_s": elapsed, "versions": versions,
                   "results": {n: {str(c): r for c, r in rs.items()} for n, rs in m.results.items()},
                   "interference": m.interference}, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workload:
        return run_workloads(args, prepare)
    missing, accelerate = peer_deps(args)
    if missing:
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped (finally)
    versions = versions_of(accelerate)
    s = prepare(args)
    m = Measured()
    for name in args.servers:
        measure_server(s, name, m)
    measure_interference(s, m)

    for c in args.concurrency:
        print_table(c, {n: m.results[n][c] for n in m.results}, args, s.n_requests[c])
    print_interference(m.interference, args)
    print()
    print_checks(s, m)
    print_settings(s, m, versions, argv)
    elapsed = time.perf_counter() - s.t_start
    print(f"total {elapsed:.0f} s")
    if args.output:
        write_output(args.output, s, m, versions, elapsed)
        print(f"wrote {args.output}")
    if args.keep is None:
        shutil.rmtree(s.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
