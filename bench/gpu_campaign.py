"""The GPU campaign: tiered, time-boxed runs that prove every GPU path and measure every GPU figure.

    python bench/gpu_campaign.py TIER --out DIR [--smoke] [--only ROW_PREFIX ...] [--budget S] [--wheels DIR]
    python bench/gpu_campaign.py TIER --plan          # the row ids TIER writes, one per line

TIER is one of:

- ``T0`` (about a minute): hypertron importable (with ``--wheels DIR``: the carried wheels and
  hypertron itself installed with ``--no-deps`` first), every module imported, one bf16 train
  step. Exits 3 naming any module that is missing.
- ``T1`` (at most 5 minutes): ``pytest -m gpu`` (the Pallas kernels compiled for the GPU, cuDNN
  attention, bf16 Hugging Face and engine parity, fp8 GEMMs in the train step), grouped into
  rows, and which XLA flags of the GPU recipes this XLA accepts.
- ``T2`` (at most 8 minutes): the headline figures. Device header with the measured bf16 matmul
  rate and copy bandwidth; ``llama-1b`` training at seq 2048 (remat dots and none; synthetic rows
  and packed rows with segment ids) with MFU against the datasheet and the measured peak, and
  ``hypertron plan``'s memory prediction beside the compiled step's; the monitor's collector
  (NVML, device memory, its cost) while that step trains; bf16 vs fp8 vs int8 training; the
  grouped matmul (Pallas) vs ``ragged_dot`` vs dense at one MoE size;
  the ragged decode-attention kernel vs its reference; one mixed serving step's attention by the
  paged kernel, its reference and cuDNN (``t2.paged``); which shapes cuDNN's fused attention takes
  against ``cudnn_supported`` (``t2.cudnn_grid``); decode at batch 1 and 64, bf16 and int8
  KV, 512 and 8k context, as a fraction of the measured copy bandwidth; the compiled HLO and a
  profile of the ``llama-1b`` step.
- ``T3`` (sweeps, in pieces with ``--only``): seq 4096, batch sizes, remat full, MoE 8 -> 64
  experts, decode vs batch, the serving engine's layers unrolled vs scanned (compile seconds and
  the decode step), the grouped-matmul row tile; DLRM-v2 training (MLPerf's shape, tables
  capped at 10M rows: 38 GiB with row-wise Adagrad) samples/s on one GPU; SDXL-base and Flux-dev
  at 1024x1024 bf16 against diffusers (``t3.diffuse``, ``bench/diffuse_gpu.py``; a call of their own).

Each row is written to ``DIR/<TIER>.json`` as soon as it finishes (so a run cut off at its time
limit still returns what finished), progress and tracebacks to ``DIR/<TIER>.log``; a short table
is printed last. ``--budget`` (default: :data:`TIER_BUDGET`, 2 to 8 minutes) skips the rows left when it runs
out; rerun them with ``--only``. A row that fails records its error in one line and the tier goes
on. ``--smoke`` runs every row at tiny sizes on CPU (Pallas in interpret mode): the rows and
their fields are the same in both modes, only the sizes differ; ``tests/test_gpu_campaign.py``
runs it in ``make test``. Fields that only a known accelerator can fill (the datasheet peak, the
driver, the allocator's peak memory) are null elsewhere: :data:`HARDWARE_FIELDS`. The T2 and T3
measurements and the two sets of sizes are in ``bench/gpu_measure.py`` (the attention rows in
``bench/gpu_attention.py``); the plan, the runner and
T0/T1 here. ``peak_mem_gib`` is
the allocator's peak over the process so far (it has no reset); ``xla_mem_gib`` is the compiled
step's own plan (arguments + outputs - donated + temporaries).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import importlib
import json
import os
import pkgutil
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from typing import Callable

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
# The recipes are this checkout's: hypertron installed by --wheels into a site folder has none
# beside it (hypertron.launch.recipes.root() looks next to the package).
os.environ.setdefault("HYPERTRON_RECIPES", os.path.join(REPO, "recipes"))
# JAX takes 75 % of the GPU by default; the recipes give it 90 %. 2026-11-25 on an H100 at 75 %,
# t2.train.none (XLA: at least 60.8 GiB) and t3.train.batch16 ran out of memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

from gpu_measure import (  # noqa: E402  (bench/gpu_measure.py: the T2 and T3 measurements, and the sizes)
    DECODE_FIELDS, DLRM_FIELDS, GMM_FIELDS, GPU, LAYERS_FIELDS, LOOP_FIELDS, MONITOR_FIELDS, MOE_FIELDS, ROW_ID, SMOKE,
    TRAIN_FIELDS, Ctx, Sizes, decode_row, device_row, dlrm_row, gmm_row, layers_row, loop_row, monitor_row, moe_row,
    profile_row, train_case, train_row,
)
from gpu_attention import (  # noqa: E402  (bench/gpu_attention.py: the attention rows)
    CUDNN_FIELDS, PAGED_FIELDS, RAGGED_FIELDS, cudnn_grid_row, paged_row, ragged_row,
)

from diffuse_gpu import FIELDS as DIFFUSE_FIELDS  # noqa: E402  (bench/diffuse_gpu.py: SDXL and Flux-dev)
from diffuse_gpu import FP8_FIELDS as DIFFUSE_FP8_FIELDS  # noqa: E402
from diffuse_gpu import diffuse_fp8_row, diffuse_row  # noqa: E402

TIERS = ("T0", "T1", "T2", "T3")
TIER_BUDGET = {"T0": 120.0, "T1": 300.0, "T2": 480.0, "T3": 480.0}  # seconds on a device, inside one 10-minute call
HARDWARE_FIELDS = frozenset({"driver", "datasheet_tflops", "datasheet_bw_gbs", "mfu_datasheet", "emfu_datasheet",
                             "bw_fraction_datasheet", "peak_mem_gib", "device_memory_used_gib",
                             "device_memory_peak_gib", "device_memory_limit_gib", "gpu_utilization",
                             "gpu_power_watts", "gpu_temperature_celsius", "diffusers_peak_mem_gib"})

# Other spellings of the recipes' XLA flags that XLA versions use (a flag renamed, one retired):
# with the recipes' own, T1 records which of each this XLA accepts, since an unknown flag aborts
# the process at start.
OTHER_SPELLINGS = (
    ("--xla_gpu_graph_level=0", "no CUDA graphs (XLA before --xla_gpu_enable_command_buffer)"),
    ("--xla_gpu_pipeline_all_gather=on", "newer XLA's --xla_gpu_enable_pipelined_all_gather=true"),
    ("--xla_gpu_pipeline_reduce_scatter=on", "newer XLA's --xla_gpu_enable_pipelined_reduce_scatter=true"),
    ("--xla_gpu_pipeline_all_reduce=on", "newer XLA's --xla_gpu_enable_pipelined_all_reduce=true"),
    ("--xla_gpu_enable_triton_softmax_fusion=false", "older recipes: no Triton softmax fusion"),
)


def recipe_xla_flags() -> tuple[tuple[str, str], ...]:
    """The XLA flags of every GPU recipe (recipes/<machine>/<model>.yaml of this checkout), each
    once, then :data:`OTHER_SPELLINGS`. Called when T1 runs, not at import: before ``--wheels``
    has installed hypertron, this script must still start (2026-11-25: it did not)."""
    from hypertron.config import load_config
    from hypertron.launch import recipes

    flags: dict[str, str] = {}
    for name in recipes.names():
        cfg = load_config(recipes.path_of(name))
        if cfg.launch.machine != "cpu":
            flags.update((f.value, f.reason) for f in cfg.launch.xla_flags if f.value not in flags)
    if not flags:  # 2026-11-25 on the GPU: none found, and T1 "tested" only OTHER_SPELLINGS
        raise RuntimeError(f"no GPU recipe's XLA flags found under {recipes.root()}")
    return tuple(flags.items()) + OTHER_SPELLINGS

# T1: which group a test of the ``gpu`` selection reports under: (group, file, test-name prefix).
T1_GROUPS = (
    ("gmm", "test_gmm.py", ""),
    ("ragged_attention", "test_ragged_attention.py", ""),
    ("cudnn_attention", "test_gpu.py", "test_cudnn"),
    ("fp8_gemm", "test_gpu.py", "test_fp8"),
    ("fp8_gemm", "test_quant_train.py", "test_compiled_matmuls"),
    ("hf_parity_bf16", "test_hf.py", "test_logits_match_in_bf16"),
    ("engine_parity_bf16", "test_hf.py", "test_engine_in_bf16"),
    ("engine_parity_bf16", "test_engine.py", ""),
)
T1_FILES = tuple(dict.fromkeys(f"tests/{f}" for _, f, _ in T1_GROUPS))
# Smoke mode runs one test of each group (the whole selection is in make test already): the machinery,
# not the numbers.
T1_SMOKE_K = ("(test_edge_cases and pallas) or test_bad_arguments_are_refused or test_cudnn_is_what or test_fp8"
              " or (test_logits_match_in_bf16 and llama2) or (test_engine_in_bf16 and llama2 and bfloat16)")


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    fields: tuple[str, ...]
    run: Callable  # (ctx) -> dict of fields


# ---------------------------------------------------------------------------
# T0: install, import everything, one bf16 step


def install(wheels: str) -> None:
    """Install the carried wheels and hypertron (``--no-deps``) into a site folder, then re-run
    this command with it on PYTHONPATH (once: the environment marks it done)."""
    if os.environ.get("HYPERTRON_CAMPAIGN_SITE"):
        return
    site = os.path.join(tempfile.gettempdir(), "hypertron-site")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", site]
    found = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if found and subprocess.run(pip + found).returncode != 0:
        sys.exit(f"error: installing the {len(found)} wheels of {wheels} failed (pip's message above)")
    # hypertron itself, --no-deps, built with the setuptools already there; else the checkout is the package.
    built = subprocess.run(pip + ["--no-build-isolation", REPO], capture_output=True, text=True)
    path = [site] if built.returncode == 0 else [site, REPO]
    env = dict(os.environ, HYPERTRON_CAMPAIGN_SITE=site, HYPERTRON_CAMPAIGN_WHEELS=str(len(found)),
               HYPERTRON_CAMPAIGN_INSTALL="pip --no-deps" if built.returncode == 0 else
               "checkout on PYTHONPATH (pip: " + (built.stderr.strip().splitlines() or ["?"])[-1][:160] + ")",
               PYTHONPATH=os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def t0_install(ctx):
    import jax
    import jaxlib

    import hypertron

    dev = jax.devices()[0]
    return {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "backend": jax.default_backend(), "device_kind": getattr(dev, "device_kind", dev.platform),
            "device_count": jax.device_count(), "hypertron": os.path.dirname(hypertron.__file__),
            "install": os.environ.get("HYPERTRON_CAMPAIGN_INSTALL", "already importable"),
            "wheels": int(os.environ.get("HYPERTRON_CAMPAIGN_WHEELS", "0"))}


def t0_imports(ctx):
    import hypertron

    names = sorted(m.name for m in pkgutil.walk_packages(hypertron.__path__, "hypertron."))
    missing, broken = set(), []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            missing.add(e.name or name)
            broken.append(f"{name}: no module {e.name}")
        except Exception as e:  # noqa: BLE001  (an API that moved in this JAX, say: record it)
            broken.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    ctx.keep["missing"] = sorted(missing)
    return {"modules": len(names), "imported": len(names) - len(broken), "missing": sorted(missing),
            "broken": broken}


def t0_train_step(ctx):
    import jax

    from hypertron.config import load_config
    from hypertron.models.attention import attention_impl
    from hypertron.models import resolve_dtype

    if ctx.keep.get("missing"):
        raise RuntimeError("skipped: modules missing: " + ", ".join(ctx.keep["missing"]))
    cfg = load_config(None, [*ctx.s.t0_overrides, "data.source=synthetic", "model.dtype=bfloat16"])
    r = train_case(ctx, cfg, steps=1, warmup=0)
    return {"preset": cfg.model.name, "dtype": str(resolve_dtype(cfg.model.dtype)),
            "attention": attention_impl(cfg.model, resolve_dtype(cfg.model.dtype), cfg.train.seq_len),
            "backend": jax.default_backend(), "compile_s": r["compile_s"], "loss": r["loss"]}


# ---------------------------------------------------------------------------
# T1: the GPU test selection, and the recipes' XLA flags


def t1_xla_flags(ctx):
    """One process with every flag: XLA names each unknown one in a single line and aborts."""
    flags = [f for f, _ in recipe_xla_flags()]
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags))
    r = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300)
    rejected = []
    if r.returncode != 0:
        # "Unknown flag in XLA_FLAGS: F" for one, "Unknown flags in XLA_FLAGS: F G" for several
        line = next((m for ln in r.stderr.splitlines() if (m := re.search(r"Unknown flags? in XLA_FLAGS:(.*)", ln))),
                    None)
        if line is not None:
            rejected = line.group(1).split()
        else:  # some other refusal (a bad value): try each flag alone
            for f in flags:
                one = subprocess.run(probe, env=dict(os.environ, XLA_FLAGS=f), capture_output=True, timeout=300)
                rejected += [f] if one.returncode else []
    return {"tested": len(flags), "accepted": [f for f in flags if f not in rejected], "rejected": rejected}


def t1_pytest(ctx):
    """Run the ``gpu`` selection once; rows per group come from its JUnit report."""
    if "junit" not in ctx.keep:
        report = os.path.join(tempfile.mkdtemp(), "junit.xml")
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        if ctx.out:  # a failing fp8 test leaves its compiled HLO here (tests/test_gpu.py matmul_summary)
            env["HYPERTRON_GPU_ARTIFACTS"] = os.path.abspath(ctx.out)
        if not ctx.smoke:
            env["JAX_PLATFORMS"] = "cuda"  # the tests' conftest would otherwise pick the CPU
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", "-rfEs",
               f"--junitxml={report}", *(["-k", T1_SMOKE_K] if ctx.smoke else []), *T1_FILES]
        ctx.log("$ " + " ".join(cmd[2:]))
        ctx.keep["junit"], ctx.keep["pytest_rc"] = {}, "timeout"
        with open(os.path.join(ctx.out, "T1.log") if ctx.out else os.devnull, "a") as f:
            try:  # the pytest summary lines go to T1.log; the JUnit report carries the outcomes
                proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                      timeout=max(60.0, remaining(ctx)))
            except subprocess.TimeoutExpired:
                return ctx.keep["junit"]
        ctx.keep["junit"] = parse_junit(report) if os.path.exists(report) else {}
        ctx.keep["pytest_rc"] = proc.returncode
    return ctx.keep["junit"]


def parse_junit(path: str) -> dict:
    """{group: {selected, passed, failed, skipped, failures}} from pytest's JUnit XML."""
    groups = {g: {"selected": 0, "passed": 0, "failed": 0, "skipped": 0, "failures": []} for g, _, _ in T1_GROUPS}
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("classname", "").split(".")[-1] + ".py"
        name = case.get("name", "")
        group = next((g for g, f, prefix in T1_GROUPS if f == file and name.startswith(prefix)), None)
        if group is None:
            continue
        g = groups[group]
        g["selected"] += 1
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            g["failed"] += 1
            g["failures"].append(f"{file}::{name}: {(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}")
        elif case.find("skipped") is not None:
            g["skipped"] += 1
        else:
            g["passed"] += 1
    return groups


