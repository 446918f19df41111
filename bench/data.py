"""The training data pipeline's speed by ``data.shards``: batches/s of ``make_batches`` (the stdlib
corpus, byte tokenizer, packed rows shuffled within their window) in one process, and how long its
first batch took (the shuffle windows filling).

    python bench/data.py [--shards 1 8] [--seq-len 512] [--batch 32] [--batches 200] [--repeats 3] [--source stdlib]

Each repeat makes a new stream per shard count (alternating), takes its first batch (timed apart),
then ``--batches`` more. Prints per shard count the median batches/s and tokens/s, and the ratio
to the first shard count's (issue 46: ``data.shards=8`` at least 0.9x ``data.shards=1``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypertron.data import make_batches  # noqa: E402


def run(args, shards: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    stream = make_batches(source=args.source, seq_len=args.seq_len, batch_size=args.batch, seed=0, shards=shards)
    next(stream)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.batches):
        next(stream)
    rate = args.batches / (time.perf_counter() - t0)
    stream.close()
    return first, rate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, nargs="+", default=[1, 8])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--source", default="stdlib")
    args = p.parse_args(argv)
    results = {v: [] for v in args.shards}
    for _ in range(args.repeats):
        for v in args.shards:
            results[v].append(run(args, v))
    base = statistics.median(r for _, r in results[args.shards[0]])
    for v in args.shards:
        rate = statistics.median(r for _, r in results[v])
        first = statistics.median(f for f, _ in results[v])
        print(f"data shards={v}: {rate:.1f} batches/s ({rate * args.batch * args.seq_len:,.0f} tokens/s; runs "
              f"{', '.join(f'{r:.1f}' for _, r in results[v])}), first batch {first:.2f} s, "
              f"ratio {rate / base:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
