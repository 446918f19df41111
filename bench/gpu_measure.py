"""The measurements of the GPU campaign's rows (``bench/gpu_campaign.py``), and the sizes they run at.

Each row function takes the tier's :class:`Ctx` and returns its fields; :data:`GPU` and
:data:`SMOKE` are the two sets of sizes (``--smoke``: tiny, on CPU). The campaign's plan, its
runner and the T0/T1 rows are in ``bench/gpu_campaign.py``.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size the tiers use; :data:`GPU` and :data:`SMOKE` differ only here."""

    preset: str = "llama-1b"
    model: tuple[str, ...] = ()  # extra model overrides
    batch: int = 8
    seq: int = 2048
    steps: int = 10
    warmup: int = 2
    doc_len: int = 512  # mean document length of the packed rows
    t0_overrides: tuple[str, ...] = ("model=tiny", "train.global_batch=8", "train.seq_len=128")
    matmul: int = 8192
    copy_elems: int = 2**29  # bf16: 1 GiB read + 1 GiB written
    iters: int = 10
    warm_s: float = 1.0  # seconds of matmuls before the ceilings are timed (clocks up)
    gmm: tuple[int, int, int, int] = (16384, 4096, 14336, 8)  # m = tokens x top_k, k, n, experts (Mixtral)
    ragged: tuple[int, int, int, int, int, int] = (64, 8192, 16, 4, 128, 16)  # batch, ctx, heads, kv, hd, page
    # One mixed serving step of llama-1b's attention (issue 38): decode rows, then one chunk of new
    # tokens, every row at the same context: decode rows, chunk, context, heads, kv, hd, page
    paged: tuple[int, int, int, int, int, int, int] = (16, 2048, 4096, 16, 4, 128, 16)
    # The cuDNN grid (issue 37): dtypes x head dims x sequence lengths, forward + gradients
    cudnn_grid: tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]] = (
        ("bfloat16", "float16"), (64, 100, 128, 160, 192, 256), (2048, 2047))
    decode_batches: tuple[int, int] = (1, 64)
    decode_contexts: tuple[int, int] = (512, 8192)
    decode_steps: int = 16
    decode_max_seq: int = 8192 + 256  # the context, + a token per slot while the others prefill, + the steps
    loop: tuple[int, int, int, int] = (1, 512, 32, 512)  # the serving loop's row: batch, context, tokens out, budget
    t3_seq: int = 4096
    t3_batches: tuple[int, int] = (4, 16)
    moe: tuple[int, int, int, int] = (8192, 2048, 2048, 2)  # tokens, d_model, d_ff, top_k
    moe_experts: tuple[int, ...] = (8, 16, 32, 64)
    t3_decode_batches: tuple[int, ...] = (1, 8, 32, 128)
    t3_decode_context: int = 2048
    # Pallas gmm tilings (tm, tk, tn) for T3 beside the default (128, 64, 64). Measured too much shared
    # memory for Triton (227 KiB a block): (128, 128, 128), (64, 128, 128), (256, 128, 128) on an H100,
    # (128, 64, 128), (128, 32, 128), (256, 64, 64) on an H200; (64, 64, 64) compiled (kernels/gmm.py).
    gmm_tilings: tuple[tuple[int, int, int], ...] = ((64, 64, 64), (128, 32, 64), (64, 128, 64), (64, 64, 128))
    # DLRM-v2: preset, batch, the rows every table is capped at (0: none); MLPerf's shape capped at 10M rows
    # a table holds 38 GiB of tables and row-wise Adagrad state: what one 80 GB GPU holds with room to spare
    dlrm: tuple[str, int, int] = ("dlrm-v2", 16384, 10_000_000)
    budget: float = 480.0  # seconds; per tier: TIER_BUDGET


GPU = Sizes()
SMOKE = Sizes(
    preset="tiny", model=("model.num_layers=1",), batch=2, seq=64, steps=1, warmup=1, doc_len=16,
    t0_overrides=("model=tiny", "model.num_layers=1", "train.global_batch=2", "train.seq_len=32"),
    matmul=128, copy_elems=2**16, iters=1, warm_s=0.0, gmm=(64, 32, 32, 4), ragged=(2, 48, 2, 1, 16, 16),
    paged=(2, 16, 48, 2, 1, 16, 16), cudnn_grid=(("bfloat16",), (64,), (32,)),
    decode_batches=(1, 2), decode_contexts=(16, 40), decode_steps=2, decode_max_seq=128, loop=(1, 16, 4, 32),
    t3_seq=128,
    t3_batches=(1, 4), moe=(64, 32, 32, 2), moe_experts=(4, 8, 16, 32), t3_decode_batches=(1, 2, 3, 4),
    t3_decode_context=16,
    gmm_tilings=((16, 16, 16), (32, 16, 16), (16, 16, 32), (32, 16, 32)), dlrm=("dlrm-v2-tiny", 64, 0),
    budget=float("inf"),
)


