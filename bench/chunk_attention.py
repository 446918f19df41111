"""One layer's ragged paged attention (``hypertron.kernels.ragged_paged_attention``)
by rows: the same queries as one row or as several.

    python bench/chunk_attention.py [--tokens 512] [--cached 1024] [--rows 1 8 16] [--repeats 10]
        [--backend reference] [--block-q 64 128 256] [--shared]

At the serving bench's model shape (8 query heads, 4 KV heads, head dim 32, float32; 16-token
pages): ``--tokens`` queries split evenly over ``--rows`` rows, each row a chunk after ``--cached``
cached tokens of its own (its pages distinct; ``--shared``: one prefix, the same pages, as the
prefix cache shares a system prompt), the page table a power of two of the longest row's pages
wide (the engine's is ``max_seq_len`` wide since 2026-11-27: the loops stop at each
row's length either way), with the engine's block of queries for rows that long or each of
``--block-q`` (before 2026-11-27 the default was blocks of 64 whatever the rows). Jitted; the cases take turns (so a busy machine slows
each alike), the fastest of ``--repeats`` synced calls after a warm-up; one line per case.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.kernels.ragged_attention import BACKENDS
from hypertron.kernels.ragged_paged_attention import ragged_paged_attention
from hypertron.padding import next_pow2

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 4, 32, 16


def make_case(tokens: int, cached: int, rows: int, backend: str, block_q: int | None = None,
              shared: bool = False):
    """A jitted call and its arguments: ``tokens // rows`` queries per row after ``cached``
    (``shared``: the same cached pages for every row, as a prefix cache shares a system prompt)."""
    rng = np.random.default_rng(0)
    per_row = tokens // rows
    pages_per_row = -(-(cached + per_row) // PAGE)
    width = next_pow2(pages_per_row)
    shape = (KV_HEADS, rows * pages_per_row + 1, PAGE, HEAD_DIM)
    k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in "kv")
    table = np.zeros((rows, width), np.int32)  # past a row's pages: the null page 0
    table[:, :pages_per_row] = 1 + np.arange(rows * pages_per_row).reshape(rows, pages_per_row)
    if shared:
        table[:, :cached // PAGE] = table[0, :cached // PAGE]
    q = jnp.asarray(rng.normal(size=(rows * per_row, HEADS, HEAD_DIM)), jnp.float32)
    kv_lens = jnp.full(rows, cached + per_row, jnp.int32)
    query_start = jnp.asarray(np.arange(rows + 1) * per_row, jnp.int32)
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, backend=backend, block_q=block_q, queries_per_row=per_row))
    args = (q, k, v, kv_lens, jnp.asarray(table), query_start)
    fn(*args).block_until_ready()
    return fn, args


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--cached", type=int, default=1024)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--block-q", type=int, nargs="+", default=[None], help="the reference's queries per block")
    p.add_argument("--shared", action="store_true", help="the rows' cached tokens are one prefix (the same pages)")
    args = p.parse_args()
    print(f"# jax {jax.__version__}, {jax.devices()[0].platform}, backend {args.backend}, "
          f"{HEADS}/{KV_HEADS} heads x {HEAD_DIM}, pages of {PAGE}, fastest of {args.repeats}")
    cases = {(rows, b): make_case(args.tokens, args.cached, rows, args.backend, b, args.shared)
             for rows in args.rows for b in args.block_q}
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(args.repeats):
        for key, (fn, call_args) in cases.items():
            t = time.perf_counter()
            fn(*call_args).block_until_ready()
            best[key] = min(best[key], time.perf_counter() - t)
    for (rows, block), seconds in best.items():
        print(f"rows {rows} x {args.tokens // rows} queries after {args.cached} cached{' (shared)' if args.shared else ''}"
              f"{'' if block is None else f', blocks of {block}'}: {seconds * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
