"""Serving decode throughput: output tokens/s vs batch size, per KV-cache dtype, with transformers as the peer.

    python bench/serve.py [PRESET] [key=value ...] [--batch-sizes 1 4 16] [--kv-dtypes float32 int8]
                          [--context 512] [--steps 32] [--warmup 3] [--page-size 16] [--top-logprobs 20]
                          [--peak-bw B/s] [--torch-threads N] [--no-hf] [--profile [--trace DIR]]

One model, random weights (``init_params``) in the compute dtype (``auto``: float32 on
CPU, bfloat16 on an accelerator); ``key=value`` overrides change the preset's fields
(``num_layers=8`` or ``model.num_layers=8``).

hypertron: a :class:`hypertron.serve.engine.PagedEngine` with ``max_slots`` = batch and
just the pages the run needs, driven by the scheduler; every slot gets a prompt of
``--context`` random tokens (one prompt per step, greedy), ``--warmup`` decode steps compile,
then ``--steps`` steps are timed, each scheduled, run and its tokens brought to the host
(synchronously: no step runs ahead). tokens/s = batch x steps / time. Per row: the KV cache's bytes per token
(``bytes_per_token``), the bytes of the pages in use at the end, and, on a GPU, the
fraction of the HBM-bandwidth roofline: bytes one step must read (the weights, less the
embedding table of an untied model, of which it reads one row per slot, plus the K/V of
every slot at its length, averaged over the timed steps) / step time / peak bandwidth.

transformers: the same weights (written with :func:`hypertron.models.hf.save_hf`, read
back with ``from_pretrained``), the same prompts, ``generate`` greedy with ``use_cache``
and ``min_new_tokens = max_new_tokens = warmup + steps + 1`` so it never stops early;
torch on as many threads as there are cores (or on CUDA when JAX is on a GPU). Its step
time leaves the prefill out: a logits processor stamps the clock at each new token, and a
step is (last stamp - first) / (N - 1); the median of 3 runs after a warm-up run. Its KV
cache is the default dynamic one, in the compute dtype.
Both sides' greedy tokens for the first prompt are compared, to show they run one model.

``--profile``: instead, the serving loop at each batch size, readied as ``hypertron serve`` readies
it, without HTTP, and where its turns' time goes, phase by phase (``bench/serve_profile.py``;
``--trace DIR``: its measured round under ``jax.profiler.trace``, for Perfetto or TensorBoard).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

# JAX would take 75% of the GPU up front and leave torch, in this same process, too little.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # after the environment variable above
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from table import print_table  # bench/table.py, this directory

# Peak HBM bandwidth (bytes/s) by device kind, for the roofline column.
PEAK_HBM_BW = {"H100": 3.35e12, "H200": 4.8e12}
COLUMNS = [("engine", "<12"), ("batch", ">5"), ("kv dtype", "<9"), ("ms/step", ">8.2f"), ("tokens/s", ">9,.0f"),
           ("KV B/token", ">10,"), ("KV in use", ">11"), ("roofline", ">8")]


def model_config(preset: str, overrides: list[str]):
    """The preset's :class:`ModelConfig` with ``key=value`` (or ``model.key=value``) overrides."""
    from hypertron.config import load_config

    keys = [o if o.startswith("model.") else "model." + o for o in overrides]
    return load_config(None, [f"model={preset}", *keys]).model


