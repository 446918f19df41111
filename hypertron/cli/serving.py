"""``hypertron serve`` and ``bench serve``: one flag per :class:`ServeConfig` field, and the load
generator."""

from __future__ import annotations

import argparse
import dataclasses
import os

from hypertron.cli.flags import add_dataclass_flags, flag
from hypertron.config import ServeConfig, load_serve_config


# The flags of `hypertron serve`, one per ServeConfig key (`max_slots` is --max-slots): their types,
# choices and defaults come from the schema; only the help text and metavar are written here.
_SERVE_FLAGS: dict[str, dict] = {
    "checkpoint": dict(metavar="DIR", aliases=("--model",),
                       help="run directory (its latest checkpoint) or Hugging Face model directory; required"),
    "host": dict(help="address to bind"),
    "port": dict(),
    "api_key": dict(metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1 endpoints"),
    "max_slots": dict(metavar="N", help="sequences decoding at once, at most"),
    "max_num_batched_tokens": dict(metavar="N", help="tokens per engine step: decode tokens + prompt chunks "
                                                     "(a longer prompt is prefilled over several steps)"),
    "max_prefill_rows": dict(metavar="N", help="prompts or prompt chunks per step, at most"),
    "prefill_groups": dict(help="new prompts per step: auto: as many as give the least mean time to first "
                                "token, from a step's cost measured at start (one at a time on a CPU); max: as "
                                "many as the budget and --max-prefill-rows allow"),
    "page_size": dict(metavar="N", help="tokens per KV page"),
    "num_pages": dict(metavar="N", help="KV pages (default: every slot at max_seq_len)"),
    "kv_cache_dtype": dict(help="auto = the model's compute dtype"),
    "quantize": dict(help="weight precision"),
    "compile": dict(help="background: a new step shape compiles in the background while its steps run "
                         "padded to a compiled shape at most twice as costly (if any); lazy: a step waits for "
                         "its shape's compile"),
    "dispatch_ahead": dict(help="dispatch each step before the last one's tokens reach the host; auto: on "
                                "an accelerator, and for steps of at most 8 tokens on a CPU"),
    "max_queue": dict(metavar="N", help="requests waiting for a slot before new ones get 429"),
    "max_prompt_tokens": dict(metavar="N", help="default: max_seq_len - 1"),
    "max_tokens_limit": dict(metavar="N", help="largest max_tokens (default: max_seq_len)"),
    "model_name": dict(metavar="NAME", help="the id in /v1/models (default: the run directory's name)"),
}


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``serve`` and ``bench serve`` to ``sub``."""
    sv = sub.add_parser(
        "serve", help="serve a checkpoint over an OpenAI-compatible HTTP API",
        description="Serve a checkpoint with continuous batching and a paged KV cache: POST /v1/completions, "
        "/v1/chat/completions, GET /v1/models, /health, /metrics (Prometheus). Binds 127.0.0.1 unless told.",
    )
    sv.add_argument("--config", metavar="FILE", help="a YAML file of these settings (keys as the flags, "
                    "with _ for -: max_slots: 16); flags given override it")
    missing = {f.name for f in dataclasses.fields(ServeConfig)} ^ set(_SERVE_FLAGS)
    assert not missing, f"ServeConfig fields and serve flags differ: {missing}"
    # A flag not given is left out of the namespace, so that a --config file's value stands.
    add_dataclass_flags(sv, ServeConfig, _SERVE_FLAGS, given_only=True, show_default=True)
    sv.set_defaults(func=cmd_serve)
    _add_bench(sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
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


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The :class:`ServeConfig` of ``hypertron serve``'s arguments: ``--config FILE`` (if given),
    then the flags typed, which win. Messages name a flag as typed and a key by its file."""
    given = {k: v for k, v in vars(args).items() if k in _SERVE_FLAGS}

    def name(key: str) -> str:
        return f"{args.config}: {key}" if args.config and key not in given else flag(key)

    return load_serve_config(args.config, given, name)


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = serve_config_from_args(args)
    from hypertron.serve.server import main as serve_main

    return serve_main(cfg)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from hypertron.loadgen import BenchSettings, bench_serve

    names = {f.name for f in dataclasses.fields(BenchSettings)}
    return bench_serve(BenchSettings(**{k: v for k, v in vars(args).items() if k in names}))
