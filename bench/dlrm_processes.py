"""DLRM-v2 training on 2 processes of this machine: hypertron against TorchRec's
``DistributedModelParallel`` over gloo, and hypertron's 2 processes against its 1.

    make embed-bench-deps     # torch 2.13.0 (CPU), torchrec 1.9.2, fbgemm-gpu-cpu 1.8.0 into .venv
    .venv/bin/python bench/dlrm_processes.py [--dlrm dlrm-v2-tiny] [--batch 256 2048 8192 16384] \\
        [--steps 30] [--output FILE]

The model is bench/dlrm.py's (``--dlrm``, row-wise Adagrad on the tables, Adagrad on the MLPs, its
learning rate); the data its planted-teacher synthetic stream, each process reading its block of
each global batch of ``--batch`` samples (20 batches made before the clock, cycled, on both sides). Each system runs as 2 processes of one CPU device (one
core) each, started by this script: hypertron as ``hypertron launch local`` starts a job
(``jax.distributed``, each process routing its own ids, every table split over both devices: the
planner's ``split_all``), TorchRec by ``torchrun --nproc-per-node 2`` (gloo, its planner's
placement: whole tables on a rank and small ones data-parallel, FBGEMM's fused row-wise Adagrad,
one torch thread a rank). hypertron on one process of one device (its tables whole, its routing
one batch ahead: bench/dlrm.py's setup) is timed beside them. Timed: ``--steps`` steps after 5
warm-up steps; samples/s = steps x global batch / the slowest process's time. The two systems do
not start from the same weights here (bench/dlrm.py checks that their steps agree on one
process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/dlrm.py, beside this script


def _hypertron_worker(preset: str, batch: int, steps: int, out: Path) -> None:
    """One process of hypertron's 2-process job (or the whole of a 1-process one)."""
    from hypertron.config import DistributedConfig
    from hypertron.parallel import distributed

    distributed.initialize(DistributedConfig())
    import jax

    from dlrm import _config, _Cycle
    from hypertron.train.dlrm import Recommender, RoutedAhead, make_dlrm_trainer

    cfg = _config(preset, batch)
    task = Recommender()
    trainer = make_dlrm_trainer(cfg, task.mesh(cfg, jax.devices()))
    state = trainer.init(jax.random.key(0))
    stream = task.batches(cfg)  # this process's block of each global batch
    data = RoutedAhead(_Cycle([next(stream) for _ in range(20)]), trainer)  # made before the clock, as TorchRec's
    for _ in range(5):
        state, metrics = trainer.step(state, next(data))
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = trainer.step(state, next(data))
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    data.close()
    placements = sorted({t.spec.placement for t in trainer.tables})
    out.write_text(json.dumps({"seconds": seconds, "loss": float(metrics["loss"]), "placements": placements}))


