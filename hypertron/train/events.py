"""Job events: what happened to a training job and when, for goodput and straggler analysis.

Each process appends one JSON object per line to its own file in the run
directory: process 0 to ``events.jsonl``, process ``i > 0`` to
``events.<i>.jsonl``, so no line is written twice and no two writers share a
file. Every event has ``time`` (Unix seconds, float), ``event`` (a name),
``process`` (the JAX process index) and ``step`` (or null); the other fields
depend on the event. The schema is documented in ``docs/events.md``.

Process 0 also writes the scalars (train and eval loss, step time, data
wait, throughput) as TensorBoard event files under ``run_dir/tensorboard``,
with ``tensorboardX``: it writes the TensorBoard file format without pulling
in TensorFlow or the TensorBoard server.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from hypertron.runfiles import EVENTS, TENSORBOARD_DIR, events_path


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of one file, oldest first (a torn last line, from a killed writer, is skipped)."""
    events = []
    for line in Path(path).read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


class EventLog:
    """Appends events for this process; thread-safe (checkpoint ends arrive from Orbax's thread)."""

    def __init__(self, run_dir: str | Path, process_index: int = 0, tensorboard: bool = True,
                 start_time: float | None = None):
        self.process_index = process_index
        self.start_time = time.time() if start_time is None else start_time  # when the job began
        self._lock = threading.Lock()
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        path = events_path(run_dir, process_index)
        self._file = path.open("a", buffering=1)
        if _ends_mid_line(path):  # a killed writer's torn line: it stays alone on its line
            self._file.write("\n")
        self._tb = None
        if tensorboard and process_index == 0:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR), flush_secs=10)

    def emit(self, event: str, step: int | None = None, *, at: float | None = None,
             **fields: Any) -> dict[str, Any]:
        """Write one event, stamped now (or ``at``, a Unix time); returns it."""
        if event not in EVENTS:
            raise ValueError(f"unknown event {event!r}")
        record = {"time": time.time() if at is None else at, "event": event, "process": self.process_index, "step": step, **fields}
        line = json.dumps(record)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
        return record

    def seconds(self) -> float:
        """Seconds since this log (the job) started."""
        return time.time() - self.start_time

    def scalars(self, step: int, values: dict[str, float | None], prefix: str = "train") -> None:
        """TensorBoard scalars ``prefix/name`` at ``step`` (process 0 only; None values skipped)."""
        if self._tb is None:
            return
        with self._lock:
            for name, value in values.items():
                if value is not None:
                    self._tb.add_scalar(f"{prefix}/{name}", value, step)

    def close(self) -> None:
        with self._lock:
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            self._file.close()


def _ends_mid_line(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def job_start_fields(process_count: int) -> dict[str, Any]:
    import socket
    import sys

    return {"pid": os.getpid(), "host": socket.gethostname(), "process_count": process_count,
            "argv": sys.argv}
