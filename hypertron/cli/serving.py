"""``hypertron serve`` and ``bench serve``: one flag per :class:`ServeConfig` field (their help
written here), and one per :class:`~hypertron.loadgen.BenchSettings` field (help and all the field's)
for the load generator."""

from __future__ import annotations

import argparse
import dataclasses
import os

from hypertron.cli.flags import (COMPILE_CACHE_HELP, add_command, add_command_group, add_dataclass_flags, flag,
                                  use_compile_cache)
from hypertron.config import ServeConfig, load_serve_config
from hypertron.config.schema import DIFFUSION_DTYPE
from hypertron.config.serving import CPU_AHEAD_MAX_TOKENS, IMAGE_DEFAULTS
from hypertron.loadgen import BenchSettings


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
    "enable_lora": dict(help="serve LoRA adapters (PEFT directories) in the batch, from --lora-modules (and "
                             "--allow-runtime-lora); a request's model names one"),
    "allow_runtime_lora": dict(help="let POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the "
                                    "adapters served (a load reads a path on the server: use --api-key); off, "
                                    "they answer 403"),
    "engine_process": dict(help="run the engine loop in a process of its own and the HTTP server in this one "
                                "(vLLM's layout), so that they share no GIL"),
    "tensor": dict(metavar="N", help="split the weights (heads, MLP, vocabulary) and the KV pages (by KV head) "
                                     "over this host's first N devices, as training's rules do"),
    "memory_check": dict(help="refuse, before loading, a model and KV pool the memory model says a device "
                                   "cannot hold (hypertron plan --serve); --no-memory-check tries anyway"),
    "kv_cache_memory_fraction": dict(metavar="F", help="the share of each device's memory the weights, a step's "
                                                       "workspace and the KV pool may take; on an accelerator "
                                                       "without --num-pages the pool gets what is left of it"),
    "expert": dict(metavar="M", help="split an MoE's experts over M devices (tensor x expert devices in all): each "
                                     "computes its own experts' share of the step's tokens"),
    "max_loras": dict(metavar="N", help="LoRA adapters loaded at once, at most"),
    "max_lora_rank": dict(metavar="R", help="the highest LoRA rank an adapter may have"),
    "lora_modules": dict(nargs="+", metavar="NAME=PATH", help="LoRA adapters (PEFT directories) to load at "
                                                             "start, each served as the model NAME"),
    "max_top_logprobs": dict(metavar="N", help="the most log-probabilities a request may ask for per token "
                                               "(logprobs, top_logprobs); a step that returns them computes "
                                               "this many"),
    "quantize": dict(help="weight precision: none or int8; a diffusers folder: the denoiser's matmuls, also fp8 "
                          "(as hypertron diffuse --quantize)"),
    "compile": dict(help="background: a new step shape compiles in the background while its steps run "
                         "padded to a compiled shape that holds it (the largest compiles at start); lazy: a step "
                         "waits for its shape's compile"),
    "compile_cache": dict(metavar="DIR", help=f"{COMPILE_CACHE_HELP}; a text model's server also keeps there "
                                              "the step shapes it compiled, and loads them at its next start"),
    "dispatch_ahead": dict(help="dispatch each step before the last one's tokens reach the host; auto: on "
                                f"an accelerator, and for steps of at most {CPU_AHEAD_MAX_TOKENS} tokens on a CPU"),
    "max_queue": dict(metavar="N", help="requests waiting for a slot before new ones get 429"),
    "max_prompt_tokens": dict(metavar="N", help="default: max_seq_len - 1"),
    "max_tokens_limit": dict(metavar="N", help="largest max_tokens (default: max_seq_len)"),
    "model_name": dict(metavar="NAME", help="the id in /v1/models (default: the run directory's name)"),
    "openapi": dict(help="serve the API's description at GET /openapi.json, behind --api-key when one is set"),
    "enable_prefix_caching": dict(help="keep the KV pages of full pages of prompts (and of generated tokens) "
                                       "cached, and share them between requests with the same prefix (and "
                                       "cache_salt)"),
    "speculative": dict(help="ngram: a sequence whose last tokens occurred before in it (prompt or output) "
                             "proposes the tokens that followed them, and each step keeps those the model "
                             "agrees with (the tokens it gives without: each step draws as it would and keeps "
                             "the proposed tokens while they equal its draws); draft: --draft-model proposes "
                             "them; off: one token a step"),
    "num_speculative_tokens": dict(metavar="K", help="tokens a sequence proposes per step, at most"),
    "prompt_lookup_min": dict(metavar="N", help="ngram: the fewest last tokens looked up"),
    "prompt_lookup_max": dict(metavar="N", help="ngram: the most last tokens looked up (the longest match "
                                                "proposes)"),
    "draft_model": dict(metavar="DIR", help="speculative draft: a smaller model with the same tokenizer (a run, "
                                            "bundle or Hugging Face directory) that proposes each sequence's next "
                                            "tokens greedily in the step before they are verified"),
    "sizes": dict(metavar="WxH,...", help="a diffusers folder: the image sizes served (each compiled at start; "
                                          "default: the model's own)"),
    "max_batch": dict(metavar="N", help="a diffusers folder: images per request (n), at most (default "
                                        f"{IMAGE_DEFAULTS['max_batch']})"),
    "max_steps": dict(metavar="N", help="a diffusers folder: num_inference_steps, at most (default "
                                        f"{IMAGE_DEFAULTS['max_steps']})"),
    "embedding_cache": dict(metavar="N", help="a diffusers folder: prompts whose text-encoder outputs are kept, "
                                              f"least recently used dropped (0: off; default "
                                              f"{IMAGE_DEFAULTS['embedding_cache']})"),
    "mesh": dict(metavar="AXIS=N,...", help="a diffusers folder: devices, e.g. data=2,fsdp=2 (images over data, "
                                            "weights over fsdp/tensor by the sharding rules; default: one device)"),
    "dtype": dict(help=f"a diffusers folder: its weights' dtype, as hypertron diffuse --dtype (default "
                       f"{DIFFUSION_DTYPE}; a run or Hugging Face directory computes in its config's)"),
    "text_encoder_quantize": dict(help="a diffusers folder: the text encoders' matmuls, as hypertron diffuse "
                                       "--text-encoder-quantize (default none)"),
}


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``serve`` and ``bench serve`` to ``sub``."""
    sv = add_command(sub, "serve", cmd_serve, help="serve a checkpoint over an OpenAI-compatible HTTP API")
    sv.add_argument("--config", metavar="FILE", help="a YAML file of these settings (keys as the flags, "
                    "with _ for -: max_slots: 16); flags given override it")
    missing = {f.name for f in dataclasses.fields(ServeConfig)} ^ set(_SERVE_FLAGS)
    assert not missing, f"ServeConfig fields and serve flags differ: {missing}"
    # A flag not given is left out of the namespace, so that a --config file's value stands.
    add_dataclass_flags(sv, ServeConfig, _SERVE_FLAGS, given_only=True, show_default=True)
    _add_bench(sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    what = add_command_group(sub, "bench", help="benchmarks", dest="what")
    bs = add_command(what, "serve", cmd_bench_serve, help="load-test an OpenAI-compatible completions server")
    # The key's default is the environment's, read when the flags are made.
    # --request-rate: inf is a rate (all at once); BenchSettings.check refuses NaN and rates <= 0 by name
    add_dataclass_flags(bs, BenchSettings, {"api_key": dict(default=os.environ.get("OPENAI_API_KEY")),
                                            "request_rate": dict(type=float)})


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The :class:`ServeConfig` of ``hypertron serve``'s arguments: ``--config FILE`` (if given),
    then the flags typed, which win. Messages name a flag as typed and a key by its file."""
    given = {k: v for k, v in vars(args).items() if k in _SERVE_FLAGS}

    def name(key: str) -> str:
        return f"{args.config}: {key}" if args.config and key not in given else flag(key)

    return load_serve_config(args.config, given, name)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a checkpoint with continuous batching and a paged KV cache: POST /v1/completions,
    /v1/chat/completions, GET /v1/models, /health, /metrics (Prometheus); or a diffusers folder
    (model_index.json): POST /v1/images/generations. Binds 127.0.0.1 unless told."""
    cfg = serve_config_from_args(args)
    use_compile_cache(cfg.compile_cache)
    if cfg.serves_images:  # a diffusers pipeline folder
        from hypertron.serve.images import main as serve_images
        return serve_images(cfg)
    from hypertron.serve.server import main as serve_main

    return serve_main(cfg)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Send streaming POST /v1/completions requests to any OpenAI-compatible server, at a Poisson rate
    (--request-rate) or a fixed number in flight (--concurrency), and report throughput and TTFT / TPOT / ITL /
    end-to-end latency (mean, p50, p90, p99)."""
    from hypertron.loadgen import bench_serve

    names = {f.name for f in dataclasses.fields(BenchSettings)}
    return bench_serve(BenchSettings(**{k: v for k, v in vars(args).items() if k in names}))
