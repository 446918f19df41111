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