class Ctx:
    """What one tier's rows share: sizes, the output folder, measured peaks, kept objects."""

    def __init__(self, tier: str, sizes: Sizes, out: str | None, smoke: bool):
        self.tier, self.s, self.out, self.smoke = tier, sizes, out, smoke
        self.keep: dict = {}
        self.peaks: dict = {}

    def log(self, msg: str) -> None:
        line = f"[{datetime.datetime.now():%H:%M:%S}] {msg}"
        print(line, file=sys.stderr, flush=True)
        if self.out:
            with open(os.path.join(self.out, f"{self.tier}.log"), "a") as f:
                f.write(line + "\n")


def device_row(ctx):
    """The device, and its two ceilings measured here: a bf16 matmul and a device-to-device copy."""
    import jax
    import jax.numpy as jnp

    from gmm import time_fn  # bench/gmm.py: median of synced calls after a warm-up
    from hypertron.models.flops import device_peak_flops
    from serve import peak_bandwidth  # bench/serve.py

    dev = jax.devices()[0]
    n = ctx.s.matmul
    a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in jax.random.split(jax.random.key(0)))
    mm = jax.jit(lambda a, b: a @ b)
    x = jax.random.normal(jax.random.key(1), (ctx.s.copy_elems,), jnp.bfloat16)
    copy = jax.jit(lambda x: x + 1)
    # An idle card sits at a low clock (an H200 here: 345 MHz): a second of matmuls first, or the
    # ceilings read low (2026-11-26: 541-637 TFLOP/s and 2.0-2.8 TB/s against 769-798 and 4.3).
    _busy(mm, (a, b), ctx.s.warm_s)
    t_mm = time_fn(mm, (a, b), ctx.s.iters)
    _busy(copy, (x,), ctx.s.warm_s / 4)
    t_copy = time_fn(copy, (x,), ctx.s.iters)
    ctx.peaks = {"tflops": 2 * n**3 / t_mm / 1e12, "bw": 2 * x.nbytes / t_copy}
    del a, b, x
    driver = None
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        driver = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
    peak, bw = device_peak_flops(), peak_bandwidth(None)
    return {"device_kind": getattr(dev, "device_kind", dev.platform), "device_count": jax.device_count(),
            "driver": driver, "jax": jax.__version__, "python": platform.python_version(),
            "matmul_tflops": ctx.peaks["tflops"], "copy_gbs": ctx.peaks["bw"] / 1e9,
            "datasheet_tflops": None if peak is None else peak / 1e12,
            "datasheet_bw_gbs": None if bw is None else bw / 1e9, "matmul_n": n, "copy_bytes": 2 * 2 * ctx.s.copy_elems}


def _busy(fn, args, seconds: float) -> None:
    """Call ``fn`` back to back for ``seconds`` (at least once), synced at the end."""
    import jax

    end = time.perf_counter() + seconds
    out = fn(*args)
    while time.perf_counter() < end:
        out = fn(*args)
        jax.block_until_ready(out)


def measured_peaks(ctx) -> dict:
    if not ctx.peaks:
        device_row(ctx)
    return ctx.peaks


