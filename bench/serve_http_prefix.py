"""Prefix caching over HTTP: ``bench/serve_http.py --workload shared-prefix distinct --prefix-caching on off``.

One model and one build (``bench/serve_http.py``'s), and one ``hypertron serve`` per setting
(``--enable-prefix-caching`` / ``--no-enable-prefix-caching``), started one after another (each
once the one before is ready: a server's start measures or compiles) and loaded in
turn (on, off, on, off, ...), so that the machine's drift falls on both alike, each run
``RUN_GAP_S`` after the one before. With ``--alone``, each system's servers run with no other
system's alive: hypertron's measured, stopped, then the peer's. Workloads:

- ``shared-prefix``: every prompt is one shared text of ``--prefix-len`` tokens (1,024) followed by
  a text of its own of ``--suffix-len`` tokens (64), BOS first;
- ``distinct``: prompts of ``--input-len`` tokens, none shared (``bench/serve_http.py``'s);
- ``long``: prompts of ``--long-len`` tokens (2,000), none shared: prefill throughput, ``in_tok_s``
  (the prompt tokens of a run over its duration; issue 49's long-prompt workload).

Per workload and concurrency C: a warm-up run of 2 N requests on each server (not reported: it
compiles the load's step shapes and, with caching, fills the cache as a server in its steady
state has it), then ``--repeats`` runs (``--repeats + 2`` for ``distinct``, whose difference is
small) of N = max(``--num-requests``, 2 C) requests each, new prompts each run (the same on both
servers; hypertron's then finish their queued compiles). Each figure is the median over the runs. The hit rate is the caching server's
``hypertron_prefix_cache_hits_total`` over ``hypertron_prefix_cache_queries_total`` (tokens)
during the measured runs; ``compiles`` S+B counts the step shapes hypertron compiled during them,
S while a step waited, B in the background (``hypertron_step_compiles_total``: a warm-up that missed
the load's shapes shows there). Prints per workload and concurrency, as soon as it
is measured::

    prefix-caching WORKLOAD cC: ttft_mean_ms on X off Y ratio R server_ttft_ms on X' off Y' hit_rate H out_tok_s on A off B in_tok_s on I off J compiles on S+B off S+B

(R = Y / X; X' and Y', hypertron's own mean TTFT, submit to the first token reaching the request's
event loop, from ``hypertron_time_to_first_token_seconds``: the client's rest is HTTP), and with ``--output`` writes every run's report as JSON. With ``--peer vllm``, vLLM's
server runs beside them with its prefix caching on and off, with the same slots, pool and tokens per
step (bench/serve_http_vllm.py), loaded in the same turns, and gets its own line per workload and
concurrency, ``prefix-caching vllm WORKLOAD cC: ...`` (its hit rate from its ``/metrics``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time

import httpx
import numpy as np

from hypertron.launch.local import free_ports

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_model import write_prompts  # bench/serve_model.py, this directory
from serve_http_servers import Server, bench, step_breakdown, step_times  # bench/serve_http_servers.py, this directory
from serve_http_vllm import (  # bench/serve_http_vllm.py, this directory
    COUNTERS, add_peer_args, vllm_argv, vllm_env, vllm_version,
)

WORKLOADS = ("shared-prefix", "distinct", "long")


def add_workload_args(p) -> None:
    """``bench/serve_http.py``'s flags of this mode, and the peer's (``check_peer`` checks them)."""
    p.add_argument("--workload", nargs="+", choices=WORKLOADS, default=None,
                   help="prefix caching's workloads instead of the servers' comparison (bench/serve_http_prefix.py)")
    p.add_argument("--prefix-caching", nargs="+", choices=["on", "off"], default=["on", "off"])
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: the shared prompt's tokens")
    p.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: each prompt's own tokens")
    p.add_argument("--alone", action="store_true",
                   help="measure each system's servers with no other system's alive (hypertron's, then the peer's)")
    add_peer_args(p)


def scrape(base_url: str) -> str:
    return httpx.get(f"{base_url}/metrics", timeout=10).text


def metric(text: str, name: str, labels: str = "") -> float:
    """The sum of ``name``'s samples in a ``/metrics`` page whose labels hold ``labels`` (``mode="sync"``)."""
    values = re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M)
    if not values:
        raise RuntimeError(f"/metrics has no {name}")
    return sum(float(v) for got, v in values if labels in got)


def counters(base_url: str, system: str) -> tuple[float, ...]:
    """``(queries, hits)`` of ``system``'s prefix cache, in tokens, then hypertron's step compiles
    a step waited for and those done in the background (0 for a peer), from ``/metrics``."""
    text = scrape(base_url)
    queries, hits = (metric(text, name) for name in COUNTERS[system])
    if system != "hypertron":
        return queries, hits, 0.0, 0.0
    return queries, hits, *(metric(text, "hypertron_step_compiles_total", f'mode="{m}"') for m in ("sync", "background"))


