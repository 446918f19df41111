"""DLRM-v2 training samples/s: hypertron's train step vs TorchRec's, the same model and data, on this CPU.

    make embed-bench-deps          # torch 2.13.0 (CPU), torchrec 1.9.2, fbgemm-gpu-cpu 1.8.0 into .venv
    .venv/bin/python bench/dlrm.py [--dlrm dlrm-v2-tiny] [--batch 256 2048] [--steps 50] [--threads N] \\
        [--output FILE]

The model is the ``--dlrm`` preset (``dlrm-v2-tiny``: 8 tables of 5 to 1,000 rows, dim 16, bottom
32-16, two cross layers of rank 8, top 64-32-1), row-wise Adagrad on the tables and Adagrad on the
MLPs (lr 0.05, eps 1e-8). Both sides train from the same initial weights on the same 20
planted-teacher batches, cycled, and first check that their losses agree over 3 steps. Timed:
``--steps`` steps after 5 warm-up steps, from the first dispatch to the last step's parameters
being ready; samples/s = steps x batch / that time.

- hypertron: :class:`hypertron.train.dlrm.DlrmTrainer` on one CPU device (the tables placed by the
  planner: whole, on that device), its step as ``hypertron train`` runs it: routing on the host,
  the lookups, the compiled dense step, the sparse updates.
- TorchRec: ``DLRM_DCN`` over a ``FusedEmbeddingBagCollection`` (FBGEMM's CPU kernels, row-wise
  Adagrad fused into backward) and ``torch.optim.Adagrad`` on the MLPs: TorchRec's single-process
  training setup, eager.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

LR, EPS = 0.05, 1e-8


def _config(preset: str, batch: int):
    from hypertron.config import load_config

    return load_config(None, ["task=dlrm", f"dlrm={preset}", f"train.global_batch={batch}", f"train.lr={LR}",
                              "train.schedule=constant", "train.warmup_steps=0", f"dlrm.eps={EPS}",
                              "dlrm.optimizer=rowwise_adagrad"])


def run_hypertron(cfg, batches: list[dict], steps: int) -> tuple[float, list[float], object]:
    import jax

    from hypertron.train.dlrm import Recommender, make_dlrm_trainer

    trainer = make_dlrm_trainer(cfg, Recommender().mesh(cfg, jax.devices()[:1]))
    state = trainer.init(jax.random.key(0))
    initial = jax.device_get(state)
    check = []
    for b in batches[:3]:
        state, m = trainer.step(state, b)
        check.append(float(m["loss"]))
    for i in range(5):
        state, m = trainer.step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for i in range(steps):
        state, m = trainer.step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    return time.perf_counter() - t0, check, (trainer, initial)


def run_torchrec(cfg, batches: list[dict], steps: int, trainer, initial) -> tuple[float, list[float]]:
    import fbgemm_gpu  # noqa: F401  (registers FBGEMM's CPU kernels)
    import torch
    import torchrec
    from torchrec.models.dlrm import DLRM_DCN
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    d = cfg.dlrm
    configs = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=d.embed_dim, num_embeddings=rows,
                                           feature_names=[f"f{i}"], pooling=torchrec.PoolingType.SUM)
               for i, rows in enumerate(d.table_rows)]
    ebc = FusedEmbeddingBagCollection(tables=configs, optimizer_type=RowWiseAdagrad,
                                      optimizer_kwargs={"lr": LR, "eps": EPS}, device=torch.device("cpu"))
    model = DLRM_DCN(ebc, dense_in_features=d.dense_features, dense_arch_layer_sizes=list(d.bottom_mlp),
                     over_arch_layer_sizes=list(d.top_mlp), dcn_num_layers=d.cross_layers,
                     dcn_low_rank_dim=d.cross_rank)
    _copy_weights(model, ebc, trainer, initial)
    dense = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch.")]
    opt = torch.optim.Adagrad(dense, lr=LR, eps=EPS)
    inputs = [_torch_batch(d, b) for b in batches]

    def step(i: int) -> float:
        x, kjt, y = inputs[i % len(inputs)]
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x, kjt).squeeze(-1), y)
        loss.backward()
        opt.step()
        return loss

    check = [step(i).item() for i in range(3)]
    for i in range(5):
        step(i)
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    return time.perf_counter() - t0, check


def _torch_batch(d, b: dict):
    import torch
    import torchrec

    n = len(b["labels"])
    values, lengths, start = [], [], 0
    for hot in d.ids_per_sample:
        values.append(b["sparse"][:, start:start + hot].reshape(-1))
        lengths.append(np.full(n, hot))
        start += hot
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(d.table_rows))],
        values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
        lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int64)))
    return torch.from_numpy(b["dense"]), kjt, torch.from_numpy(b["labels"])


def _copy_weights(model, ebc, trainer, initial) -> None:
    """hypertron's initial weights into the TorchRec model: the fused tables through FBGEMM's
    weights, the rest by ``DLRM_DCN``'s parameter names."""
    import dataclasses

    import torch

    from hypertron.recsys.dlrm import torchrec_state_dict

    tables = [dataclasses.replace(t, data=initial["params"]["tables"][t.spec.name], state=None).dense()[0]
              for t in trainer.tables]
    weights = torchrec_state_dict(initial["params"]["dense"], tables)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for w, t in zip(ebc._emb_modules[0]._emb_module.split_embedding_weights(), tables):
            w.copy_(torch.from_numpy(np.array(t)))
        for name, value in weights.items():
            if not name.startswith("sparse_arch."):
                named[name].copy_(torch.from_numpy(np.array(value)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dlrm", default="dlrm-v2-tiny", help="a DLRM preset")
    p.add_argument("--batch", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch's threads (default: the cores)")
    p.add_argument("--output", metavar="FILE", help="write the results as JSON")
    args = p.parse_args()
    import jax
    from embed import torchrec_versions  # bench/embed.py, beside this script

    from hypertron.recsys.data import synthetic_batch

    versions = {**torchrec_versions(args.threads), "device": str(jax.devices()[0])}
    print(json.dumps(versions))
    print(f"{'batch':>6} | {'hypertron samples/s':>20} {'TorchRec samples/s':>20} {'ratio':>6} | "
          "losses of 3 steps (h / t)")
    results = []
    for batch in args.batch:
        cfg = _config(args.dlrm, batch)
        batches = [synthetic_batch(i, cfg=cfg.dlrm, batch_size=batch, seed=0, process_index=0, stream=0)
                   for i in range(20)]
        h_s, h_check, (trainer, initial) = run_hypertron(cfg, batches, args.steps)
        t_s, t_check = run_torchrec(cfg, batches, args.steps, trainer, initial)
        np.testing.assert_allclose(h_check, t_check, rtol=1e-4, atol=1e-5)
        h_rate, t_rate = args.steps * batch / h_s, args.steps * batch / t_s
        results.append({"batch": batch, "hypertron_samples_per_s": h_rate, "torchrec_samples_per_s": t_rate,
                        "hypertron_losses": h_check, "torchrec_losses": t_check})
        print(f"{batch:>6} | {h_rate:>20,.0f} {t_rate:>20,.0f} {h_rate / t_rate:>6.2f} | "
              f"{' '.join(f'{x:.4f}' for x in h_check)} / {' '.join(f'{x:.4f}' for x in t_check)}", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"versions": versions, "args": vars(args), "results": results},
                                                indent=1))


if __name__ == "__main__":
    main()
