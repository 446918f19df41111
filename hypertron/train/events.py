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

EVENTS_FILE = "events.jsonl"
TENSORBOARD_DIR = "tensorboard"

# Every name ``EventLog.emit`` accepts, in the order they usually occur.
EVENTS = (
    "job_start",            # pid, host, process_count, argv
    "backend_ready",        # platform, device_count, local_device_count, seconds (since job_start)
    "checkpoint_skipped",   # step, reason: a checkpoint found unusable before restoring
    "restore_start",        # step
    "restore_end",          # step, seconds, data_restored (bool)
    "first_step",           # step, seconds (since job_start: startup, restore and compile included)
    "step",                 # step, step_time, data_wait (seconds)
    "eval",                 # step, loss, tokens, seconds
    "checkpoint_save_start",  # step, reason: interval | final | preemption
    "checkpoint_save_end",  # step, seconds (start to final on disk), blocking_seconds
    "preemption",           # step, signal: the step reached when SIGTERM was seen
    "job_end",              # step, status: completed | preempted | interrupted | failed, seconds
)


def events_path(run_dir: str | Path, process_index: int = 0) -> Path:
    name = EVENTS_FILE if process_index == 0 else f"events.{process_index}.jsonl"
    return Path(run_dir) / name


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
        self._file = events_path(run_dir, process_index).open("a", buffering=1)
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


def job_start_fields(process_count: int) -> dict[str, Any]:
    import socket
    import sys

    return {"pid": os.getpid(), "host": socket.gethostname(), "process_count": process_count,
            "argv": sys.argv}
