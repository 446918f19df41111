"""Training throughput: tokens/s/device, TFLOP/s/device and MFU after warm-up.

    python bench/train.py PRESET [key=value ...] [--steps N] [--warmup N]

Runs the real sharded train step on synthetic data (so the data pipeline is
not measured), skips the warm-up steps (compile included), then times
``--steps`` steps with one device sync at the end. Prints the figures, the
device, the versions and the command.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import jax
import numpy as np


def time_train(cfg, steps: int, warmup: int) -> tuple[float, float]:
    """(mean seconds per step, final loss) of the sharded train step on synthetic batches:
    ``warmup`` steps (compile included) untimed, then ``steps`` timed with one sync at the end."""
    from hypertron.data import make_batches
    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.step import make_trainer

    t = cfg.train
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    state = trainer.init(jax.random.key(0))
    data = make_batches(source="synthetic", seq_len=t.seq_len, batch_size=t.global_batch, seed=0,
                        vocab_size=cfg.model.vocab_size)
    batches = [trainer.batch(next(data)) for _ in range(2)]  # in the load-balanced order with mesh.context
    metrics = None
    for i in range(warmup):
        state, metrics = trainer.step(state, batches[i % 2])
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for i in range(steps):
        state, metrics = trainer.step(state, batches[i % 2])
    loss = float(metrics["loss"])  # the one sync: waits for every queued step
    return (time.perf_counter() - start) / steps, loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("preset")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)

    from hypertron.config import ConfigError, load_config
    from hypertron.train.checks import validate_for_devices
    from hypertron.models import count_params, resolve_dtype
    from hypertron.models.flops import device_peak_flops, train_flops_per_token

    try:
        cfg = load_config(None, [f"model={args.preset}", "data.source=synthetic", *args.overrides])
        validate_for_devices(cfg, jax.device_count())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    step_time, loss = time_train(cfg, args.steps, args.warmup)
    t = cfg.train
    n_dev = jax.device_count()
    tokens = t.global_batch * t.seq_len
    flops = train_flops_per_token(cfg.model, t.seq_len) * tokens
    tflops = flops / step_time / n_dev / 1e12
    peak = device_peak_flops(t.peak_flops)
    dev = jax.devices()[0]
    rows = [
        ("preset", f"{cfg.model.name} ({count_params(cfg.model) / 1e6:,.1f}M params)"),
        ("device", f"{n_dev} x {getattr(dev, 'device_kind', dev.platform)}"),
        ("batch x seq", f"{t.global_batch} x {t.seq_len}, grad_accum {t.grad_accum}, remat {cfg.model.remat}"),
        ("dtype", f"params {resolve_dtype(cfg.model.param_dtype)}, compute {resolve_dtype(cfg.model.dtype)}"),
        ("step time", f"{step_time * 1e3:.1f} ms (mean of {args.steps} after {args.warmup} warm-up)"),
        ("tokens/s/device", f"{tokens / step_time / n_dev:,.0f}"),
        ("TFLOP/s/device", f"{tflops:.4g}"),
        ("MFU", "n/a (no peak known for this device)" if not peak else f"{100 * tflops * 1e12 / peak:.1f}%"),
        ("final loss", f"{loss:.4f}"),
        ("versions", f"python {platform.python_version()}, jax {jax.__version__}"),
        ("command", "python bench/train.py " + " ".join(argv if argv is not None else sys.argv[1:])),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0 if np.isfinite(loss) else 1


if __name__ == "__main__":
    sys.exit(main())