def packed(batch: dict, mean_len: int, seed: int = 0) -> dict:
    """The same rows cut into documents (lengths ~ geometric, mean ``mean_len``): segment ids
    1, 2, ... and positions restarting at each document, as the packer writes them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = dict(batch)
    seg, pos = np.zeros_like(batch["segment_ids"]), np.zeros_like(batch["positions"])
    for r in range(seg.shape[0]):
        start, doc = 0, 1
        while start < seg.shape[1]:
            n = int(min(rng.geometric(1.0 / mean_len), seg.shape[1] - start))
            seg[r, start:start + n], pos[r, start:start + n] = doc, np.arange(n)
            start, doc = start + n, doc + 1
    out["segment_ids"], out["positions"] = seg, pos
    return out


def train_case(ctx, cfg, *, steps: int, warmup: int, pack: bool = False, keep: str | None = None) -> dict:
    """Compile the sharded train step ahead of time, run ``warmup`` untimed steps, then ``steps``
    with one sync at the end: compile seconds, seconds per step, last loss, peak memory."""
    import jax
    import numpy as np

    from hypertron.data import make_batches
    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.step import make_trainer

    t = cfg.train
    if cfg.lora.rank:  # adapters over a frozen base: random weights held as lora.base_dtype says
        from hypertron.models import init_params, resolve_dtype
        from hypertron.train.lora import hold_base, make_lora_trainer

        trainer = make_lora_trainer(cfg, make_mesh(cfg.mesh))
        state = trainer.init(jax.random.key(0))
        held = trainer.abstract_state()["base"]
        state["base"] = jax.jit(lambda k: hold_base(cfg, init_params(cfg.model, k, resolve_dtype(cfg.model.param_dtype))),
                                out_shardings=jax.tree.map(lambda a: a.sharding, held))(jax.random.key(1))
    else:
        trainer = make_trainer(cfg, make_mesh(cfg.mesh))
        state = trainer.init(jax.random.key(0))
    data = make_batches(source="synthetic", seq_len=t.seq_len, batch_size=t.global_batch, seed=0,
                        vocab_size=cfg.model.vocab_size)
    rows = [next(data) for _ in range(2)]
    if pack:
        rows = [packed(r, ctx.s.doc_len, seed=i) for i, r in enumerate(rows)]
    batches = [trainer.batch(r) for r in rows]  # in the load-balanced order with mesh.context
    start = time.perf_counter()
    step = trainer.step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - start
    metrics = None
    for i in range(warmup):
        state, metrics = step(state, batches[i % 2])
    jax.block_until_ready(state)
    start = time.perf_counter()
    for i in range(steps):
        state, metrics = step(state, batches[i % 2])
    loss = float(metrics["loss"])
    step_s = (time.perf_counter() - start) / max(steps, 1)
    if not np.isfinite(loss):
        raise FloatingPointError(f"loss is {loss}")
    stats = jax.devices()[0].memory_stats() or {}
    plan = step.memory_analysis()  # the compiler's plan for this step: per row, unlike the allocator's peak
    xla_bytes = (plan.argument_size_in_bytes + plan.output_size_in_bytes - plan.alias_size_in_bytes
                 + plan.temp_size_in_bytes)
    if keep:
        ctx.keep[keep] = (step, state, batches)
    return {"compile_s": compile_s, "step_s": step_s, "loss": loss, "xla_mem_gib": xla_bytes / 2**30,
            "peak_mem_gib": stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None}


TRAIN_FIELDS = ("preset", "params_m", "batch", "seq", "remat", "attention", "quantization", "packed", "compile_s",
                "step_ms", "tokens_s", "tflops", "mfu_measured", "mfu_datasheet", "xla_mem_gib", "plan_mem_gib",
                "peak_mem_gib", "loss")


def plan_memory_gib(cfg) -> float | None:
    """What ``hypertron plan`` predicts a device needs for ``cfg`` on this host's devices (the
    memory model of :mod:`hypertron.models.memory`), to set beside the compiled step's
    ``xla_mem_gib``; None on an accelerator the hardware table lacks."""
    import jax

    from hypertron.hardware import match
    from hypertron.models.plan import plan

    dev = jax.devices()[0]
    hw = match(getattr(dev, "device_kind", "")) if dev.platform != "cpu" else None
    name = "cpu" if dev.platform == "cpu" else (hw.name if hw else None)
    if name is None:
        return None
    n = jax.device_count()
    return plan(cfg, name, devices=n, per_node=n).memory.total / 2**30


def train_row(overrides=(), *, pack=False, quant="none", shape=None, keep=None, base=None, lora=None):
    """A training row: ``llama-1b`` (``tiny`` in smoke mode) with ``overrides``; ``shape``: sizes ->
    (batch, seq), default the tier's; ``base``: the row whose step time this one is compared with
    (adds ``vs_base``); ``lora``: a ``lora.base_dtype``: rank-16 adapters on every projection over
    a frozen base so held (its FLOPs counted as full training's, so ``tflops`` and MFU overstate
    the work: compare ``step_ms``, ``xla_mem_gib`` and ``plan_mem_gib``)."""

    def run(ctx):
        import jax

        from hypertron.config import load_config
        from hypertron.models import count_params, resolve_dtype
        from hypertron.models.attention import attention_impl
        from hypertron.models.flops import device_peak_flops, train_flops_per_token

        s = ctx.s
        batch, seq = shape(s) if shape else (s.batch, s.seq)
        cfg = load_config(None, [f"model={s.preset}", *s.model,
                                 "data.source=" + ("stdlib" if pack else "synthetic"),
                                 f"train.global_batch={batch}", f"train.seq_len={seq}",
                                 "model.remat=dots", f"model.quantization={quant}", *overrides,
                                 *(() if lora is None else ("lora.rank=16", "lora.alpha=32", f"lora.base_dtype={lora}",
                                                            "train.init_from=random"))])
        r = train_case(ctx, cfg, steps=s.steps, warmup=s.warmup, pack=pack, keep=keep)
        t, n_dev = cfg.train, jax.device_count()
        tokens = t.global_batch * t.seq_len
        tflops = train_flops_per_token(cfg.model, t.seq_len) * tokens / r["step_s"] / n_dev / 1e12
        fmt = {"none": "bf16"}.get(quant, quant)
        peak = device_peak_flops(0.0, fmt=fmt)
        out = {"preset": cfg.model.name, "params_m": count_params(cfg.model) / 1e6, "batch": t.global_batch,
               "seq": t.seq_len, "remat": cfg.model.remat,
               "attention": attention_impl(cfg.model, resolve_dtype(cfg.model.dtype), t.seq_len),
               "quantization": quant if lora is None else f"lora, base {lora}", "packed": pack, "compile_s": r["compile_s"], "step_ms": r["step_s"] * 1e3,
               "tokens_s": tokens / r["step_s"] / n_dev, "tflops": tflops,
               "mfu_measured": tflops / measured_peaks(ctx)["tflops"],
               "mfu_datasheet": None if peak is None else tflops * 1e12 / peak,
               "xla_mem_gib": r["xla_mem_gib"], "plan_mem_gib": plan_memory_gib(cfg), "peak_mem_gib": r["peak_mem_gib"],
               "loss": r["loss"]}
        if quant != "none":
            bf16 = device_peak_flops()
            out["emfu_datasheet"] = None if bf16 is None else tflops * 1e12 / bf16
        if base is not None:
            ref = ctx.keep.get("step_ms", {}).get(base)
            if ref is None:
                raise RuntimeError(f"needs row {base} in the same run (add it to --only)")
            out["vs_base"] = ref / out["step_ms"]
        ctx.keep.setdefault("step_ms", {})[ROW_ID[run]] = out["step_ms"]
        return out

    return run


ROW_ID: dict = {}  # run function -> row id, for rows that look themselves up


def profile_row(ctx):
    """The compiled HLO of the dots step (gzip) and a profile of two steps (tar.gz), each
    under 16 MiB, for offline work."""
    import jax

    if "dots" not in ctx.keep:
        train_row(keep="dots")(ctx)
    step, state, batches = ctx.keep.pop("dots")
    out = ctx.out or tempfile.mkdtemp()
    hlo_path = os.path.join(out, f"{ctx.tier}_step_hlo.txt.gz")
    with gzip.open(hlo_path, "wt") as f:
        f.write(step.as_text())
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        for i in range(2):
            state, metrics = step(state, batches[i % 2])
        jax.block_until_ready(metrics)
    trace_path = os.path.join(out, f"{ctx.tier}_profile.tar.gz")
    with tarfile.open(trace_path, "w:gz") as tar:
        tar.add(trace_dir, arcname="profile")
    note = "ok"
    if os.path.getsize(trace_path) > 15 * 2**20:
        note = f"profile of {os.path.getsize(trace_path) / 2**20:.1f} MiB dropped (over 15 MiB)"
        os.remove(trace_path)
    del step, state, batches
    return {"hlo_file": os.path.basename(hlo_path), "hlo_bytes": os.path.getsize(hlo_path),
            "trace_file": os.path.basename(trace_path) if note == "ok" else note,
            "trace_bytes": os.path.getsize(trace_path) if note == "ok" else 0}


MONITOR_FIELDS = ("interval_s", "steps", "samples", "step_ms_off", "step_ms_on", "cost_pct", "device_memory_used_gib",
                  "device_memory_peak_gib", "device_memory_limit_gib", "gpu_utilization", "gpu_power_watts",
                  "gpu_temperature_celsius", "h2d_gbs")


def monitor_row(ctx):
    """The monitor's collector (what ``hypertron train`` runs in each process) sampling while the
    kept ``llama-1b`` step trains: the NVML and device-memory figures it reads, and what it costs.
    Each step is synced and timed, ``steps`` without the collector, then ``steps`` with it (every
    0.5 s, a host-to-device copy of 8 MiB timed at each sample: 20 times the default rate and
    more); ``cost_pct`` compares the medians. Figures are the largest of the samples."""
    import statistics

    import jax

    from hypertron.config import MonitorConfig
    from hypertron.monitor.collector import Collector
    from hypertron.runfiles import host_metrics_path

    if "dots" not in ctx.keep:
        train_row(keep="dots")(ctx)
    step, state, batches = ctx.keep["dots"]
    n = max(ctx.s.steps, 4)
    interval = 0.5

    def run(steps, collector=None):
        nonlocal state
        times = []
        for i in range(steps):
            t = time.perf_counter()
            state, metrics = step(state, batches[i % 2])
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t)
            if collector is not None:
                collector.scalars(i + 1, {"step_time": times[-1], "data_wait": 0.0, "loss": None})
        return statistics.median(times)

    run(1)
    off = run(n)
    with tempfile.TemporaryDirectory() as d:
        collector = Collector(d, MonitorConfig(interval=interval, h2d_every=1, h2d_bytes=8 << 20), process_index=0)
        collector.begin(0, n)
        try:
            on = run(n, collector)
        finally:
            collector.finish("completed")
        with open(host_metrics_path(d, 0)) as f:
            samples = [json.loads(line) for line in f]
    ctx.keep["dots"] = (step, state, batches)

    def largest(key, scale=1.0):
        xs = [r[key] for r in samples if r.get(key) is not None]
        return max(xs) / scale if xs else None

    h2d = [r["h2d_bytes"] / r["h2d_seconds"] / 1e9 for r in samples if r.get("h2d_seconds")]
    return {"interval_s": interval, "steps": n, "samples": len(samples), "step_ms_off": off * 1e3,
            "step_ms_on": on * 1e3, "cost_pct": 100 * (on / off - 1),
            "device_memory_used_gib": largest("device_memory_used_bytes", 2**30),
            "device_memory_peak_gib": largest("device_memory_peak_bytes", 2**30),
            "device_memory_limit_gib": largest("device_memory_limit_bytes", 2**30),
            "gpu_utilization": largest("gpu_utilization"), "gpu_power_watts": largest("gpu_power_watts"),
            "gpu_temperature_celsius": largest("gpu_temperature_celsius"),
            "h2d_gbs": statistics.median(h2d) if h2d else None}


GMM_FIELDS = ("backend", "m", "k", "n", "groups", "tiling", "fwd_ms", "fwd_tflops", "fwd_pct_dense", "fwdbwd_ms",
              "fwdbwd_tflops", "fwdbwd_pct_dense")


def gmm_row(backend: str, tiling_index: int | None = None):
    """A grouped-matmul backend at the tier's MoE size, as % of one dense matmul of the same FLOPs;
    ``tiling_index``: the Pallas kernel at ``Sizes.gmm_tilings[tiling_index]`` (else its default)."""

    def run(ctx):
        import jax.numpy as jnp

        from gmm import measure  # bench/gmm.py
        from hypertron.kernels.gmm import DEFAULT_TILING

        m, k, n, g = ctx.s.gmm
        tiling = None if tiling_index is None else ctx.s.gmm_tilings[tiling_index]
        cache = ctx.keep.setdefault("gmm", {})  # the dense reference, once (tiling does not change it)
        if "dense" not in cache:
            rows = measure(m, k, n, [g], ["even"], [], jnp.bfloat16, ctx.s.iters, tiling=tiling)
            cache["dense"] = rows[0][3:]
        if backend == "dense":
            t_fwd, t_bwd = cache["dense"]
        else:
            (_, _, _, t_fwd, t_bwd), = measure(m, k, n, [g], ["even"], [backend], jnp.bfloat16, ctx.s.iters,
                                               tiling=tiling)[1:]
            if t_fwd is None:
                raise RuntimeError(f"{backend} failed (its error is in the log)")
        d_fwd, d_bwd = cache["dense"]
        flops = 2 * m * k * n
        return {"backend": backend, "m": m, "k": k, "n": n, "groups": g, "tiling": list(tiling or DEFAULT_TILING),
                "fwd_ms": t_fwd * 1e3, "fwd_tflops": flops / t_fwd / 1e12, "fwd_pct_dense": 100 * d_fwd / t_fwd,
                "fwdbwd_ms": t_bwd * 1e3, "fwdbwd_tflops": 3 * flops / t_bwd / 1e12,
                "fwdbwd_pct_dense": 100 * d_bwd / t_bwd}
    return run


def _decode_model(ctx):
    """The decode rows' model, made once per tier: ``preset`` in bf16, random weights."""
    import jax
    import jax.numpy as jnp

    from hypertron.models import init_params
    from serve import model_config  # bench/serve.py

    if "decode_model" not in ctx.keep:
        s = ctx.s
        cfg = model_config(s.preset, [*s.model, f"max_seq_len={s.decode_max_seq}", "dtype=bfloat16"])
        ctx.keep["decode_model"] = (cfg, init_params(cfg, jax.random.key(0), jnp.bfloat16))
    return ctx.keep["decode_model"]


