"""What a run directory records, read back the way the tests compare runs."""

from __future__ import annotations

import json
from pathlib import Path

from hypertron.train.events import read_events


def losses(run: Path) -> dict[int, float]:
    """Train loss per step from metrics.jsonl; a step logged twice (killed, then redone) keeps the later."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def steps(run: Path) -> list[int]:
    """The steps of the step events so far (none before events.jsonl exists)."""
    path = run / "events.jsonl"
    return [e["step"] for e in read_events(path) if e["event"] == "step"] if path.exists() else []


def write_documents(directory: Path, documents: list[str]) -> str:
    """One ``doc<i>.txt`` per document in a new ``directory``; returns its path."""
    directory.mkdir()
    for i, text in enumerate(documents):
        (directory / f"doc{i}.txt").write_text(text, encoding="utf-8")
    return str(directory)


def train_steps(overrides: list[str], devices, steps: int):
    """``steps`` steps of the task ``overrides`` configure, in process on ``devices`` (None: all),
    from key 0: (the losses, the parameters on the host). The mesh tests compare these."""
    import jax
    import numpy as np

    from hypertron.config import load_config
    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.task import task_for

    cfg = load_config(None, overrides)
    task = task_for(cfg)
    trainer = task.trainer(cfg, make_mesh(cfg.mesh, devices))
    state, batches, losses = trainer.init(jax.random.key(0)), task.batches(cfg), []
    for _ in range(steps):
        state, metrics = task.step(trainer, state, next(batches))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state["params"])
