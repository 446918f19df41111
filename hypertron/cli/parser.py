"""The ``hypertron`` parser: every subcommand's flags, and ``main``, which parses, calls one function
and turns a user mistake into one line and exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
import typing

from hypertron.cli.launching import _add_output_flags, cmd_cluster, cmd_launch, cmd_recipes, cmd_workload
from hypertron.cli.monitoring import cmd_monitor
from hypertron.cli.serving import _add_serve_flags, cmd_bench_serve, cmd_serve
from hypertron.cli.training import (
    _bytes_arg, cmd_convert, cmd_embed_plan, cmd_generate, cmd_plan, cmd_tokenize, cmd_train,
)
from hypertron.config import TOKENIZABLE_SOURCES, choices
from hypertron.config.schema import WeightQuantization
from hypertron.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's own error shape: one ``error:`` line and exit code 2 (the usage is
    what ``--help`` shows)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hypertron", description="Train and serve LLMs, and train recommenders, in JAX.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "train", help="train a model",
        description="Train a model. Arguments: an optional YAML recipe, then key=value overrides "
        "(e.g. model=tiny train.steps=200 mesh.fsdp=-1). Resumes from the latest checkpoint in run_dir.",
    )
    t.add_argument("overrides", nargs="*", metavar="[RECIPE] key=value")
    t.set_defaults(func=cmd_train)

    pl = sub.add_parser(
        "plan", help="memory per device, compute and communication time of a training config, before launch",
        description="Plan a training run on hardware you may not have: per-device memory (parameters, "
        "gradients, optimiser state exact; activations estimated), compute time at the device's peak, "
        "communication per mesh axis, and the predicted step time and MFU. Exit 1 when it does not fit. "
        "docs/memory.md has the formulas.")
    pl.add_argument("overrides", nargs="*", metavar="[RECIPE] key=value")
    pl.add_argument("--hardware", default="h100", help="the accelerator: a name in the hardware table "
                    "(default %(default)s; a name not in it lists them)")
    pl.add_argument("--devices", type=int, default=None, metavar="N", help="default: one node's")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=cmd_plan)

    g = sub.add_parser("generate", help="continue a prompt from a checkpoint")
    g.add_argument("--checkpoint", "--model", dest="checkpoint", required=True, metavar="DIR",
                   help="run directory (its latest checkpoint) or Hugging Face model directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quantize", choices=choices(WeightQuantization), default="none",
                   help="weight precision: int8 = int8 weights with per-channel scales, quantised after loading")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="import or export Hugging Face checkpoints")
    c.add_argument("--from-hf", metavar="DIR", help="HF directory (config.json + safetensors) to import")
    c.add_argument("--out", metavar="DIR", help="model bundle to write (with --from-hf): a new or empty directory")
    c.add_argument("--to-hf", metavar="DIR", help="HF directory to write (with --checkpoint)")
    c.add_argument("--checkpoint", "--model", dest="checkpoint", metavar="DIR",
                   help="model bundle or run directory to export (with --to-hf)")
    c.set_defaults(func=cmd_convert)

    la = sub.add_parser("launch", help="run a command as several cooperating processes")
    where = la.add_subparsers(dest="where", required=True)
    lo = where.add_parser(
        "local", help="N processes on this machine (jax.distributed over 127.0.0.1)",
        description="Start N processes of `hypertron COMMAND...` on this machine, joined by "
        "jax.distributed, e.g. `hypertron launch local --processes 2 --cpu-devices 4 -- train model=tiny`.",
    )
    lo.add_argument("--processes", type=int, metavar="N")
    lo.add_argument("--recipe", metavar="R", help="train this recipe as its processes (nodes x processes per node), "
                    "with its environment; key=value overrides may follow")
    lo.add_argument("--gpus", metavar="N_OR_LIST", help="split these GPUs (a count or 0,1,2,3) over the processes, "
                    "each its own CUDA_VISIBLE_DEVICES slice (default: the launcher's CUDA_VISIBLE_DEVICES)")
    lo.add_argument("--cpu-devices", type=int, default=None, metavar="K",
                    help="run on the CPU with K simulated devices per process")
    lo.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    lo.set_defaults(func=cmd_launch)

    rc = sub.add_parser(
        "recipes", help="the recipes per model x machine, with their predicted memory per device",
        description="List the recipes (recipes/<machine>/<model>.yaml) with their machine, node count, mesh and "
        "the memory model's prediction per device; with a NAME, its XLA flags and environment with their reasons "
        "and its whole plan.")
    rc.add_argument("name", nargs="?", metavar="NAME", help="one recipe, e.g. a3mega-h100/llama3.1-70b")
    rc.add_argument("--nodes", type=int, default=None, metavar="N", help="on N nodes (default: each recipe's own)")
    rc.add_argument("--json", action="store_true", help="print as JSON")
    rc.add_argument("--config", action="store_true", help="with NAME: also print the resolved config as YAML")
    rc.set_defaults(func=cmd_recipes)

    wl = sub.add_parser("workload", help="training workloads on Kubernetes (JobSet + Kueue) or Slurm (sbatch)")
    wla = wl.add_subparsers(dest="action", required=True)
    wc = wla.add_parser(
        "create", help="render, validate and submit a recipe as a JobSet",
        description="Render a recipe as a ConfigMap (the resolved recipe) and a JobSet of one pod per node, "
        "validate both strictly, print them, and submit them (or only print them with --dry-run, or write them "
        "with --output). key=value overrides after the options change the recipe. docs/launch.md shows the objects.")
    wc.add_argument("name", metavar="NAME", help="the workload's name (a DNS label; its pods' host names must "
                    "stay within 57 characters)")
    wc.add_argument("--recipe", required=True, metavar="R", help="a recipe name (a3mega-h100/llama3.1-70b) or YAML file")
    wc.add_argument("--nodes", type=int, default=None, metavar="N", help="default: the recipe's")
    wc.add_argument("--image", metavar="IMG", help="the container image with hypertron installed "
                    "(default: $HYPERTRON_IMAGE)")
    from hypertron.launch.machines import MACHINES, PRIORITIES

    wc.add_argument("--priority", default="medium", metavar="P",
                    help=f"{', '.join(PRIORITIES)} (default %(default)s)")
    wc.add_argument("--max-restarts", type=int, default=10, metavar="K",
                    help="gang restarts before the workload fails; each preemption or eviction uses one "
                    "(default %(default)s)")
    wc.add_argument("--queue", default="hypertron", metavar="Q", help="the Kueue LocalQueue (default %(default)s)")
    wc.add_argument("--storage", metavar="WHERE", help="where the run directory lives: pvc:CLAIM or gs://BUCKET; "
                    "with --scheduler slurm, a directory on the shared file system (default runs)")
    wc.add_argument("--partition", metavar="P", help="--scheduler slurm: the partition (default: the cluster's)")
    wc.add_argument("--time", metavar="T", help="--scheduler slurm: the time limit (minutes, HH:MM:SS, D-HH:MM)")
    wc.add_argument("--namespace", default="default", help="default %(default)s")
    _add_output_flags(wc, "submit")
    wc.add_argument("overrides", nargs="*", metavar="key=value")
    for action, text in (("list", "hypertron's workloads and their state"), ("describe", "a workload's state and pods"),
                         ("logs", "a process's log"), ("delete", "delete a workload (its checkpoints stay)")):
        a = wla.add_parser(action, help=text)
        if action != "list":
            a.add_argument("name", metavar="NAME")
        if action == "logs":
            a.add_argument("--process", type=int, default=0, metavar="I", help="default %(default)s")
            a.add_argument("--storage", metavar="DIR", help="--scheduler slurm: as at create (default runs)")
        a.add_argument("--namespace", default="default", help="default %(default)s")
    for a in (wc, *wla.choices.values()):
        if "--scheduler" not in a._option_string_actions:
            a.add_argument("--scheduler", choices=("kubernetes", "slurm"), default="kubernetes",
                           help="a JobSet on Kubernetes, or an sbatch job on Slurm (default %(default)s)")
    wl.set_defaults(func=cmd_workload)

    cl = sub.add_parser("cluster", help="a cluster's queueing objects (Kueue and priority classes)")
    cla = cl.add_subparsers(dest="action", required=True)
    cs = cla.add_parser(
        "setup", help="Kueue's ResourceFlavor, ClusterQueue and LocalQueue, and five PriorityClasses",
        description="Render, validate and apply (server-side) what workloads need on a cluster with Kueue "
        "and JobSet installed: a ResourceFlavor for the machine, a ClusterQueue with a quota of --nodes of them, "
        "the LocalQueue workloads name, and the PriorityClasses very-low .. very-high.")
    cs.add_argument("--hardware", default="a3mega-h100", choices=list(MACHINES), help="default %(default)s")
    cs.add_argument("--nodes", type=int, required=True, metavar="N", help="the queue's quota, in nodes")
    cs.add_argument("--queue", default="hypertron", metavar="Q", help="default %(default)s")
    cs.add_argument("--namespace", default="default", help="the LocalQueue's (default %(default)s)")
    _add_output_flags(cs, "apply")
    cl.set_defaults(func=cmd_cluster)

    mo = sub.add_parser(
        "monitor", help="goodput, badput by cause, disruptions and alarms of a training run",
        description="Report where a training run's time went, by ml-goodput-measurement's definitions, "
        "from its run directory: goodput, badput by cause, jobs, disruptions, step-time deviation, and "
        "alarms (a hung process, a NaN loss, loss spikes). Exit 1 when an alarm is raised. "
        "docs/monitoring.md defines every figure.",
    )
    mo.add_argument("run_dir", metavar="RUN_DIR")
    mo.add_argument("--json", action="store_true", help="print the report as JSON")
    mo.add_argument("--follow", nargs="?", type=float, const=5.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 5) until the run's job stops")
    mo.add_argument("--since", metavar="TIME", help="also report the window from TIME (ISO date-time, "
                    "Unix time, or a duration before now such as 2h)")
    mo.add_argument("--window", metavar="DURATION", help="the window's length (90s, 30m, 2h); alone: "
                    "the last DURATION")
    mo.add_argument("--hang-factor", type=float, default=10.0, metavar="K",
                    help="hung: no step for K x the ideal step time (default %(default)s)...")
    mo.add_argument("--hang-min", type=float, default=60.0, metavar="S",
                    help="...and at least S seconds (default %(default)s)")
    mo.add_argument("--straggler-threshold", type=float, default=0.75, metavar="R",
                    help="a process scoring under R is a straggler (default %(default)s)")
    mo.add_argument("--top", type=int, default=5, metavar="N",
                    help="outliers: the top N processes per metric (default %(default)s)")
    mo.add_argument("--serve", action="store_true",
                    help="serve a live dashboard of the run (one page, updated while it runs)")
    mo.add_argument("--host", default="127.0.0.1", help="--serve: the address to listen on (default %(default)s; "
                    "0.0.0.0 for every interface)")
    mo.add_argument("--port", type=int, default=8090, help="--serve: the port (default %(default)s; 0: any free one)")
    mo.add_argument("--refresh", type=float, default=5.0, metavar="SECONDS",
                    help="--serve: how often the page updates (default %(default)s)")
    mo.set_defaults(func=cmd_monitor)

    em = sub.add_parser("embed", help="sharded embedding tables")
    ema = em.add_subparsers(dest="action", required=True)
    ep = ema.add_parser(
        "plan", help="where each embedding table goes over the devices, and why",
        description="Place each table of a spec file (YAML: batch, tables, features; docs/embeddings.md) "
        "table-wise, row-wise or column-wise over the devices: bytes held per device, ids and bytes exchanged "
        "per step, the reason for each choice. A table's placement set in the file is kept. Exit 1 when the "
        "tables do not fit.")
    ep.add_argument("spec", metavar="SPEC.yaml")
    ep.add_argument("--hardware", default="h100", help="the device, for its memory (default %(default)s; "
                    "cpu: this host's memory shared by the devices)")
    ep.add_argument("--devices", type=int, default=None, metavar="N", help="default: one node's")
    ep.add_argument("--device-memory", type=_bytes_arg, default=None, metavar="BYTES",
                    help="memory per device for the tables (e.g. 60GB), in place of the hardware's")
    ep.add_argument("--batch", type=int, default=None, metavar="N", help="samples per step, in place of the file's")
    ep.add_argument("--json", action="store_true", help="print the plan as JSON")
    ep.set_defaults(func=cmd_embed_plan)

    k = sub.add_parser(
        "tokenize", help="pre-tokenise a corpus for data.source=tokens",
        description="Tokenise a corpus once into ArrayRecord shards of int32 ids; train on it with "
        "data.source=tokens data.paths=[OUT] and the same data.tokenizer. Never overwrites: --out "
        "must be new or an empty directory.",
    )
    k.add_argument("--source", required=True, choices=TOKENIZABLE_SOURCES)
    k.add_argument("--paths", nargs="*", default=[], metavar="PATH", help="files or directories")
    k.add_argument("--text-field", default="text", help="the text column / key (jsonl, parquet, hf)")
    k.add_argument("--tokenizer", required=True, help="'byte', a tokenizer.json (or its directory) "
                   "or a SentencePiece .model")
    k.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")
    k.set_defaults(func=cmd_tokenize)

    sv = sub.add_parser(
        "serve", help="serve a checkpoint over an OpenAI-compatible HTTP API",
        description="Serve a checkpoint with continuous batching and a paged KV cache: POST /v1/completions, "
        "/v1/chat/completions, GET /v1/models, /health, /metrics (Prometheus). Binds 127.0.0.1 unless told.",
    )
    sv.add_argument("--config", metavar="FILE", help="a YAML file of these settings (keys as the flags, "
                    "with _ for -: max_slots: 16); flags given override it")
    _add_serve_flags(sv)
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks")
    what = b.add_subparsers(dest="what", required=True)
    bs = what.add_parser(
        "serve", help="load-test an OpenAI-compatible completions server",
        description="Send streaming POST /v1/completions requests to any OpenAI-compatible server, "
        "at a Poisson rate (--request-rate) or a fixed number in flight (--concurrency), and report "
        "throughput and TTFT / TPOT / ITL / end-to-end latency (mean, p50, p90, p99).",
    )
    bs.add_argument("--base-url", default="http://127.0.0.1:8000", metavar="URL", help="default %(default)s")
    bs.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), metavar="KEY",
                    help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    bs.add_argument("--model", help="default: the first id from GET /v1/models")
    bs.add_argument("--num-requests", type=int, default=100, metavar="N", help="default %(default)s")
    bs.add_argument("--request-rate", type=float, metavar="R",
                    help="Poisson arrivals, requests/s; inf = all at once (the default)")
    bs.add_argument("--concurrency", type=int, metavar="N", help="keep N requests in flight instead")
    bs.add_argument("--prompts", metavar="FILE", help='JSONL: {"prompt": str or [token ids], '
                    '"max_tokens"?: int} per line, cycled (default: random token-id prompts)')
    bs.add_argument("--random-input-len", type=int, metavar="L", help="random prompt length (default 128)")
    bs.add_argument("--random-vocab-low", type=int, default=3, metavar="ID", help="default %(default)s")
    bs.add_argument("--random-vocab-high", type=int, default=259, metavar="ID", help="exclusive, default %(default)s")
    bs.add_argument("--max-tokens", type=int, default=128, metavar="M",
                    help="per request, unless its prompts line says (default %(default)s)")
    bs.add_argument("--temperature", type=float, default=0.0, metavar="T", help="default 0 (greedy)")
    bs.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true (an extension)')
    bs.add_argument("--seed", type=int, default=0, metavar="S", help="for the arrival times and random prompts")
    bs.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                    help="seconds to connect, or between two reads of a stream (default %(default)s)")
    bs.add_argument("--output", metavar="FILE", help="write the report as JSON")
    bs.set_defaults(func=cmd_bench_serve)
    return p


def _leave_distributed_job(code: int) -> None:
    """In a multi-process job, exit at once: Python's normal exit would wait in JAX's shutdown
    barrier for the other processes (minutes), then abort with a C++ trace."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may come after options (argparse takes a positional list only in one piece)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "command", None) == "convert" and args.from_hf and not args.out:
        print("error: convert --from-hf needs --out DIR", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        _leave_distributed_job(2)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