DECODE_FIELDS = ("preset", "batch", "kv", "context", "prefill_s", "step_ms", "tokens_s", "bytes_per_step",
                 "bw_fraction_measured", "bw_fraction_datasheet")


def decode_row(batch_index: int, kv: str, context_index: int | None, *, t3: bool = False):
    """Decode through the scheduler and the paged engine: bf16 weights, every slot prefilled with
    the same prompt (``prefill_s``: all of them, compiles included), then timed decode steps, no
    log-probabilities (bench/serve.py's ``bench_engine``)."""

    def run(ctx):
        import numpy as np

        from serve import bench_engine, peak_bandwidth  # bench/serve.py

        s = ctx.s
        batch = (s.t3_decode_batches if t3 else s.decode_batches)[batch_index]
        context = s.t3_decode_context if t3 else s.decode_contexts[context_index]
        cfg, params = _decode_model(ctx)
        prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, (1, context))
        r = bench_engine(params, cfg, np.repeat(prompt, batch, 0), kv, s.decode_steps, 2, 16, None)
        peak = peak_bandwidth(None)
        gc.collect()
        return {"preset": cfg.name, "batch": batch, "kv": kv, "context": context,
                "prefill_s": r["prefill_s"], "step_ms": r["step_s"] * 1e3, "tokens_s": r["tokens_s"],
                "bytes_per_step": r["bytes_per_step"],
                "bw_fraction_measured": r["bytes_per_step"] / r["step_s"] / measured_peaks(ctx)["bw"],
                "bw_fraction_datasheet": None if peak is None else r["bytes_per_step"] / r["step_s"] / peak}
    return run


