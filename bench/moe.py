"""Mixture-of-Experts throughput: the grouped matmul, the MoE layer as experts grow, capped vs dropless.

    python bench/moe.py [--tokens 2048] [--d-model 128] [--d-ff 256] [--experts 8 16 32 64]
                        [--top-k 2] [--iters 7] [--dtype auto] [--json PATH]

Three tables, every time the median of ``--iters`` jitted calls, each synced with
``block_until_ready``, after one warm-up call (compile included):

(a) grouped matmul: :func:`hypertron.kernels.gmm.gmm` on the MoE layer's first
    product, ``m = tokens x top_k`` rows, ``k = d_model``, ``n = d_ff``, one group
    per expert, ``even`` and ``skewed`` row splits (as in ``bench/gmm.py``), per
    backend available here (``grouped`` and ``ragged_dot`` on CPU, ``pallas`` and
    ``ragged_dot`` on an accelerator), forward and forward + both gradients, in
    TFLOP/s of useful work and as a percentage of one dense ``[m, k] x [k, n]``
    matmul of the same FLOPs.
(b) the MoE layer, weak scaling of experts: forward + backward (gradients wrt the
    input and every parameter) of :func:`hypertron.models.moe.moe_mlp`, dropless,
    with ``--tokens`` tokens, ``top_k`` and ``d_ff`` fixed while the experts grow,
    so the expert FLOPs per token stay the same. Tokens/s and the throughput lost
    relative to the first (smallest) expert count.
(c) the same layer capped (``capacity_factor`` 1.25) vs dropless: step times and
    the fraction of token copies the capped layer dropped.

Compute dtype ``auto``: float32 on CPU, bfloat16 on accelerators; parameters are
float32 (as in training), cast to the compute dtype inside the layer. One device.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gmm import measure, print_rows, time_fn  # bench/gmm.py, this directory


def bench_gmm(m, k, n, experts, backends, dtype, iters):
    """Rows ``(backend, G, split, fwd s, fwd+bwd s)``; ``dense`` first (bench/gmm.py's measure)."""
    return measure(m, k, n, experts, ("even", "skewed"), backends, dtype, iters)


def layer_config(base, d_model, d_ff, experts, top_k, mode):
    moe = dataclasses.replace(base.moe, num_experts=experts, top_k=top_k, mode=mode, capacity_factor=1.25,
                              shared_experts=0)
    return dataclasses.replace(base, embed_dim=d_model, mlp_dim=d_ff, moe=moe)


def bench_layer(cfg, tokens, dtype, iters):
    """(seconds per forward + backward, fraction of copies dropped) of one jitted MoE layer."""
    from hypertron.models.decoder import activation
    from hypertron.models.moe import declare_moe, moe_mlp
    from hypertron.models.params import initialize
    from hypertron.quant.einsum import einsum_for

    einsum = einsum_for("none", dtype)
    params = initialize(declare_moe(cfg), jax.random.key(1), jnp.float32)
    kx, ky = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (1, tokens, cfg.embed_dim), dtype)
    dy = jax.random.normal(ky, (1, tokens, cfg.embed_dim), jnp.float32)
    moe = cfg.moe

    def objective(p, x):  # <y, dy> pulls a random cotangent through; plus the router losses
        y, stats = moe_mlp(x, p, cfg, einsum, activation)
        obj = jnp.sum(y.astype(jnp.float32) * dy)
        obj += moe.load_balance_weight * stats["load_balance"] + moe.router_z_weight * stats["router_z"]
        return obj, stats["dropped"]

    step = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))
    seconds = time_fn(step, (params, x), iters)
    (_, dropped), _ = step(params, x)
    return seconds, float(dropped)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (``None``: ``sys.argv``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (one device)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-ff", type=int, default=256, help="hidden size of each expert")
    p.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype; auto: float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--backends", nargs="+", default=None, help="gmm backends for table (a)")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    return p.parse_args(argv)


def run_meta(dtype, argv: list[str] | None) -> dict:
    """Date, device, versions, dtype, the layer's gmm backend and the command line of this run."""
    from hypertron.kernels.gmm import resolve_backend

    dev = jax.devices()[0]
    command = "python bench/moe.py " + " ".join(argv if argv is not None else sys.argv[1:])
    return {
        "date": datetime.date.today().isoformat(),
        "device": f"{jax.device_count()} x {getattr(dev, 'device_kind', dev.platform)} "
                  f"({os.cpu_count()} CPUs, {platform.processor() or platform.machine()})",
        "python": platform.python_version(), "jax": jax.__version__, "dtype": str(dtype),
        "layer_gmm_backend": resolve_backend("auto"), "command": command.strip(),
    }


def bench_layers(args: argparse.Namespace, dtype) -> list[dict]:
    """Tables (b) and (c): per expert count, the layer's step seconds and dropped fraction, dropless
    and capped (``{"experts", "dropless", "dropless_dropped", "capped", "capped_dropped"}``)."""
    from hypertron.config import PRESETS

    base = PRESETS["tiny-moe"]
    l_rows = []
    for e in args.experts:
        row = {"experts": e}
        for mode in ("dropless", "capped"):
            cfg = layer_config(base, args.d_model, args.d_ff, e, args.top_k, mode)
            seconds, dropped = bench_layer(cfg, args.tokens, dtype, args.iters)
            row[mode] = seconds
            row[f"{mode}_dropped"] = dropped
            print(f"  ... layer E={e} {mode}: {seconds * 1e3:.1f} ms", file=sys.stderr)
        l_rows.append(row)
    return l_rows


def print_gmm(g_rows: list, m: int, flops: int, args: argparse.Namespace, dtype) -> None:
    """Table (a): each backend's grouped matmul against the dense one (``g_rows[0]``)."""
    print(f"\n(a) grouped matmul  m={m} (tokens x top_k)  k={args.d_model}  n={args.d_ff}  {dtype}  "
          f"({flops / 1e9:.3f} GFLOP forward)")
    print_rows(g_rows, flops, dense=g_rows[0])


def print_layers(l_rows: list[dict], m: int, args: argparse.Namespace, meta: dict) -> None:
    """Tables (b), the dropless layer as the experts grow, and (c), capped vs dropless."""
    T, d, f, k = args.tokens, args.d_model, args.d_ff, args.top_k
    expert_flops = 6 * m * 3 * d * f  # three expert matmuls, forward + backward, useful rows only
    first = l_rows[0]["dropless"]
    print(f"\n(b) MoE layer forward+backward, dropless (gmm backend {meta['layer_gmm_backend']}), "
          f"{T} tokens, top_k={k}, d_model={d}, d_ff={f} per expert, {meta['dtype']}")
    print(f"{'experts':>7} {'step ms':>8} {'tokens/s':>10} {'vs E=' + str(args.experts[0]):>8} "
          f"{'expert TFLOP/s':>14}")
    for r in l_rows:
        t = r["dropless"]
        print(f"{r['experts']:>7} {t * 1e3:>8.2f} {T / t:>10,.0f} {100 * (first / t - 1):>+7.1f}% "
              f"{expert_flops / t / 1e12:>14.4f}")

    print("\n(c) capped (capacity_factor 1.25) vs dropless, same layer")
    print(f"{'experts':>7} {'dropless ms':>11} {'capped ms':>9} {'capped/dropless':>15} {'dropped':>7}")
    for r in l_rows:
        print(f"{r['experts']:>7} {r['dropless'] * 1e3:>11.2f} {r['capped'] * 1e3:>9.2f} "
              f"{r['capped'] / r['dropless']:>15.2f} {100 * r['capped_dropped']:>6.1f}%")


def write_json(path: str, meta: dict, args: argparse.Namespace, flops: int, g_rows: list, l_rows: list[dict]) -> None:
    """Every figure of the three tables, with ``meta`` and the sizes, as JSON at ``path``."""
    first = l_rows[0]["dropless"]
    out = {
        "meta": meta | {"tokens": args.tokens, "d_model": args.d_model, "d_ff": args.d_ff, "top_k": args.top_k,
                        "iters": args.iters},
        "gmm": [{"backend": b, "groups": g, "split": s, "fwd_s": tf, "fwd_bwd_s": tb,
                 "fwd_tflops": None if tf is None else flops / tf / 1e12,
                 "fwd_bwd_tflops": None if tb is None else 3 * flops / tb / 1e12}
                for b, g, s, tf, tb in g_rows],
        "layer": [r | {"tokens_per_s": args.tokens / r["dropless"],
                       "throughput_vs_first": first / r["dropless"]} for r in l_rows],
    }
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    dtype = jnp.dtype(("float32" if on_cpu else "bfloat16") if args.dtype == "auto" else args.dtype)
    backends = args.backends or (["grouped", "ragged_dot"] if on_cpu else ["pallas", "ragged_dot"])
    m = args.tokens * args.top_k
    flops = 2 * m * args.d_model * args.d_ff
    meta = run_meta(dtype, argv)

    g_rows = bench_gmm(m, args.d_model, args.d_ff, args.experts, backends, dtype, args.iters)  # (a)
    l_rows = bench_layers(args, dtype)  # (b) + (c)
    print_gmm(g_rows, m, flops, args, dtype)
    print_layers(l_rows, m, args, meta)

    print(f"\ndate: {meta['date']}  device: {meta['device']}")
    print(f"versions: python {meta['python']}, jax {meta['jax']}  timing: median of {args.iters} after 1 warm-up")
    print(f"command: {meta['command']}")
    if args.json:
        write_json(args.json, meta, args, flops, g_rows, l_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
