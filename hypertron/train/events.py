"""Job events: what happened to a training job and when, for goodput and straggler analysis.

Each process appends one JSON object per line to its own file in the run
directory: process 0 to ``events.jsonl``, process ``i > 0`` to
``events.<i>.jsonl``, so no line is written twice and no two writers share a
file. Every event has ``time`` (Unix seconds, float), ``event`` (a name),
``process`` (the JAX process index) and ``step`` (or null); the other fields
depend on the event. The schema is documented in ``docs/events.md``; the
loop stamps events once (:class:`hypertron.tracker.Tracking`) and
:class:`EventFile` is the sink that writes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from hypertron.runfiles import events_path
from hypertron.tracker import Tracker


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of one file, oldest first (a torn last line, from a killed writer, or any other line
    that is not a JSON object, is skipped)."""
    events = []
    for line in Path(path).read_bytes().splitlines():
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):  # not JSON or not UTF-8; nested past Python's stack
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


class EventFile(Tracker):
    """The sink that appends this process's events to its file in the run directory."""

    def __init__(self, run_dir: str | Path, process_index: int = 0):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        path = events_path(run_dir, process_index)
        self._file = path.open("a", buffering=1)
        if _ends_mid_line(path):  # a killed writer's torn line: it stays alone on its line
            self._file.write("\n")

    def event(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def finish(self, status: str) -> None:
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