def t1_group(group):
    def run(ctx):
        result = t1_pytest(ctx).get(group)
        if result is None:
            raise RuntimeError(f"pytest wrote no report (exit {ctx.keep.get('pytest_rc')}; see T1.log)")
        if result["failed"]:
            ctx.keep.setdefault("t1_failed", []).append(group)
        return result
    return run


# ---------------------------------------------------------------------------
# Shared measurements


def remaining(ctx) -> float:
    return ctx.s.budget - (time.monotonic() - ctx.keep["start"])


# ---------------------------------------------------------------------------
# The plan: the same rows and fields in every mode


def plan(tier: str) -> list[Row]:
    dev_fields = ("device_kind", "device_count", "driver", "jax", "python", "matmul_tflops", "copy_gbs",
                  "datasheet_tflops", "datasheet_bw_gbs", "matmul_n", "copy_bytes")
    if tier == "T0":
        return [
            Row("t0.install", ("python", "jax", "jaxlib", "backend", "device_kind", "device_count", "hypertron",
                               "install", "wheels"), t0_install),
            Row("t0.imports", ("modules", "imported", "missing", "broken"), t0_imports),
            Row("t0.train_step", ("preset", "dtype", "attention", "backend", "compile_s", "loss"), t0_train_step),
        ]
    if tier == "T1":
        groups = dict.fromkeys(g for g, _, _ in T1_GROUPS)
        return [Row("t1.xla_flags", ("tested", "accepted", "rejected"), t1_xla_flags)] + [
            Row(f"t1.pytest.{g}", ("selected", "passed", "failed", "skipped", "failures"), t1_group(g))
            for g in groups]
    if tier == "T2":
        rows = [
            Row("t2.device", dev_fields, device_row),
            Row("t2.train.dots", TRAIN_FIELDS, train_row(keep="dots")),
            Row("t2.monitor", MONITOR_FIELDS, monitor_row),
            Row("t2.profile", ("hlo_file", "hlo_bytes", "trace_file", "trace_bytes"), profile_row),
            Row("t2.train.none", TRAIN_FIELDS, train_row(["model.remat=none"])),
            Row("t2.train.packed", (*TRAIN_FIELDS, "vs_base"), train_row(pack=True, base="t2.train.dots")),
            Row("t2.quant.fp8", (*TRAIN_FIELDS, "emfu_datasheet", "vs_base"), train_row(quant="fp8", base="t2.train.dots")),
            Row("t2.quant.int8", (*TRAIN_FIELDS, "emfu_datasheet", "vs_base"), train_row(quant="int8", base="t2.train.dots")),
            Row("t2.lora.int8", (*TRAIN_FIELDS, "vs_base"), train_row(lora="int8", base="t2.train.dots")),
            Row("t2.lora.fp8", (*TRAIN_FIELDS, "vs_base"), train_row(lora="fp8", base="t2.train.dots")),
            *[Row(f"t2.gmm.{b}", GMM_FIELDS, gmm_row(b)) for b in ("dense", "pallas", "ragged_dot")],
            *[Row(f"t2.ragged.{b}", RAGGED_FIELDS, ragged_row(b)) for b in ("pallas", "reference")],
            *[Row(f"t2.paged.{kv}.{b}", PAGED_FIELDS, paged_row(b, kv)) for kv in ("bfloat16", "int8")
              for b in ("reference", "pallas", "cudnn")],
            Row("t2.cudnn_grid", CUDNN_FIELDS, cudnn_grid_row),
        ]
        for bi, b in enumerate(GPU.decode_batches):
            for kv in ("bfloat16", "int8"):
                for ci, c in enumerate(GPU.decode_contexts):
                    rows.append(Row(f"t2.decode.b{b}.{kv}.ctx{c}", DECODE_FIELDS, decode_row(bi, kv, ci)))
        rows.append(Row(f"t2.loop.b{GPU.loop[0]}", LOOP_FIELDS, loop_row))
    elif tier == "T3":
        rows = [
            Row("t3.device", dev_fields, device_row),
            Row(f"t3.train.seq{GPU.t3_seq}", TRAIN_FIELDS, train_row(shape=lambda s: (max(1, s.batch // 2), s.t3_seq))),
            *[Row(f"t3.train.batch{b}", TRAIN_FIELDS, train_row(shape=lambda s, i=i: (s.t3_batches[i], s.seq)))
              for i, b in enumerate(GPU.t3_batches)],
            Row("t3.train.remat_full", TRAIN_FIELDS, train_row(["model.remat=full"])),
            *[Row(f"t3.moe.e{e}", MOE_FIELDS, moe_row(i)) for i, e in enumerate(GPU.moe_experts)],
            *[Row(f"t3.decode.b{b}", DECODE_FIELDS, decode_row(i, "bfloat16", None, t3=True))
              for i, b in enumerate(GPU.t3_decode_batches)],
            *[Row(f"t3.serve.layers.{name}", LAYERS_FIELDS, layers_row(scan)) for name, scan in
              (("unrolled", False), ("scanned", True))],
            *[Row(f"t3.gmm.pallas.{'x'.join(map(str, t))}", GMM_FIELDS, gmm_row("pallas", i))
              for i, t in enumerate(GPU.gmm_tilings)],
            Row("t3.dlrm", DLRM_FIELDS, dlrm_row),
            # Each runs both sides in processes of their own: run them in a call of their own (--only t3.diffuse)
            Row("t3.diffuse.sdxl", DIFFUSE_FIELDS, diffuse_row("sdxl")),
            Row("t3.diffuse.flux", DIFFUSE_FIELDS, diffuse_row("flux")),
            Row("t3.diffuse.flux.fp8", DIFFUSE_FP8_FIELDS, diffuse_fp8_row("flux")),
            Row("t3.diffuse.flux.b4", DIFFUSE_FIELDS, diffuse_row("flux", batch=4)),
        ]
    else:
        raise ValueError(tier)
    for r in rows:
        ROW_ID[r.run] = r.id
    return rows


# ---------------------------------------------------------------------------
# Running a tier


# The fields the closing table shows, by the second part of the row id (the JSON has them all).
HEADLINE = {
    "device": ("device_kind", "matmul_tflops", "copy_gbs", "driver", "jax"),
    "train": ("batch", "seq", "attention", "step_ms", "tokens_s", "mfu_measured", "mfu_datasheet", "xla_mem_gib",
              "plan_mem_gib", "vs_base"),
    "monitor": ("samples", "step_ms_off", "cost_pct", "gpu_utilization", "gpu_power_watts", "device_memory_peak_gib",
                "h2d_gbs"),
    "serve": ("layers", "scan_layers", "compiles", "compile_s", "step_ms", "vs_unrolled"),
    "quant": ("step_ms", "tokens_s", "mfu_datasheet", "emfu_datasheet", "vs_base"),
    "gmm": ("tm", "fwd_ms", "fwd_pct_dense", "fwdbwd_ms", "fwdbwd_pct_dense"),
    "ragged": ("batch", "max_context", "ms", "bw_fraction_measured"),
    "paged": ("ms", "rel_err", "vs_reference"),
    "cudnn_grid": ("cases", "accepted", "rule_wrong"),
    "decode": ("batch", "context", "prefill_s", "step_ms", "tokens_s", "bw_fraction_measured"),
    "moe": ("experts", "backend", "step_ms", "tokens_s", "vs_e_first"),
}


def summary(row_id: str, fields: dict) -> str:
    """The row's headline fields in one short line for the table."""
    keys = HEADLINE.get(row_id.split(".")[1], tuple(fields))
    fields = {k: fields[k] for k in keys if k in fields}

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, list):
            return f"[{len(v)}]"
        return str(v)
    return " ".join(f"{k}={fmt(v)}" for k, v in fields.items() if k not in ("python", "hypertron"))[:160]


def run_tier(tier: str, sizes: Sizes, out: str | None, smoke: bool, only: list[str]) -> int:
    ctx = Ctx(tier, sizes, out, smoke)
    ctx.keep["start"] = time.monotonic()
    if out:
        open(os.path.join(out, f"{tier}.log"), "w").close()
    rows = [r for r in plan(tier) if not only or any(r.id.startswith(p) for p in only)]
    if not rows:
        print(f"error: --only {' '.join(only)} selects no row of {tier} (see --plan)", file=sys.stderr)
        return 2
    report = {"tier": tier, "mode": "smoke" if smoke else "device", "command": " ".join(sys.argv),
              "started": datetime.datetime.now().isoformat(timespec="seconds"), "budget_s": sizes.budget if sizes.budget != float("inf") else None, "rows": []}

    def save():
        if out:
            tmp = os.path.join(out, f".{tier}.json")
            with open(tmp, "w") as f:
                json.dump(report, f, indent=1)
            os.replace(tmp, os.path.join(out, f"{tier}.json"))

    for row in rows:
        entry = {"id": row.id, "status": "ok", "seconds": 0.0, "fields": dict.fromkeys(row.fields), "error": None}
        report["rows"].append(entry)
        if remaining(ctx) <= 0:
            entry["status"], entry["error"] = "skipped", f"time budget of {sizes.budget:.0f} s spent: rerun with --only {row.id}"
            ctx.log(f"{row.id}: skipped (budget)")
            save()
            continue
        ctx.log(f"{row.id} ...")
        start = time.perf_counter()
        try:
            got = {k: v for k, v in row.run(ctx).items() if not k.startswith("_")}
            if set(got) != set(row.fields):
                raise KeyError(f"row {row.id} returned {sorted(got)}, planned {sorted(row.fields)}")
            entry["fields"] = {k: got[k] for k in row.fields}
        except Exception as e:  # noqa: BLE001  (one row failing must not lose the others)
            entry["status"], entry["error"] = "failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            ctx.log(f"{row.id} failed:\n{traceback.format_exc()}")
        entry["seconds"] = time.perf_counter() - start
        ctx.log(f"{row.id}: {entry['status']} in {entry['seconds']:.1f} s {entry['error'] or summary(row.id, entry['fields'])}")
        save()
    report["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    save()

    print(f"\n{tier} ({report['mode']}), {time.monotonic() - ctx.keep['start']:.0f} s")
    width = max(len(r["id"]) for r in report["rows"])
    for r in report["rows"]:
        print(f"{r['id']:<{width}}  {r['status']:<7} {r['seconds']:6.1f}s  {r['error'] or summary(r['id'], r['fields'])}")
    if tier == "T0" and ctx.keep.get("missing"):
        print("error: missing modules: " + ", ".join(ctx.keep["missing"]), file=sys.stderr)
        return 3
    return 0 if all(r["status"] == "ok" for r in report["rows"]) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tier", choices=TIERS)
    p.add_argument("--out", help="folder for <TIER>.json, <TIER>.log and the artefacts (created)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, the same rows")
    p.add_argument("--only", nargs="+", default=[], metavar="PREFIX", help="rows whose id starts with PREFIX")
    p.add_argument("--budget", type=float, default=None, help="seconds before the remaining rows are skipped")
    p.add_argument("--wheels", help="install these wheels and hypertron (--no-deps) first, then re-run")
    p.add_argument("--plan", action="store_true", help="print the row ids of TIER and their fields, and stop")
    args = p.parse_args(argv)

    if args.plan:
        for r in plan(args.tier):
            print(r.id, " ".join(r.fields))
        return 0
    if args.wheels:
        install(args.wheels)
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    sizes = SMOKE if args.smoke else dataclasses.replace(GPU, budget=TIER_BUDGET[args.tier])
    if args.budget is not None:
        sizes = dataclasses.replace(sizes, budget=args.budget)
    return run_tier(args.tier, sizes, args.out, args.smoke, args.only)


if __name__ == "__main__":
    sys.exit(main())