LOOP_FIELDS = ("preset", "batch", "context", "tokens_s", "ms_turn", "launch_ms", "wait_ms", "host_ms")


def loop_row(ctx):
    """The serving loop at ``Sizes.loop``'s batch and tokens a step (``bench/serve.py --profile``: the engine readied
    as ``hypertron serve`` readies it, no HTTP, greedy): a turn's time, and of it ``launch_ms`` (the
    compiled step queued), ``wait_ms`` (the previous step's outputs reaching the host) and
    ``host_ms`` (the rest: scheduling, assembling, updating, delivering). A launch that waits for
    the device shows as ``launch_ms`` near the turn and ``wait_ms`` near 0: the sampler's
    conditional did that on a GPU (2026-11-27, docs/benchmarks.md)."""
    from serve_profile import profile_batch  # bench/serve_profile.py

    batch, context, steps, budget = ctx.s.loop
    cfg, params = _decode_model(ctx)
    r = profile_batch(params, cfg, batch, context, steps, 16, "bfloat16", budget, None)
    phases = r["phases"]
    gc.collect()
    return {"preset": cfg.name, "batch": batch, "context": context, "tokens_s": r["tokens_s"], "ms_turn": r["ms_turn"],
            "launch_ms": phases["launch"], "wait_ms": phases["wait"],
            "host_ms": sum(v for k, v in phases.items() if k not in ("launch", "wait"))}


