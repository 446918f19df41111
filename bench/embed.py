"""Pooled embedding lookups and their sparse row-wise Adagrad updates: hypertron.embed vs TorchRec, on this CPU.

    make embed-bench-deps          # torch 2.13.0 (CPU), torchrec 1.9.2, fbgemm-gpu-cpu 1.8.0 into .venv
    .venv/bin/python bench/embed.py [--rows 1000000] [--dim 64] [--batch 1024] [--tables 1 8] \\
        [--ids-per-sample 4 32] [--steps 20] [--threads N] [--output FILE]

For each (tables, ids per sample): ``tables`` tables of ``rows x dim`` float32, one feature each,
sum pooling, ``batch`` samples of exactly ``ids-per-sample`` uniform random ids per table (the
same ids for every system, the same batch every step). Timed, median of ``--steps`` after 5
warm-up steps, everything finished (``block_until_ready``; torch runs eagerly):

- lookup: the pooled embeddings of every table. hypertron: ``route`` (the host's share: the
  layout and the step's distinct ids) and ``lookup`` per table, table-wise on one device; and
  the lookups alone, from input routed before (what a step that routes its batch once, for the
  lookup and the update, pays for the lookup). TorchRec: ``EmbeddingBagCollection`` under
  ``no_grad``.
- update: lookup, a pooled gradient of ones, the row-wise Adagrad step on the touched rows
  (lr 0.01, eps 1e-8). hypertron: ``lookup`` + ``apply_gradients`` per table (the table and its
  state donated). TorchRec: ``FusedEmbeddingBagCollection`` (FBGEMM's CPU kernel, the optimiser
  fused into backward), and FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` called directly.

Lookups/s counts ids; updated rows/s counts the distinct rows a step touched. Both sides first
check one step against numpy (the pooled sums and the updated rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

LR, EPS = 0.01, 1e-8


def _median_ms(fn, steps: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _expected(values: np.ndarray, ids: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """One table's pooled sums and its rows after one row-wise Adagrad step with a gradient of ones."""
    per = ids.reshape(batch, -1)
    pooled = values[per].sum(1)
    g = np.zeros(values.shape, np.float64)
    np.add.at(g, per.reshape(-1), 1.0)
    touched = np.unique(ids)
    acc = (g[touched] ** 2).mean(1)
    after = values.astype(np.float64).copy()
    after[touched] -= LR * g[touched] / (np.sqrt(acc) + EPS)[:, None]
    return pooled, after


