"""The paged engine's layers unrolled (per-layer weights, the default) against scanned
(``scan_layers=True``): what a step costs and how long its compiles take, by model width and depth.

    python bench/serve_layers.py [--widths 256 512 1024] [--layers 4 22] [--rounds 2] [--json FILE]

Each model is ``llama-1b``'s shape at another width ``D`` (8 heads of ``D/8``, 4 KV heads, an
MLP of ``2.75 D``, a 2,048-token vocabulary) and depth, random weights in the backend's default
dtype. For each variant :meth:`PagedEngine.measure_step_cost` gives a step's fixed cost (a 1-row
decode) and its cost per token (from a 64-token prefill), the fastest of ``--repeats`` runs, over
``--rounds`` engines run in turn; ``compile_s`` is the first engine's two compiles, from nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time


def measure(width: int, layers: int, rounds: int, repeats: int) -> list[dict]:
    import jax

    from hypertron.config import PRESETS
    from hypertron.models import count_params, init_params, resolve_dtype
    from hypertron.config import EngineConfig
    from hypertron.serve.engine import PagedEngine, clear_shared_executables

    cfg = dataclasses.replace(PRESETS["llama-1b"], embed_dim=width, num_heads=8, num_kv_heads=4,
                              head_dim=width // 8, mlp_dim=int(2.75 * width), vocab_size=2048, num_layers=layers,
                              max_seq_len=1024)
    params = init_params(cfg, jax.random.key(0), resolve_dtype(cfg.dtype))
    rows = {scan: {"width": width, "layers": layers, "params_m": count_params(cfg) / 1e6,
                   "variant": "scanned" if scan else "unrolled", "compile_s": None, "fixed_ms": float("inf"),
                   "per_token_ms": float("inf")} for scan in (False, True)}
    for r in range(rounds):
        for scan, row in rows.items():
            if r == 0:
                clear_shared_executables()
            engine = PagedEngine(params, cfg, EngineConfig(max_slots=4, num_pages=64, compile="lazy"), scan_layers=scan)
            cost = engine.measure_step_cost(64, repeats=repeats)
            if r == 0:
                row["compile_s"] = engine.compile_seconds
            row["fixed_ms"] = min(row["fixed_ms"], cost.fixed * 1e3)
            row["per_token_ms"] = min(row["per_token_ms"], cost.per_token * 1e3)
            del engine
    unrolled = rows[False]["fixed_ms"]
    for row in rows.values():
        row["fixed_vs_unrolled"] = row["fixed_ms"] / unrolled
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 22])
    p.add_argument("--rounds", type=int, default=2, help="engines per variant, run in turn; the fastest kept")
    p.add_argument("--repeats", type=int, default=30, help="runs of each step per engine")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    if any(w < 8 or w % 8 for w in args.widths) or min(args.layers) < 1 or args.rounds < 1 or args.repeats < 1:
        print("error: widths must be multiples of 8; layers, rounds and repeats at least 1", file=sys.stderr)
        return 2

    import jax

    start = time.perf_counter()
    rows = []
    for w in args.widths:
        for n in args.layers:
            rows += measure(w, n, args.rounds, args.repeats)
            print(f"  ... width {w}, {n} layers done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    print("| width | layers | params (M) | layers run | compile (s) | fixed (ms) | per token (ms) | fixed / unrolled |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['width']} | {r['layers']} | {r['params_m']:.1f} | {r['variant']} | {r['compile_s']:.1f} | "
              f"{r['fixed_ms']:.2f} | {r['per_token_ms']:.3f} | {r['fixed_vs_unrolled']:.2f} |")
    dev = jax.devices()[0]
    print(f"\ndevice: {jax.device_count()} x {getattr(dev, 'device_kind', dev.platform)}; python "
          f"{platform.python_version()}, jax {jax.__version__}")
    print(("command: python bench/serve_layers.py " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