def weight_bytes_per_step(cfg, params, batch: int) -> int:
    """Parameter bytes one decode step reads: all of them, but only ``batch`` rows of an untied embedding."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if cfg.tie_embeddings:  # the table is also the unembedding, read whole
        return total
    embed = params["embed"]
    return total - embed.nbytes + batch * embed.nbytes // embed.shape[0]


def bench_engine(params, cfg, prompts: np.ndarray, kv_dtype: str, steps: int, warmup: int, page_size: int,
                 top_logprobs: int | None, scan_layers: bool = False, tensor: int = 1, expert: int = 1) -> dict:
    """Fill ``len(prompts)`` slots, warm up, time ``steps`` decode steps. Returns the row's figures
    (``prefill_s``: the time to prefill every slot, compiles included; ``compile_s``: the compiles'
    own, ``compiles`` of them)."""
    from hypertron.models.kv_pages import bytes_per_token
    from hypertron.config import EngineConfig, SchedulerConfig
    from hypertron.serve.engine import PagedEngine
    from hypertron.serve.scheduler import Request, Scheduler
    from hypertron.serve.types import SamplingParams

    batch, context = prompts.shape
    new = batch + warmup + steps + 2  # the first slots decode while the later prompts prefill
    pages_per_slot = -(-(context + new) // page_size)
    config = EngineConfig(max_slots=batch, page_size=page_size, num_pages=batch * pages_per_slot + 1,
                          kv_cache_dtype=kv_dtype, max_top_logprobs=top_logprobs or 1, compile="lazy",
                          tensor=tensor, expert=expert)
    engine = PagedEngine(params, cfg, config, scan_layers=scan_layers)
    sched = Scheduler(engine, SchedulerConfig(max_num_batched_tokens=context + batch, max_prefill_rows=1))
    greedy = SamplingParams(temperature=0.0, seed=0, max_tokens=new, logprobs=top_logprobs)
    seqs = [Request(i, p.tolist(), greedy) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)

    def run_step():
        plan = sched.schedule()
        sched.update(plan, engine.run(plan))
        sched.take_outputs()
        return plan

    start = time.perf_counter()
    while any(len(s.generated) == 0 for s in seqs):  # one prompt per step (each fills the budget)
        run_step()
    prefill_s = time.perf_counter() - start
    for _ in range(warmup):
        run_step()
    kv_read, compiled = 0, engine.compiles["sync"]
    start = time.perf_counter()
    for _ in range(steps):  # each step dispatched, then its tokens brought to the host
        kv_read += sum(s.computed for s in seqs)  # tokens each slot attends over, before its new one
        assert len(run_step().decodes) == batch
    elapsed = time.perf_counter() - start
    if engine.compiles["sync"] != compiled:  # a shape the warm-up did not meet (no shape should be new)
        raise RuntimeError(f"a step compiled inside the timed steps (context {context}, {warmup} warm-up steps, "
                           f"page size {page_size})")

    per_token = bytes_per_token(cfg, engine.kv_dtype)
    kv_bytes_per_step = (kv_read + batch * steps) * per_token / steps  # + batch: each slot's new token
    pages_used = sched.stats()["pages_total"] - sched.stats()["pages_free"]
    return {"batch": batch, "kv": kv_dtype, "step_s": elapsed / steps, "prefill_s": prefill_s,
            "tokens_s": batch * steps / elapsed, "kv_bytes_per_token": per_token,
            "kv_bytes_in_use": pages_used * page_size * per_token,
            "bytes_per_step": weight_bytes_per_step(cfg, params, batch) + kv_bytes_per_step,
            "compiles": engine.compiles["sync"], "compile_s": engine.compile_seconds, "tokens0": seqs[0].generated}


def bench_hf(cfg, params, batch_sizes, prompts: np.ndarray, new_tokens: int, dtype, threads: int,
             repeats: int = 3) -> tuple[list[dict], str]:
    """transformers ``generate`` decode tokens/s per batch size, and its versions; ``tokens0`` for prompt 0."""
    import torch
    import transformers

    from hypertron.models.hf import save_hf

    on_gpu = jax.default_backend() == "gpu" and torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(os.path.join(tmp, "model"), cfg, params)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.join(tmp, "model"), dtype=getattr(torch, jnp.dtype(dtype).name)).to(device).eval()

    class Clock(transformers.LogitsProcessor):
        """Called once per new token, after its forward: the gaps from the first call on are decode steps."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            if on_gpu:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    def run(ids):
        """(seconds per decode step, the new tokens) of one ``generate`` call."""
        clock = Clock()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                                 logits_processor=transformers.LogitsProcessorList([clock]))
        return (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1), out[:, ids.shape[1]:]

    rows = []
    for batch in batch_sizes:
        ids = torch.from_numpy(prompts[:batch].astype(np.int64)).to(device)
        runs = [run(ids) for _ in range(repeats + 1)][1:]  # the first is a warm-up
        step_s = float(np.median([t for t, _ in runs]))  # one slow run on a shared CPU should not move it
        rows.append({"batch": batch, "step_s": step_s, "tokens_s": batch / step_s, "tokens0": runs[0][1][0].tolist()})
    where = f"{device}, {torch.get_num_threads()} threads" if device == "cpu" else device
    return rows, f"torch {torch.__version__} ({where}), transformers {transformers.__version__}"


def peak_bandwidth(flag: float | None) -> float | None:
    """Peak HBM bytes/s of this device: the flag, else the table, else None (CPU, unknown GPU)."""
    if flag:
        return flag
    if jax.default_backend() == "cpu":
        return None
    kind = getattr(jax.devices()[0], "device_kind", "")
    return next((bw for name, bw in PEAK_HBM_BW.items() if name in kind), None)


