"""DLRM-v2 training samples/s: hypertron's train step vs TorchRec's, the same model and data, on this CPU.

    make embed-bench-deps          # torch 2.13.0 (CPU), torchrec 1.9.2, fbgemm-gpu-cpu 1.8.0 into .venv
    .venv/bin/python bench/dlrm.py [--dlrm dlrm-v2-tiny] [--batch 256 2048] [--steps 50] [--threads N] \\
        [--output FILE]
    python bench/dlrm.py --hypertron-only --dlrm dlrm-v2 --max-rows 10000000 --batch 16384 65536  # one GPU

The model is the ``--dlrm`` preset (``dlrm-v2-tiny``: 8 tables of 5 to 1,000 rows, dim 16, bottom
32-16, two cross layers of rank 8, top 64-32-1), row-wise Adagrad on the tables and Adagrad on the
MLPs (lr 0.05; 0.004 for ``dlrm-v2``, MLPerf's; eps 1e-8). Both sides train from the same initial weights on the same 20
planted-teacher batches, cycled, and first check that their losses agree over 3 steps. Timed:
``--steps`` steps after 5 warm-up steps, from the first dispatch to the last step's parameters
being ready; samples/s = steps x batch / that time.

- hypertron: :class:`hypertron.train.dlrm.DlrmTrainer` on one CPU device (the tables placed by the
  planner: whole on that device; data-parallel, pooled in the step from the batch's ids with no
  routing, where a table has no more rows than the step's ids), its step as ``hypertron train``
  runs it: the batches routed on the host one ahead, on a thread
  (:class:`hypertron.train.dlrm.RoutedAhead`), the lookups, the compiled dense step, the sparse
  updates. Also timed (``inline``): each step routing its own batch first, as before routing
  moved off the step's path.
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

EPS = 1e-8
LR = {"dlrm-v2": 0.004}  # MLPerf's reference (Adagrad); Adagrad's first step moves every weight by about lr
TINY_LR = 0.05


def _config(preset: str, batch: int, max_rows: int | None = None):
    """The bench's config of ``preset`` (its learning rate: :data:`LR`, else :data:`TINY_LR`);
    ``max_rows`` caps every table (as MLPerf's 40M cap does)."""
    from hypertron.config import load_config
    from hypertron.config.presets import DLRM_PRESETS

    rows = DLRM_PRESETS[preset].table_rows
    capped = [f"dlrm.table_rows={','.join(str(min(r, max_rows)) for r in rows)}"] if max_rows else []
    lr = LR.get(preset, TINY_LR)
    return load_config(None, ["task=dlrm", f"dlrm={preset}", f"train.global_batch={batch}", f"train.lr={lr}",
                              "train.schedule=constant", "train.warmup_steps=0", f"dlrm.eps={EPS}",
                              "dlrm.optimizer=rowwise_adagrad", *capped])


class _Cycle:
    """The bench's batches, endlessly, with a position as a Grain iterator has one."""

    def __init__(self, batches: list[dict]):
        self.batches, self.i = batches, 0

    def __next__(self) -> dict:
        self.i += 1
        return self.batches[(self.i - 1) % len(self.batches)]

    def get_state(self) -> dict:
        return {"i": self.i}

    def set_state(self, state: dict) -> None:
        self.i = state["i"]


def measure(cfg, batches: list[dict], steps: int, warmup: int = 5, keep_initial: bool = False) -> dict:
    """hypertron's training speed on one device: ``compile_s`` (the first step, with its compile),
    ``route_ms`` (the host's routing of a batch), ``step_ms`` and ``samples_s`` with the routing
    one batch ahead (as ``hypertron train`` runs it), ``inline_step_ms`` with each step routing its
    own batch, the first 3 ``losses``; with ``keep_initial`` the initial state on the host and the
    trainer (for TorchRec's copy)."""
    import jax

    from hypertron.train.dlrm import Recommender, RoutedAhead, make_dlrm_trainer

    trainer = make_dlrm_trainer(cfg, Recommender().mesh(cfg, jax.devices()[:1]))
    state = trainer.init(jax.random.key(0))
    out = {"trainer": trainer, "initial": jax.device_get(state)} if keep_initial else {}
    t0 = time.perf_counter()
    losses = []
    for i in range(max(warmup, 3)):
        state, m = trainer.step(state, batches[i % len(batches)])
        if i < 3:
            losses.append(float(m["loss"]))  # waits for the step
        if i == 0:
            out["compile_s"] = time.perf_counter() - t0
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for i in range(steps):
        trainer.route(batches[i % len(batches)])
    route = (time.perf_counter() - t0) / steps
    t0 = time.perf_counter()
    for i in range(steps):
        state, m = trainer.step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    inline = (time.perf_counter() - t0) / steps
    ahead = RoutedAhead(_Cycle(batches), trainer)
    next(ahead)  # the first batch's routing, before the clock as the others are
    t0 = time.perf_counter()
    for i in range(steps):
        state, m = trainer.step(state, next(ahead))
    jax.block_until_ready(state)
    seconds = (time.perf_counter() - t0) / steps
    ahead.close()
    batch = cfg.train.global_batch
    return {**out, "route_ms": route * 1e3, "step_ms": seconds * 1e3, "samples_s": batch / seconds,
            "inline_step_ms": inline * 1e3, "losses": losses, "loss": float(m["loss"])}


def run_torchrec(cfg, batches: list[dict], steps: int, trainer, initial) -> tuple[float, list[float]]:
    """TorchRec's seconds for ``steps`` steps and its first 3 losses, from hypertron's ``initial`` weights."""
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
    lr = cfg.train.lr
    ebc = FusedEmbeddingBagCollection(tables=configs, optimizer_type=RowWiseAdagrad,
                                      optimizer_kwargs={"lr": lr, "eps": EPS}, device=torch.device("cpu"))
    model = DLRM_DCN(ebc, dense_in_features=d.dense_features, dense_arch_layer_sizes=list(d.bottom_mlp),
                     over_arch_layer_sizes=list(d.top_mlp), dcn_num_layers=d.cross_layers,
                     dcn_low_rank_dim=d.cross_rank)
    _copy_weights(model, ebc, trainer, initial)
    dense = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch.")]
    opt = torch.optim.Adagrad(dense, lr=lr, eps=EPS)
    step = torch_step(model, opt, [_torch_batch(d, b) for b in batches])
    check = [step(i).item() for i in range(3)]
    for i in range(5):
        step(i)
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    return time.perf_counter() - t0, check


def torch_step(model, opt, inputs: list):
    """``step(i)``: one training step of ``model`` on ``inputs[i % len(inputs)]`` (its loss)."""
    import torch

    def step(i: int):
        x, kjt, y = inputs[i % len(inputs)]
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x, kjt).squeeze(-1), y)
        loss.backward()
        opt.step()
        return loss

    return step


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
    p.add_argument("--max-rows", type=int, help="cap every table at this many rows (to fit a device)")
    p.add_argument("--batches", type=int, default=20, help="distinct batches, cycled")
    p.add_argument("--hypertron-only", action="store_true", help="no TorchRec (on a GPU: the largest model it holds)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch's threads (default: the cores)")
    p.add_argument("--output", metavar="FILE", help="write the results as JSON")
    args = p.parse_args()
    import jax

    from hypertron.recsys.data import synthetic_batch

    if args.hypertron_only:
        versions = {"jax": jax.__version__, "device": str(jax.devices()[0])}
    else:
        from embed import torchrec_versions  # bench/embed.py, beside this script

        versions = {**torchrec_versions(args.threads), "device": str(jax.devices()[0])}
    print(json.dumps(versions))
    print(f"{'batch':>6} | {'hypertron samples/s':>20} {'(route, step, inline step ms)':>30} "
          f"{'TorchRec samples/s':>20} {'ratio':>6} | losses of 3 steps (h / t)")
    results = []
    for batch in args.batch:
        cfg = _config(args.dlrm, batch, args.max_rows)
        batches = [synthetic_batch(i, cfg=cfg.dlrm, batch_size=batch, seed=0)
                   for i in range(args.batches)]
        h = measure(cfg, batches, args.steps, keep_initial=not args.hypertron_only)
        row = {"batch": batch, "table_rows": list(cfg.dlrm.table_rows), "hypertron_samples_per_s": h["samples_s"],
               "hypertron_route_ms": h["route_ms"], "hypertron_step_ms": h["step_ms"],
               "hypertron_inline_step_ms": h["inline_step_ms"],
               "hypertron_compile_s": h["compile_s"], "hypertron_losses": h["losses"]}
        t_rate, t_check = None, []
        if not args.hypertron_only:
            t_s, t_check = run_torchrec(cfg, batches, args.steps, h["trainer"], h["initial"])
            np.testing.assert_allclose(h["losses"], t_check, rtol=1e-4, atol=1e-5)
            t_rate = args.steps * batch / t_s
            row.update(torchrec_samples_per_s=t_rate, torchrec_losses=t_check)
        results.append(row)
        ratio = f"{h['samples_s'] / t_rate:>6.2f}" if t_rate else f"{'':>6}"
        print(f"{batch:>6} | {h['samples_s']:>20,.0f} {h['route_ms']:>9.1f} {h['step_ms']:>10.1f} "
              f"{h['inline_step_ms']:>10.1f} "
              f"{t_rate or float('nan'):>20,.0f} {ratio} | {' '.join(f'{x:.4f}' for x in h['losses'])} / "
              f"{' '.join(f'{x:.4f}' for x in t_check)}", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"versions": versions, "args": vars(args), "results": results},
                                                indent=1))


if __name__ == "__main__":
    main()
