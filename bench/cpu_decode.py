"""The C++ decode attention (``hypertron.kernels.cpu_decode``, the CPU's ``auto``) against the JAX
reference: one layer's call, then the engine's whole decode step.

    python bench/cpu_decode.py [--rows 1 16 64] [--context 150 1100] [--repeats 30] [--steps 40]
        [--no-engine] [--shared]

At the serving bench's model shape (8 query heads, 4 KV heads, head dim 32, float32; 16-token
pages). The call: ``rows`` decode rows of about ``context`` tokens (±10, random), each over pages
of its own spread through a pool of at least 4,096 pages a KV head (the page table a power of two wide), as
``ragged_paged_attention(decode_only=True)`` with ``backend="reference"`` and ``"auto"`` (the
kernel), jitted, taking turns, the median of ``--repeats`` synced calls; their largest difference
too (``--shared``: the rows share all but their last 64 tokens' pages, a prefix cache's). The
step: ``bench/decode_chunks.py``'s engines (4 layers, hidden 256, MLP 768, vocabulary
2,048) holding ``rows`` sequences of ``context`` prompt tokens, decoding greedily, one compiled
with ``AUTO_BACKEND["cpu"] = "reference"`` and one with the kernel, a step each in turn, the
median of ``--steps`` after 12 warm-up steps (scheduling and the host's side included).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import decode_chunks  # noqa: E402

from hypertron.kernels import cpu_decode  # noqa: E402
from hypertron.kernels import ragged_attention as ra  # noqa: E402
from hypertron.kernels import ragged_paged_attention as rpa  # noqa: E402
from hypertron.kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402
from hypertron.models import init_params  # noqa: E402
from hypertron.padding import next_pow2  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE, POOL = 8, 4, 32, 16, 4096  # POOL: at least, in pages a KV head


def call_case(rows: int, context: int, shared: bool = False):
    """The call's arguments: decode rows of about ``context`` tokens, pages spread through the pool
    (``shared``: the same first pages, all but the last 64 tokens' worth, as a prefix cache shares them)."""
    rng = np.random.default_rng(rows * 7 + context)
    lens = np.clip(rng.integers(context - 10, context + 11, rows), 1, None).astype(np.int32)
    width = next_pow2(-(-int(lens.max()) // PAGE))
    pool = max(POOL, rows * width)
    table = rng.permutation(pool)[: rows * width].reshape(rows, width).astype(np.int32)
    if shared:
        table[:, : max(context - 64, 0) // PAGE] = table[0, : max(context - 64, 0) // PAGE]
    k, v = (jnp.asarray(rng.normal(size=(KV_HEADS, pool, PAGE, HEAD_DIM)), jnp.float32) for _ in "kv")
    q = jnp.asarray(rng.normal(size=(rows, HEADS, HEAD_DIM)), jnp.float32)
    return q, k, v, jnp.asarray(lens), jnp.asarray(table), jnp.arange(rows + 1, dtype=jnp.int32)


def engine_case(params, rows: int, context: int, backend: str):
    """``bench/decode_chunks.py``'s ``(engine, scheduler)`` with ``rows`` sequences decoding,
    compiled with the CPU's decode backend ``backend``."""
    saved, ra.AUTO_BACKEND["cpu"] = ra.AUTO_BACKEND["cpu"], backend
    try:  # decoding() clears the compiled programs and compiles every one it needs
        return decode_chunks.decoding(params, rows, context, rpa.DECODE_CHUNK_TOKENS)
    finally:
        ra.AUTO_BACKEND["cpu"] = saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, nargs="+", default=[150, 1100])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--no-engine", action="store_true", help="the call only")
    p.add_argument("--shared", action="store_true", help="the call's rows share all but their last 64 tokens' pages")
    args = p.parse_args(argv)
    if cpu_decode.unavailable():
        print(f"error: the C++ kernel is not available here: {cpu_decode.unavailable()}", file=sys.stderr)
        return 2
    print(f"# jax {jax.__version__}, {os.cpu_count()} CPUs; {HEADS}/{KV_HEADS} heads x {HEAD_DIM}, pages of {PAGE}")
    for rows in args.rows:
        for context in args.context:
            case = call_case(rows, context, args.shared)
            fns = {b: jax.jit(lambda *a, b=b: ragged_paged_attention(*a, backend=b, decode_only=True))
                   for b in ("reference", "auto")}
            outs = {b: fn(*case).block_until_ready() for b, fn in fns.items()}
            times = {b: [] for b in fns}
            for _ in range(args.repeats):
                for b, fn in fns.items():
                    t = time.perf_counter()
                    fn(*case).block_until_ready()
                    times[b].append(time.perf_counter() - t)
            ref, nat = (np.median(times[b]) * 1e3 for b in ("reference", "auto"))
            diff = float(jnp.max(jnp.abs(outs["reference"] - outs["auto"])))
            shared = " shared" if args.shared else ""
            print(f"call rows={rows} context={context}{shared}: reference {ref:.3f} ms, kernel {nat:.3f} ms "
                  f"({ref / nat:.2f}x), largest difference {diff:.1e}")
    if args.no_engine:
        return 0
    params = init_params(decode_chunks.MODEL, jax.random.key(1))
    for rows in [r for r in args.rows if r > 1]:
        for context in args.context:
            runs = {b: engine_case(params, rows, context, b) for b in ("reference", "native")}
            times = {b: [] for b in runs}
            for _ in range(args.steps):
                for b, (engine, sched) in runs.items():
                    t = time.perf_counter()
                    decode_chunks.step(engine, sched)
                    times[b].append(time.perf_counter() - t)
            ref, nat = (np.median(times[b]) * 1e3 for b in ("reference", "native"))
            print(f"engine step rows={rows} context={context}: reference {ref:.2f} ms, kernel {nat:.2f} ms "
                  f"({ref / nat:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