LAYERS_FIELDS = ("preset", "layers", "scan_layers", "batch", "context", "compiles", "compile_s", "prefill_s", "step_ms",
                 "tokens_s", "vs_unrolled")


def layers_row(scan_layers: bool):
    """The paged engine with its layers unrolled (per-layer weights, the default) or scanned
    (``scan_layers=True``): its compiles' seconds from nothing (no step shared with an earlier
    engine) and its decode step, at batch 1 and the T3 decode context. ``vs_unrolled``: the
    unrolled row's step time over this one's (needs that row in the same run)."""

    def run(ctx):
        import numpy as np

        from hypertron.serve.engine import clear_shared_executables
        from serve import bench_engine  # bench/serve.py

        s = ctx.s
        cfg, params = _decode_model(ctx)
        prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, (1, s.t3_decode_context))
        clear_shared_executables()
        r = bench_engine(params, cfg, prompt, "bfloat16", s.decode_steps, 2, 16, None, scan_layers=scan_layers)
        step_ms = r["step_s"] * 1e3
        if not scan_layers:
            ctx.keep["unrolled_ms"] = step_ms
        elif "unrolled_ms" not in ctx.keep:
            raise RuntimeError("needs row t3.serve.layers.unrolled in the same run (add it to --only)")
        gc.collect()
        return {"preset": cfg.name, "layers": cfg.num_layers, "scan_layers": scan_layers, "batch": 1,
                "context": s.t3_decode_context, "compiles": r["compiles"], "compile_s": r["compile_s"],
                "prefill_s": r["prefill_s"], "step_ms": step_ms, "tokens_s": r["tokens_s"],
                "vs_unrolled": ctx.keep["unrolled_ms"] / step_ms}
    return run


