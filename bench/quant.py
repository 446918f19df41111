"""Quantised training throughput: the same preset in the compute dtype, fp8 and int8, side by side.

    python bench/quant.py [PRESET] [key=value ...] [--modes none fp8 int8] [--steps N] [--warmup N]

For each ``model.quantization`` in ``--modes`` (``none`` is the compute dtype: bfloat16 on an
accelerator, float32 on CPU), the real sharded train step runs on synthetic data as in
``bench/train.py``: ``--warmup`` steps (compile included) untimed, then ``--steps`` timed with
one sync at the end. Per mode: step time, tokens/s/device, model TFLOP/s/device (the same
model FLOPs for every mode), MFU against the peak of the mode's format (bf16, fp8 or int8;
n/a where the device's peak is unknown, e.g. CPU), EMFU against the bf16 peak (as MaxText
reports quantised runs), the speed-up over ``none``, and the last step's loss. fp8 uses
``model.fp8_scaling`` (delayed by default); ``key=value`` overrides apply to every mode.

On CPU the fp8 matmuls run on values rounded to fp8 in the compute dtype (XLA:CPU has no fp8
matmul) and int8 ones as integer matmuls, so CPU figures show only that the modes run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from table import print_table  # bench/table.py, this directory
from train import time_train  # bench/train.py, this directory

FORMAT = {"none": "bf16", "fp8": "fp8", "int8": "int8"}
COLUMNS = [("mode", "<6"), ("ms/step", ">9.1f"), ("tok/s/dev", ">11,.0f"), ("TFLOP/s/dev", ">12.4g"), ("MFU", ">7"),
           ("EMFU", ">7"), ("vs none", ">8"), ("loss", ">8.4f")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("preset", nargs="?", default="tiny")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (every mode)")
    p.add_argument("--modes", nargs="+", default=["none", "fp8", "int8"], choices=list(FORMAT))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)

    from hypertron.config import ConfigError, load_config
    from hypertron.train.checks import validate_for_devices
    from hypertron.models import count_params, resolve_dtype
    from hypertron.models.flops import device_peak_flops, train_flops_per_token

    cfgs = {}
    try:
        for mode in args.modes:
            cfgs[mode] = load_config(None, [f"model={args.preset}", "data.source=synthetic", *args.overrides,
                                            f"model.quantization={mode}"])
            validate_for_devices(cfgs[mode], jax.device_count())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    n_dev = jax.device_count()
    rows = []
    for mode, cfg in cfgs.items():
        print(f"  ... {mode}", file=sys.stderr, flush=True)
        step_time, loss = time_train(cfg, args.steps, args.warmup)
        t = cfg.train
        tokens = t.global_batch * t.seq_len
        tflops = train_flops_per_token(cfg.model, t.seq_len) * tokens / step_time / n_dev / 1e12
        bf16_peak = device_peak_flops(t.peak_flops)  # train.peak_flops overrides the bf16 peak only
        peak = bf16_peak if mode == "none" else device_peak_flops(0.0, fmt=FORMAT[mode])
        rows.append({"mode": mode, "step_s": step_time, "tok_s": tokens / step_time / n_dev, "tflops": tflops,
                     "mfu": None if not peak else tflops * 1e12 / peak,
                     "emfu": None if not bf16_peak else tflops * 1e12 / bf16_peak, "loss": loss})

    cfg = next(iter(cfgs.values()))
    t, dev = cfg.train, jax.devices()[0]
    base = next((r for r in rows if r["mode"] == "none"), None)
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"
    fp8_scaling = f", fp8 scaling {cfg.model.fp8_scaling}" if "fp8" in cfgs else ""
    print(f"{cfg.model.name} ({count_params(cfg.model) / 1e6:,.1f}M params), batch {t.global_batch} x seq "
          f"{t.seq_len}, compute {resolve_dtype(cfg.model.dtype)}, params {resolve_dtype(cfg.model.param_dtype)}, "
          f"remat {cfg.model.remat}{fp8_scaling}; {args.steps} timed steps after {args.warmup} warm-up")
    speed = lambda r: "" if base is None else f"{base['step_s'] / r['step_s']:.2f}x"
    print_table(COLUMNS, [(r["mode"], r["step_s"] * 1e3, r["tok_s"], r["tflops"], pct(r["mfu"]), pct(r["emfu"]),
                           speed(r), r["loss"]) for r in rows])
    print(f"device: {n_dev} x {getattr(dev, 'device_kind', dev.platform)}")
    print(f"versions: python {platform.python_version()}, jax {jax.__version__}")
    print("command: python bench/quant.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0 if all(np.isfinite(r["loss"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
