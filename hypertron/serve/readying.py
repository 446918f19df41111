"""Readying a served model's engine as ``hypertron serve`` does, in whichever process runs its loop:
loaded (:mod:`hypertron.serve.loading`), its step's cost measured and its shapes compiling
(:func:`orchestrate`), the process tuned for its loop (:func:`tune_for_serving`)."""

from __future__ import annotations

import gc
import math
import sys

from hypertron.config import ServeConfig
from hypertron.serve.orchestrator import Orchestrator

# The engine loop's thread and the event loop's share the GIL: a thread that wants it back (the
# loop, after each step's wait on the device) waits up to Python's switch interval (5 ms by default)
# while the other runs Python. 0.5 ms: in a 16-stream trace on 2 cores a step's dispatch call took
# 3.8 ms on average at 5 ms and 2.4 ms at 0.5 ms (docs/benchmarks.md).
SWITCH_INTERVAL_S = 0.0005


def engine_side(serve: ServeConfig, tune: bool = False) -> tuple[Orchestrator, str]:
    """``(orchestrator, model_name)``: the engine of ``serve.checkpoint`` loaded and readied
    (:func:`orchestrate`); ``tune``: this process then serves (:func:`tune_for_serving`)."""
    import jax

    from hypertron.serve.loading import load_engine
    from hypertron.serve.model import model_config_of
    from hypertron.serve.placement import fit_memory
    from hypertron.serve.shapes import ShapeMemory  # imports JAX (its cost model): not at the module's import

    model, config = model_config_of(serve.checkpoint), serve.engine
    draft = (serve.draft_model, serve.num_speculative_tokens) if serve.speculative == "draft" else None
    if model is not None and serve.memory_check:  # before anything loads
        config = fit_memory(model, config, serve.quantize, serve.max_num_batched_tokens, jax.local_devices()[0],
                            serve.kv_cache_memory_fraction, draft and model_config_of(draft[0]))
    engine, tokenizer, model_name = load_engine(serve.checkpoint, config, quantize=serve.quantize,
                                                lora_modules=serve.lora_adapters(), draft=draft)
    orchestrator = orchestrate(engine, tokenizer, serve, ShapeMemory.beside_compile_cache(engine.program_digest))
    if tune:
        tune_for_serving(engine)
    return orchestrator, model_name


def orchestrate(engine, tokenizer, serve: ServeConfig, memory=None) -> Orchestrator:
    """The orchestrator (not started) of ``engine`` as ``hypertron serve`` readies it: a step's cost
    measured (``prefill_groups: auto``), the largest shape and then ``memory``'s (a
    :class:`~hypertron.serve.shapes.ShapeMemory`, or None) compiling in the background (``compile:
    background``), each shape compiled from now on kept in ``memory``,
    ``serve.scheduler`` whole. ``bench/serve.py --profile`` uses it too."""
    from hypertron.serve.orchestrator import Orchestrator  # looked up when called (a test wraps it)

    if memory is not None:
        engine.on_compiled = memory.add
    overhead = None
    if serve.prefill_groups == "auto":
        cost = engine.measure_step_cost(serve.max_num_batched_tokens)
        overhead = cost.overhead_tokens if math.isfinite(cost.overhead_tokens) else None
        if math.isnan(cost.per_token):
            print(f"hypertron serve: a step's cost could not be measured here (one of {serve.max_num_batched_tokens} "
                  "tokens was timed within 5% of one of 1: a busy CPU?); "
                  "new prompts share a step as the budget allows, and a step's fixed cost is not counted",
                  file=sys.stderr)
        else:
            print(f"hypertron serve: a step costs {cost.fixed * 1e3:.2f} ms + {cost.per_token * 1e3:.4f} ms a token "
                  f"here, its fixed cost {'beyond measure' if overhead is None else f'{overhead:.0f}'} tokens' worth: "
                  "new prompts share a step as that gives the least mean time to first token", file=sys.stderr)
    if serve.compile == "background":  # then no step waits for a compile but one of a variant not met yet
        engine.precompile(engine.largest_shape(serve.scheduler))
        for shape in memory.shapes if memory is not None else ():  # the last run's, before a load meets them
            engine.precompile(shape)
    return Orchestrator(engine, tokenizer, serve.scheduler, step_overhead_tokens=overhead)


def tune_for_serving(engine) -> None:
    """Ready this process to run ``engine``'s loop for a server: what exists is frozen out of the
    garbage collector, as is what each compile adds, and threads switch sooner
    (:data:`SWITCH_INTERVAL_S`)."""
    # A full garbage collection walks every object the process holds, and JAX's caches keep about
    # 13,000 for each step shape compiled: with two dozen compiled, one took 300 ms, a pause in every
    # stream (traced at concurrency 16). What exists once the engine is up, and what each compile
    # adds, is frozen (gc.freeze): left out of collections, still freed when no longer referenced.
    gc.collect()
    gc.freeze()
    keep = engine.on_compiled or (lambda shape: None)
    engine.on_compiled = lambda shape: (keep(shape), gc.freeze())
    sys.setswitchinterval(SWITCH_INTERVAL_S)