def print_tables(cfg, args, dtype, rows, hf_rows, peak):
    """The hypertron table, then transformers', then the greedy-token agreement."""
    from hypertron.models import count_params

    print(f"decode  {cfg.name} ({count_params(cfg) / 1e6:,.2f}M params, {cfg.num_layers} layers), compute {dtype}, "
          f"context {args.context}, {args.steps} timed steps after {args.warmup} warm-up, page size {args.page_size}")
    roof = lambda r: "n/a" if peak is None else f"{100 * r['bytes_per_step'] / r['step_s'] / peak:.1f}%"
    print_table(COLUMNS, [
        *(("hypertron", r["batch"], r["kv"], r["step_s"] * 1e3, r["tokens_s"], r["kv_bytes_per_token"],
           f"{r['kv_bytes_in_use'] / 2**20:.2f} MiB", roof(r)) for r in rows),
        *(("transformers", r["batch"], jnp.dtype(dtype).name, r["step_s"] * 1e3, r["tokens_s"], "", "", "")
          for r in hf_rows)])
    ours = next((r for r in rows if r["kv"] in ("auto", jnp.dtype(dtype).name)), None)
    if hf_rows and ours is not None:
        a, b = ours["tokens0"], hf_rows[0]["tokens0"]
        n = min(len(a), len(b))
        print(f"greedy tokens of prompt 0, hypertron ({ours['kv']} KV) vs transformers: "
              f"{sum(x == y for x, y in zip(a[:n], b[:n]))}/{n} equal")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("preset", nargs="?", default="tiny")
    p.add_argument("overrides", nargs="*", help="key=value model overrides (num_layers=8)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--kv-dtypes", nargs="+", default=None, help="KV cache dtypes (default: the compute dtype and int8)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens per slot (default 512 on CPU, else half of max_seq_len)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--top-logprobs", type=int, default=None,
                   help="every request asks for this many log-probabilities (default: none, none computed)")
    p.add_argument("--peak-bw", type=float, default=None, help="peak HBM bytes/s (default: H100 3.35e12, H200 4.8e12)")
    p.add_argument("--scan-layers", action="store_true", help="the engine scans the stacked layers (default: unrolled)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    p.add_argument("--tensor", type=int, default=1, help="the engine's tensor-parallel devices (hypertron serve --tensor)")
    p.add_argument("--expert", type=int, default=1, help="the engine's expert-parallel devices (hypertron serve --expert)")
    p.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1, help="default: the number of cores")
    p.add_argument("--profile", action="store_true",
                   help="the serving loop without HTTP, each turn's time by phase (bench/serve_profile.py)")
    p.add_argument("--budget", type=int, default=512, help="--profile: tokens a step (max_num_batched_tokens)")
    p.add_argument("--slots", type=int, help="--profile: the engine's slots, with pages for all (default: the batch)")
    p.add_argument("--trace", default=None, metavar="DIR", help="--profile: a jax.profiler trace of the measured round")
    args = p.parse_args(argv)

    from hypertron.config import ConfigError
    from hypertron.models import init_params, resolve_dtype

    on_cpu = jax.default_backend() == "cpu"
    try:
        cfg = model_config(args.preset, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.context = args.context or (512 if on_cpu else cfg.max_seq_len // 2)
    if args.context + max(args.batch_sizes) + args.warmup + args.steps + 2 >= cfg.max_seq_len:
        print(f"error: context + largest batch + warm-up + steps must stay under max_seq_len={cfg.max_seq_len}",
              file=sys.stderr)
        return 2
    dtype = resolve_dtype(cfg.dtype)
    kv_dtypes = args.kv_dtypes or [dtype.name, "int8"]
    params = init_params(cfg, jax.random.key(0), dtype)
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (max(args.batch_sizes), args.context))

    if args.profile:
        from serve_profile import print_profile, profile_batch  # bench/serve_profile.py

        rows = [profile_batch(params, cfg, b, args.context, args.steps, args.page_size, kv_dtypes[0], args.budget,
                              args.trace and os.path.join(args.trace, f"batch{b}"), scan_layers=args.scan_layers,
                              slots=args.slots)
                for b in args.batch_sizes]
        print(f"{cfg.name}, compute {dtype}, KV {kv_dtypes[0]}, context {args.context}, {args.steps} tokens out, "
              f"page size {args.page_size}, {args.budget} tokens a step")
        print_profile(rows)
        print(f"versions: python {platform.python_version()}, jax {jax.__version__}; device {jax.devices()[0]}")
        print(("command: python bench/serve.py " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip())
        return 0
    rows = []
    for batch in args.batch_sizes:
        for kv in kv_dtypes:
            rows.append(bench_engine(params, cfg, prompts[:batch], kv, args.steps, args.warmup, args.page_size, args.top_logprobs,
                                     scan_layers=args.scan_layers, tensor=args.tensor, expert=args.expert))
            r = rows[-1]
            print(f"  ... batch {batch} {kv}: {r['step_s'] * 1e3:.1f} ms/step, {r['compiles']} compiles in "
                  f"{r['compile_s']:.1f} s", file=sys.stderr)
    hf_rows, hf_versions = [], "transformers: skipped (--no-hf)"
    if not args.no_hf:
        try:
            hf_rows, hf_versions = bench_hf(cfg, params, args.batch_sizes, prompts, args.warmup + args.steps + 1,
                                            dtype, args.torch_threads)
        except ImportError as e:
            hf_versions = f"transformers: skipped ({e})"

    print_tables(cfg, args, dtype, rows, hf_rows, peak_bandwidth(args.peak_bw))
    dev = jax.devices()[0]
    print(f"device: {jax.device_count()} x {getattr(dev, 'device_kind', dev.platform)} "
          f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    print(f"versions: python {platform.python_version()}, jax {jax.__version__}, {hf_versions}")
    print(("command: python bench/serve.py " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
