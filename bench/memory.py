"""The activation estimate of the memory model against XLA's own accounting of the train step.

    python bench/memory.py [--held-out | --pipeline]

For each configuration (the 14 the coefficients in ``hypertron/models/memory.py`` were fitted
to, with ``--held-out`` the cases of ``tests/test_memory.py``, with ``--pipeline`` the 72 that
``memory.STAGED`` was fitted to: 24 for each remat policy), compiles hypertron's train step on
8 CPU devices (``mesh.data=8``, batch 8: one row per device, unless the case says), reads
``compiled.memory_analysis().temp_size_in_bytes`` (XLA's temporaries: the activations and the
gradients) and prints it beside :func:`hypertron.models.memory.step_bytes`'s activations +
gradients, with the error. Nothing runs; each compile takes a few seconds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WIDE = "model.mlp_dim=1536 model.num_heads=8 model.num_kv_heads=8 model.head_dim=64 model.max_seq_len=8192"
FIT = [f"model.remat={r} train.seq_len={t} model.embed_dim=512 model.num_layers={n} {WIDE}" for r, t, n in (
    ("none", 2048, 1), ("full", 2048, 2), ("none", 2048, 2), ("dots", 2048, 2), ("none", 4096, 1),
    ("full", 1024, 3), ("none", 1024, 3), ("dots", 1024, 3))] + [
    f"model.remat={r} train.seq_len=2048 model.embed_dim=1024 model.num_layers=2 {WIDE} model.mlp_dim=3072 "
    "model.num_heads=16 model.num_kv_heads=4" for r in ("full", "none")] + [
    f"model.remat=full train.seq_len=512 model.embed_dim=512 model.num_layers=1 model.vocab_size=32000 {WIDE}",
    f"model.remat=full train.seq_len=1024 model.embed_dim=512 model.num_layers=1 model.vocab_size=64000 {WIDE}",
    f"model.remat=none train.seq_len=2048 model.embed_dim=512 model.num_layers=2 train.global_batch=16 {WIDE}",
    f"model.remat=full train.seq_len=2048 model.embed_dim=768 model.num_layers=2 {WIDE} model.num_heads=12 "
    "model.num_kv_heads=4 model.mlp_dim=2048"]


def pipeline() -> list[str]:
    """Stages 2 and 4, pieces 2-8, repeats 1-2, data or fsdp beside them, 8 rows a data shard."""
    widths = {f"{WIDE} model.embed_dim=512": (1024, 2048), f"{WIDE} model.embed_dim=768 model.mlp_dim=2048 "
              "model.num_heads=12 model.num_kv_heads=4": (2048,)}
    return [f"{wide} model.remat={remat} train.seq_len={t} mesh.stage={s} mesh.data={8 // s if axis == 'data' else 1} "
            f"mesh.fsdp={8 // s if axis == 'fsdp' else 1} "
            f"train.global_batch={8 * 8 // s} train.pipeline_microbatches={m} model.num_layers={n} "
            f"train.pipeline_repeats={r}"
            for wide, lengths in widths.items() for remat in ("none", "dots", "full") for t in lengths
            for s, m, r, n, axis in ((2, 2, 1, 2, "data"), (2, 4, 1, 2, "data"), (2, 8, 1, 2, "data"),
                                     (2, 4, 1, 4, "data"), (2, 4, 2, 4, "data"), (4, 4, 1, 4, "data"),
                                     (4, 4, 2, 8, "data"), (2, 4, 1, 2, "fsdp"))]


def held_out() -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_memory import HELD_OUT

    return [" ".join(["train.seq_len=2048", "model.num_layers=2", "model.head_dim=64", f"model.remat={r}",
                      *(mesh or ["mesh.data=8"]), *model]) for r, model, mesh in HELD_OUT]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--held-out", action="store_true", help="the test's held-out configurations instead")
    ap.add_argument("--pipeline", action="store_true", help="the pipeline configurations instead")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    from hypertron.config import load_config
    from hypertron.models import memory
    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.step import BATCH_KEYS, make_trainer

    print(f"# memory model vs XLA  {datetime.date.today()}  {platform.node()}  JAX {jax.__version__}  "
          f"{jax.devices()[0].platform}")
    which = "--held-out" if args.held_out else "--pipeline" if args.pipeline else ""
    print(f"# command: python bench/memory.py {which}")
    print(f"{'XLA temp':>10} {'estimate':>10} {'error':>7}  configuration")
    for extra in (held_out() if args.held_out else pipeline() if args.pipeline else FIT):
        cfg = load_config(None, ["model=tiny", "data.source=synthetic", "mesh.data=8", "mesh.fsdp=1",
                                 "train.global_batch=8", *extra.split()])
        trainer = make_trainer(cfg, make_mesh(cfg.mesh))
        state = jax.eval_shape(trainer.init, jax.random.key(0))
        rows, t = cfg.train.global_batch, cfg.train.seq_len
        batch = {k: jax.ShapeDtypeStruct((rows, t), jnp.float32 if k == "loss_weights" else jnp.int32)
                 for k in BATCH_KEYS}
        xla = trainer.step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
        est = memory.step_bytes(cfg, dict(trainer.mesh.shape))
        got = est.activations + est.state.grads
        print(f"{xla / 2**20:8.0f}Mi {got / 2**20:8.0f}Mi {100 * (got - xla) / xla:+6.1f}%  {extra}", flush=True)


if __name__ == "__main__":
    main()