# Seconds between one measured run and the next (another server's, in turn): vLLM's CPU worker
# spins about a second after its last step (top: 43% of a core then, 1% after), on the cores the
# next run's server needs.
RUN_GAP_S = 2.0


def settle(base_url: str, limit_s: float = 180.0) -> None:
    """Wait until a hypertron server has no step shape queued for its background compiler
    (``hypertron_step_compiles_queued``: the shapes its last run kept, loading at its start, and
    those the warm-up met), at most ``limit_s``."""
    end = time.perf_counter() + limit_s
    while metric(scrape(base_url), "hypertron_step_compiles_queued") and time.perf_counter() < end:
        time.sleep(0.5)


def runs_of(args) -> dict[str, list[tuple[str, int]]]:
    """Per workload and concurrency (``"WORKLOAD cC"``): its runs' names and request counts, the
    warm-up first."""
    out = {}
    for workload in args.workload:
        repeats = args.repeats + (2 if workload == "distinct" else 0)
        for c in args.concurrency:
            n = max(args.num_requests, 2 * c)
            out[f"{workload} c{c}"] = [(f"{workload}-c{c}-w", 2 * n)] + [(f"{workload}-c{c}-r{i}", n)
                                                                        for i in range(repeats)]
    return out


def write_workload_prompts(hf_dir: str, work: str, args, runs: dict) -> dict[str, str]:
    """Every run's prompts file: shared-prefix runs are the one prefix + a suffix of their own."""
    lengths = {"shared-prefix": args.suffix_len, "distinct": args.input_len, "long": args.long_len}
    counts = {name: (n, lengths[name.rsplit("-c", 1)[0]]) for each in runs.values() for name, n in each}
    paths = write_prompts(hf_dir, work, {"prefix": (1, args.prefix_len), **counts}, args.input_len, seed=1)
    with open(paths.pop("prefix"), encoding="utf-8") as f:
        prefix = json.loads(f.readline())["prompt"]
    for name, path in paths.items():
        if name.startswith("shared"):
            with open(path, encoding="utf-8") as f:
                lines = [json.dumps({"prompt": prefix + json.loads(line)["prompt"]}) for line in f if line.strip()]
            with open(path, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    return paths


def measure(servers: dict[str, tuple[str, object]], paths: dict, runs: list[tuple[str, int]], c: int,
            args) -> dict:
    """One workload at concurrency ``c`` on every server (``"SYSTEM SETTING"`` -> its URL and log),
    loaded in turn; the medians."""
    name_w, n_w = runs[0]
    for key, (url, log) in servers.items():
        bench(url, "bench", paths[name_w], c, n_w, args.max_tokens, f"{log.name}.{name_w}.json", log)
    for key, (url, _) in servers.items():
        if key.startswith("hypertron"):
            settle(url)
    before = {key: counters(url, key.split()[0]) for key, (url, _) in servers.items()}
    steps = {key: step_times(url) for key, (url, _) in servers.items() if key.startswith("hypertron")}
    reports = {key: [] for key in servers}
    for name, n in runs[1:]:
        for key, (url, log) in servers.items():
            time.sleep(RUN_GAP_S)  # the server before goes idle first
            reports[key].append(bench(url, "bench", paths[name], c, n, args.max_tokens, f"{log.name}.{name}.json",
                                      log))
    out = {}
    for key, (url, _) in servers.items():
        q, h, sync, background = (a - b for a, b in zip(counters(url, key.split()[0]), before[key]))
        out[key] = {"ttft_mean_ms": float(np.median([r["ttft_ms"]["mean"] for r in reports[key]])),
                    "out_tok_s": float(np.median([r["output_throughput"] for r in reports[key]])),
                    "in_tok_s": float(np.median([r["total_input_tokens"] / r["duration_s"] for r in reports[key]])),
                    "hit_rate": h / q if q else 0.0, "failed": sum(r["failed"] for r in reports[key]),
                    "compiles": f"{sync:.0f}+{background:.0f}",
                    "runs": reports[key]}
        if key in steps:  # the server's own view: its TTFT (submit to first token) and its loop's turns
            out[key]["step_breakdown"] = step_breakdown(steps[key], step_times(url))
            out[key]["server_ttft_ms"] = out[key]["step_breakdown"]["server_ttft"]
    return out


def line(key: str, result: dict, system: str) -> str:
    """``system``'s line of workload and concurrency ``key`` (hypertron's unnamed, a peer's named)."""
    workload, c = key.split()
    on, off = result.get(f"{system} on", {}), result.get(f"{system} off", {})
    get = lambda r, k, spec: format(r[k], spec) if k in r else "-"  # noqa: E731
    ratio = format(off["ttft_mean_ms"] / on["ttft_mean_ms"], ".2f") if on and off else "-"
    name = "" if system == "hypertron" else f"{system} "
    return (f"prefix-caching {name}{workload} {c}: ttft_mean_ms on {get(on, 'ttft_mean_ms', '.1f')} off "
            f"{get(off, 'ttft_mean_ms', '.1f')} ratio {ratio} server_ttft_ms on {get(on, 'server_ttft_ms', '.1f')} "
            f"off {get(off, 'server_ttft_ms', '.1f')} hit_rate {get(on, 'hit_rate', '.3f')} out_tok_s on "
            f"{get(on, 'out_tok_s', '.1f')} off {get(off, 'out_tok_s', '.1f')} in_tok_s on {get(on, 'in_tok_s', '.1f')} "
            f"off {get(off, 'in_tok_s', '.1f')} compiles on "
            f"{get(on, 'compiles', 's')} off {get(off, 'compiles', 's')}")


def start_servers(stack: contextlib.ExitStack, setup, args, systems: list[str]) -> tuple[dict, dict[str, str]]:
    """One server per system and ``--prefix-caching`` setting (``"SYSTEM SETTING"``), started in
    ``stack`` with the same slots, pool and tokens per step, each once the one before is ready
    (hypertron measures a step's cost at its start: not while another server compiles beside
    it); their command lines."""
    max_c = max(args.concurrency)
    longest = max(args.prefix_len + args.suffix_len, args.input_len,
                  args.long_len if "long" in args.workload else 0) + 1 + args.max_tokens + 16
    pages, budget = max_c * -(-longest // 16), max(args.max_num_batched_tokens, max_c)
    servers, commands = {}, {}
    for system in systems:
        for setting in args.prefix_caching:
            port, key = free_ports(), f"{system} {setting}"
            if system == "hypertron":
                flag = "--enable-prefix-caching" if setting == "on" else "--no-enable-prefix-caching"
                argv, env = setup.hypertron_argv(port, max_c, pages + 1, budget) + [flag], setup.env
            else:
                argv = vllm_argv(args, setup.hf_dir, port, max_c, pages * 16, budget, setup.dtype, setting == "on")
                env = vllm_env(setup.env, args.vllm_python, args.device)
            commands[key] = " ".join([os.path.basename(argv[0]), *argv[1:]]).replace(setup.work, "$WORK")
            log = os.path.join(setup.work, f"prefix-{system}-{setting}.log")
            servers[key] = stack.enter_context(Server(key.replace(" ", "-"), argv, port, log, env))
            print(f"{key}: ready in {servers[key].wait_ready(args.ready_timeout):.1f} s", file=sys.stderr)
    return servers, commands


def run_workloads(args, prepare) -> int:
    """``--workload``: one server per system (hypertron; vLLM too with ``--peer vllm``) and
    ``--prefix-caching`` setting over the model and environment of ``prepare(args)``
    (``bench/serve_http.py``'s), each workload and concurrency; one line each."""
    systems = ["hypertron"] + (["vllm"] if args.peer == "vllm" else [])
    peer_version = vllm_version(args.vllm_python) if "vllm" in systems else None
    args.no_interference, args.servers = True, ["hypertron"]
    setup = prepare(args)
    runs = runs_of(args)
    paths = write_workload_prompts(setup.hf_dir, setup.work, args, runs)
    results, commands = {key: {} for key in runs}, {}
    for group in ([[system] for system in systems] if args.alone else [systems]):
        with contextlib.ExitStack() as stack:
            servers, started = start_servers(stack, setup, args, group)
            commands |= started
            logs = {k: stack.enter_context(open(os.path.join(setup.work, f"prefix-{k.replace(' ', '-')}-bench.log"),
                                                "w")) for k in servers}
            targets = {k: (srv.base_url, logs[k]) for k, srv in servers.items()}
            for key, each in runs.items():
                t0 = time.perf_counter()
                results[key] |= measure(targets, paths, each, int(key.split()[1][1:]), args)
                print(f"  ... {key}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
                for system in group:  # at once: a run cut off at its limit keeps what finished
                    print(line(key, results[key], system), flush=True)
    for key, command in commands.items():
        print(f"{key}: {command}")
    if peer_version:
        print(f"peer: {peer_version} ({args.vllm_python})")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"results": results, "commands": commands, "peer": peer_version, "args": vars(args)}, f,
                      indent=1)
    if args.keep is None:
        shutil.rmtree(setup.work, ignore_errors=True)
    return 1 if any(r["failed"] for result in results.values() for r in result.values()) else 0