def run_hypertron(values: list[np.ndarray], ids: list[np.ndarray], batch: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from hypertron.embed import Jagged, TableSpec, apply_gradients, lookup, route, shard_table

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    rows, dim = values[0].shape
    spec = TableSpec("t", rows, dim, placement="table", optimizer="rowwise_adagrad")
    lengths = np.full(batch, len(ids[0]) // batch)
    inputs = [Jagged(i, lengths) for i in ids]
    tables = [shard_table(v, spec, mesh, "x") for v in values]
    ones = jnp.ones((batch, dim), jnp.float32)

    def lookups():
        out = [lookup(t, route(spec, x, "sum", 1)) for t, x in zip(tables, inputs)]
        jax.block_until_ready(out)
        return out

    routed = [route(spec, x, "sum", 1) for x in inputs]

    def routed_lookups():  # the device's share: input routed once, outside the timing
        jax.block_until_ready([lookup(t, r) for t, r in zip(tables, routed)])

    def updates():
        for k, x in enumerate(inputs):
            r = route(spec, x, "sum", 1)
            lookup(tables[k], r)
            tables[k] = apply_gradients(tables[k], r, ones, lr=LR, eps=EPS)
        jax.block_until_ready([t.data for t in tables])

    pooled, after = _expected(values[0], ids[0], batch)  # one step, checked against numpy
    np.testing.assert_allclose(np.asarray(lookups()[0]), pooled, rtol=1e-4, atol=1e-4)
    updates()
    np.testing.assert_allclose(tables[0].dense()[0], after, rtol=1e-4, atol=1e-5)
    return {"route_ms": _median_ms(lambda: [route(spec, x, "sum", 1) for x in inputs], steps),
            "lookup_ms": _median_ms(lookups, steps), "lookup_routed_ms": _median_ms(routed_lookups, steps),
            "update_ms": _median_ms(updates, steps)}


def run_torchrec(values: list[np.ndarray], ids: list[np.ndarray], batch: int, steps: int) -> dict:
    import fbgemm_gpu  # noqa: F401  (registers FBGEMM's CPU kernels)
    import torch
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen,
    )
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    rows, dim = values[0].shape
    n = len(values)
    configs = [torchrec.EmbeddingBagConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=rows,
                                           feature_names=[f"f{t}"], pooling=torchrec.PoolingType.SUM)
               for t in range(n)]
    kjt = torchrec.KeyedJaggedTensor(keys=[f"f{t}" for t in range(n)],
                                     values=torch.from_numpy(np.concatenate(ids).astype(np.int64)),
                                     lengths=torch.full((n * batch,), len(ids[0]) // batch, dtype=torch.int64))
    cpu = torch.device("cpu")
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=cpu)
    with torch.no_grad():
        for t, v in enumerate(values):
            ebc.embedding_bags[f"t{t}"].weight.copy_(torch.from_numpy(v))
    pooled, after = _expected(values[0], ids[0], batch)
    with torch.no_grad():
        np.testing.assert_allclose(ebc(kjt).values()[:, :dim].numpy(), pooled, rtol=1e-4, atol=1e-4)
        lookup_ms = _median_ms(lambda: ebc(kjt).values(), steps)
    del ebc

    def fused():
        m = FusedEmbeddingBagCollection(tables=configs, optimizer_type=RowWiseAdagrad,
                                        optimizer_kwargs={"lr": LR, "eps": EPS}, device=cpu)
        return m, m._emb_modules[0]._emb_module, lambda: m(kjt).values()

    def tbe():
        m = SplitTableBatchedEmbeddingBagsCodegen([(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * n,
                                                  optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR,
                                                  eps=EPS, bounds_check_mode=BoundsCheckMode.NONE, device=cpu)
        return m, m, lambda: m(kjt.values(), kjt.offsets())

    result = {"lookup_ms": lookup_ms}
    for name, build in (("fused_ebc", fused), ("tbe", tbe)):
        module, kernel, step = build()
        with torch.no_grad():
            for w, v in zip(kernel.split_embedding_weights(), values):
                w.copy_(torch.from_numpy(v))

        def update(step=step):
            out = step()
            out.backward(torch.ones_like(out))

        update()  # one step, checked against numpy
        np.testing.assert_allclose(kernel.split_embedding_weights()[0].detach().numpy(), after, rtol=1e-4,
                                   atol=1e-5)
        result[f"update_ms_{name}"] = _median_ms(update, steps)
        del module, kernel, step, update
    return result


def torchrec_versions(threads: int) -> dict:
    """TorchRec imported (or exit with what to install), torch on ``threads`` threads, and the
    versions and machine for the record."""
    try:
        import torch
        import torchrec
    except ImportError as e:
        sys.exit(f"error: {e.name} is not installed: run make embed-bench-deps")
    import jax

    torch.set_num_threads(threads)
    return {"jax": jax.__version__, "torch": torch.__version__, "torchrec": torchrec.__version__,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch_threads": threads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--tables", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ids-per-sample", type=int, nargs="+", default=[4, 32])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch's threads (default: the cores)")
    p.add_argument("--output", metavar="FILE", help="write the results as JSON")
    args = p.parse_args()
    versions = torchrec_versions(args.threads)
    print(json.dumps(versions))
    rng = np.random.default_rng(0)
    results = []
    head = (f"{'tables':>6} {'ids/sample':>10} {'ids/step':>9} {'rows/step':>9} | "
            f"{'lookup Mids/s (hypertron, routed before, TorchRec)':>50} | "
            f"{'update Mrows/s (hypertron, FusedEBC, TBE)':>44}")
    print(head)
    for n in args.tables:
        values = [rng.normal(0, 0.01, (args.rows, args.dim)).astype(np.float32) for _ in range(n)]
        for per in args.ids_per_sample:
            ids = [rng.integers(0, args.rows, args.batch * per) for _ in range(n)]
            total, touched = n * args.batch * per, sum(len(np.unique(i)) for i in ids)
            h = run_hypertron(values, ids, args.batch, args.steps)
            t = run_torchrec(values, ids, args.batch, args.steps)
            row = {"tables": n, "ids_per_sample": per, "ids_per_step": total, "rows_per_step": touched,
                   "hypertron": h, "torchrec": t}
            results.append(row)
            rate = lambda count, ms: count / ms / 1e3  # noqa: E731  (millions per second)
            print(f"{n:>6} {per:>10} {total:>9} {touched:>9} | {rate(total, h['lookup_ms']):>16.1f} "
                  f"{rate(total, h['lookup_routed_ms']):>16.1f} {rate(total, t['lookup_ms']):>16.1f} | "
                  f"{rate(touched, h['update_ms']):>14.2f} "
                  f"{rate(touched, t['update_ms_fused_ebc']):>14.2f} {rate(touched, t['update_ms_tbe']):>14.2f}",
                  flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"versions": versions, "args": vars(args), "results": results},
                                                indent=1))


if __name__ == "__main__":
    main()
