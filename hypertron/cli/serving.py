"""``hypertron serve`` and ``bench serve``: one flag per :class:`ServeConfig` field, and the load
generator."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from hypertron.config import ServeConfig, choices, load_serve_config


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


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`ServeConfig` field; a flag not given is left out of the namespace, so
    that a ``--config`` file's value stands unless a flag overrides it."""
    hints = typing.get_type_hints(ServeConfig)
    missing = {f.name for f in dataclasses.fields(ServeConfig)} ^ set(_SERVE_FLAGS)
    assert not missing, f"ServeConfig fields and serve flags differ: {missing}"
    for field in dataclasses.fields(ServeConfig):
        tp = hints[field.name]
        kind = next((a for a in typing.get_args(tp) if a is not type(None)), tp)  # int | None -> int
        options = dict(_SERVE_FLAGS[field.name], default=argparse.SUPPRESS)
        aliases = options.pop("aliases", ())
        if typing.get_origin(tp) is typing.Literal:
            options["choices"] = choices(tp)
        elif kind is int:
            options["type"] = int
        if field.default not in (None, ""):
            options["help"] = (options.get("help", "") + f" (default {field.default})").strip()
        parser.add_argument(_flag(field.name), *aliases, dest=field.name, **options)


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The :class:`ServeConfig` of ``hypertron serve``'s arguments: ``--config FILE`` (if given),
    then the flags typed, which win. Messages name a flag as typed and a key by its file."""
    given = {k: v for k, v in vars(args).items() if k in _SERVE_FLAGS}

    def name(key: str) -> str:
        return f"{args.config}: {key}" if args.config and key not in given else _flag(key)

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
