"""The attention of a prefill chunk after a cached prefix (``hypertron.models.kv_cache.chunk_attention``).

    python bench/chunk_attention.py [--tokens 512] [--context 512 1024 2048] [--repeats 20]

One layer's chunk attention at the serving bench's model shape (8 query heads, 4 KV heads, head
dim 32, float32; 16-token pages): ``--tokens`` queries of one sequence at the end of ``--context``
cached tokens, over that sequence's pages, jitted, median of ``--repeats`` synced calls after a
warm-up. It calls the function by its module path only, so the same command times an older tree
(``PYTHONPATH=OLD_TREE python bench/chunk_attention.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config import PRESETS
from hypertron.models import kv_cache


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--context", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    cfg = dataclasses.replace(PRESETS["tiny"], num_heads=8, num_kv_heads=4, head_dim=32, dtype="float32")
    page, n = 16, args.tokens
    rng = np.random.default_rng(0)
    print(f"{'context':>8} {'ms':>8}   (jax {jax.__version__}, {jax.devices()[0].platform}, "
          f"{n} queries, {cfg.num_heads}/{cfg.num_kv_heads} heads x {cfg.head_dim})")
    for ctx in args.context:
        width = -(-ctx // page)
        shape = (cfg.num_kv_heads, width + 1, page, cfg.head_dim)
        pages = {"k_pages": jnp.asarray(rng.normal(size=shape), jnp.float32),
                 "v_pages": jnp.asarray(rng.normal(size=shape), jnp.float32)}
        table = jnp.arange(1, width + 1, dtype=jnp.int32)[None]
        q = jnp.asarray(rng.normal(size=(n, cfg.num_heads, cfg.head_dim)), jnp.float32)
        positions = jnp.arange(ctx - n, ctx, dtype=jnp.int32)
        fn = jax.jit(lambda q, pages, table, pos: kv_cache.chunk_attention(
            q, pages, table, jnp.array([ctx], jnp.int32), jnp.zeros(n, jnp.int32), pos, cfg))
        fn(q, pages, table, positions).block_until_ready()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn(q, pages, table, positions).block_until_ready()
            times.append(time.perf_counter() - t)
        print(f"{ctx:>8} {statistics.median(times) * 1e3:>8.2f}")


if __name__ == "__main__":
    main()