MOE_FIELDS = ("tokens", "d_model", "d_ff", "experts", "top_k", "backend", "step_ms", "tokens_s", "vs_e_first",
              "expert_tflops")


def moe_row(index: int):
    def run(ctx):
        import jax.numpy as jnp

        from hypertron.config import PRESETS
        from hypertron.kernels.gmm import resolve_backend
        from moe import bench_layer, layer_config  # bench/moe.py

        tokens, d, f, top_k = ctx.s.moe
        experts = ctx.s.moe_experts[index]
        cfg = layer_config(PRESETS["tiny-moe"], d, f, experts, top_k, "dropless")
        seconds, _ = bench_layer(cfg, tokens, jnp.bfloat16, ctx.s.iters)
        per = ctx.keep.setdefault("moe", {})
        per[index] = tokens / seconds
        first = per.get(0)
        if first is None:
            raise RuntimeError("needs the first expert count in the same run (add it to --only)")
        return {"tokens": tokens, "d_model": d, "d_ff": f, "experts": experts, "top_k": top_k,
                "backend": resolve_backend(cfg.moe.gmm_backend), "step_ms": seconds * 1e3,
                "tokens_s": tokens / seconds, "vs_e_first": tokens / seconds / first,
                "expert_tflops": 3 * 2 * 3 * tokens * top_k * d * f / seconds / 1e12}
    return run


DLRM_FIELDS = ("preset", "table_rows_cap", "params_m", "table_gib", "batch", "compile_s", "route_ms", "step_ms",
               "samples_s", "loss")


def dlrm_row(ctx):
    """DLRM-v2 training on one device (hypertron only): samples/s, and the host's routing per step."""
    from dlrm import _config, measure  # bench/dlrm.py

    from hypertron.recsys import dlrm
    from hypertron.recsys.data import synthetic_batch

    preset, batch, cap = ctx.s.dlrm
    cfg = _config(preset, batch, cap or None)
    sizes = dlrm.sizes(cfg.dlrm)
    batches = [synthetic_batch(i, cfg=cfg.dlrm, batch_size=batch, seed=0) for i in range(2)]
    m = measure(cfg, batches, ctx.s.steps, warmup=ctx.s.warmup)
    return {"preset": preset, "table_rows_cap": cap, "params_m": sizes["params"] / 1e6,
            "table_gib": (sizes["param_bytes"] + sizes["optimizer_bytes"]) / 2**30, "batch": batch,
            "compile_s": m["compile_s"], "route_ms": m["route_ms"], "step_ms": m["step_ms"],
            "samples_s": m["samples_s"], "loss": m["loss"]}
