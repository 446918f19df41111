"""Run as each of two processes by tests/test_multiprocess.py (``jax.distributed`` from the
environment ``hypertron launch local`` sets, 4 CPU devices each): a row-wise table over both
processes' 8 devices, each process holding 8 samples of a 16-sample batch. Three batches in turn,
each checked (``check_ids``) and routed (``route`` with a capacity of 4) by each process for its
own samples, then looked up:

- ``good``: the lookup, gathered, equals the float64 reference on the whole batch; prints ``good``;
- ``bad-id``: process 1 holds an id past the table;
- ``negative-id``: process 0 holds a negative id;
- ``lengths``: process 1's lengths add up to more than its ids;
- ``overflow``: process 0 sends 9 ids from one device to one shard.

Each process writes a line a batch to ``argv[1]/process_<index>.txt`` (stdout is shared with Gloo's
C++ logging): the case, or ``error: <message>`` for an error, after which it goes on to the next
batch (so none was left waiting in a collective)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from hypertron.config import DistributedConfig
from hypertron.parallel import distributed


def batch(process: int, case: str):
    from hypertron.embed import Jagged

    lengths = np.full(8, 2)
    values = (np.arange(16) * 5 + process * 3) % 64
    if case == "bad-id" and process == 1:
        values[3] = 64
    if case == "negative-id" and process == 0:
        values[5] = -1
    if case == "lengths" and process == 1:
        lengths = np.full(8, 3)
    if case == "overflow" and process == 0:  # samples 0 and 1 (device 0): 9 ids owned by shard 0
        lengths = np.array([5, 4, 1, 1, 1, 1, 1, 1])
        values = np.concatenate([np.arange(9) * 8 % 64, [1, 2, 3, 4, 5, 6]])
    return Jagged(values, lengths)


def main() -> None:
    distributed.initialize(DistributedConfig())
    from hypertron.embed import (
        EmbedError, FeatureSpec, Jagged, TableSpec, check_ids, init_table, lookup, reference_lookup, route,
    )
    from hypertron.embed.tables import process_values

    spec = TableSpec("t", rows=64, dim=8)
    table = init_table(spec, Mesh(np.array(jax.devices()), ("x",)), "x", seed=0)
    values = np.asarray(multihost_utils.process_allgather(table.data, tiled=True))  # [8 shards, 8 rows, 8]
    values = values.transpose(1, 0, 2).reshape(64, 8)
    me = jax.process_index()
    lines = []
    for case in ("good", "bad-id", "negative-id", "lengths", "overflow"):
        x = batch(me, case)
        try:
            check_ids([FeatureSpec("clicks", "t")], {"t": spec}, {"clicks": x}, gather=process_values)
            r = route(spec, x, "sum", 8, capacity=4, process=(me, 2), gather=process_values, feature="clicks")
            pooled = np.asarray(multihost_utils.process_allgather(lookup(table, r), tiled=True))
        except EmbedError as e:
            lines.append(f"error: {e}")
            continue
        parts = [batch(p, case) for p in range(2)]
        whole = Jagged(np.concatenate([b.values for b in parts]), np.concatenate([b.lengths for b in parts]))
        np.testing.assert_allclose(pooled, reference_lookup(values, whole), rtol=1e-5, atol=1e-6)
        lines.append(case)
    Path(sys.argv[1], f"process_{me}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