def _torchrec_worker(preset: str, batch: int, steps: int, out: Path) -> None:
    """One rank of TorchRec's 2-process job (``torchrun``)."""
    import fbgemm_gpu  # noqa: F401  (registers FBGEMM's CPU kernels)
    import torch
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.models.dlrm import DLRM_DCN
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from dlrm import EPS, _config, _torch_batch, torch_step
    from hypertron.recsys.data import make_batches

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(preset, batch)
    d, lr = cfg.dlrm, cfg.train.lr
    configs = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=d.embed_dim, num_embeddings=rows,
                                           feature_names=[f"f{i}"], pooling=torchrec.PoolingType.SUM)
               for i, rows in enumerate(d.table_rows)]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRM_DCN(ebc, dense_in_features=d.dense_features, dense_arch_layer_sizes=list(d.bottom_mlp),
                     over_arch_layer_sizes=list(d.top_mlp), dcn_num_layers=d.cross_layers,
                     dcn_low_rank_dim=d.cross_rank, dense_device=torch.device("cpu"))
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": lr, "eps": EPS})
    sharders = [EmbeddingBagCollectionSharder()]
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu")).collective_plan(
        model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    opt = torch.optim.Adagrad([p for n, p in dmp.named_parameters() if "sparse_arch" not in n], lr=lr, eps=EPS)
    stream = make_batches(d, batch_size=batch // world, seed=0, process_index=rank, process_count=world, shards=8)
    step = torch_step(dmp, opt, [_torch_batch(d, next(stream)) for _ in range(20)])

    for i in range(5):
        step(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(i)
    dist.barrier()
    seconds = time.perf_counter() - t0
    kinds = sorted({str(s.sharding_type) for m in plan.plan.values() for s in m.values()})
    if rank == 0:
        out.write_text(json.dumps({"seconds": seconds, "loss": float(loss), "placements": kinds}))


def _run_hypertron(args, batch: int, processes: int, folder: Path) -> dict:
    from hypertron.launch.local import free_ports, process_env

    port = free_ports()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    outs = [folder / f"h{processes}-{batch}-{i}.json" for i in range(processes)]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "hypertron", "--out", str(out), "--dlrm",
                               args.dlrm, "--batch", str(batch), "--steps", str(args.steps)],
                              env=process_env(env, i, processes, port, 1)) for i, out in enumerate(outs)]
    if any(p.wait() for p in procs):
        sys.exit(f"error: hypertron's {processes}-process run at batch {batch} failed")
    done = [json.loads(out.read_text()) for out in outs]
    return {**done[0], "seconds": max(d["seconds"] for d in done)}


def _run_torchrec(args, batch: int, folder: Path) -> dict:
    out = folder / f"t-{batch}.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    code = subprocess.call([str(torchrun), "--nproc-per-node", "2", __file__, "--worker", "torchrec", "--out",
                            str(out), "--dlrm", args.dlrm, "--batch", str(batch), "--steps", str(args.steps)])
    if code:
        sys.exit(f"error: TorchRec's 2-process run at batch {batch} failed (exit {code})")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dlrm", default="dlrm-v2-tiny", help="a DLRM preset")
    p.add_argument("--batch", type=int, nargs="+", default=[256, 2048, 8192, 16384])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--output", metavar="FILE", help="write the results as JSON")
    p.add_argument("--worker", choices=["hypertron", "torchrec"], help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker = _hypertron_worker if args.worker == "hypertron" else _torchrec_worker
        worker(args.dlrm, args.batch[0], args.steps, args.out)
        return
    from embed import torchrec_versions  # bench/embed.py, beside this script

    print(json.dumps(torchrec_versions(1)))
    print(f"{'batch':>6} | {'hypertron 2 proc':>16} {'TorchRec 2 proc':>16} {'ratio':>6} | "
          f"{'hypertron 1 proc':>16} {'2 / 1':>6} | samples/s")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batch:
            two, one = _run_hypertron(args, batch, 2, Path(tmp)), _run_hypertron(args, batch, 1, Path(tmp))
            torchrec = _run_torchrec(args, batch, Path(tmp))
            rate = {k: args.steps * batch / r["seconds"] for k, r in (("two", two), ("one", one),
                                                                          ("torchrec", torchrec))}
            rows.append({"batch": batch, "hypertron_2proc_samples_per_s": rate["two"],
                         "torchrec_2proc_samples_per_s": rate["torchrec"],
                         "hypertron_1proc_samples_per_s": rate["one"], "hypertron_placements": two["placements"],
                         "torchrec_placements": torchrec["placements"],
                         "losses": {"hypertron_2proc": two["loss"], "torchrec_2proc": torchrec["loss"]}})
            print(f"{batch:>6} | {rate['two']:>16,.0f} {rate['torchrec']:>16,.0f} "
                  f"{rate['two'] / rate['torchrec']:>6.2f} | {rate['one']:>16,.0f} {rate['two'] / rate['one']:>6.2f}",
                  flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
