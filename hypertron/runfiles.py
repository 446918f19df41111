"""The files a training run directory holds that more than one layer reads: their names and the
job-event schema (``docs/events.md``).

``train`` writes them and ``monitor`` reads them; neither imports the other, so what both must
agree on lives here, below both. This module imports nothing of hypertron's.
"""

from __future__ import annotations

import re
from pathlib import Path

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
HOST_METRICS = re.compile(r"^host_metrics\.(\d+)\.jsonl$")  # one per process (docs/monitoring.md)

# Every event name, in the order they usually occur within a job, with the fields each adds
# to the common ones (time, event, process, step).
EVENTS = (
    "job_start",            # pid, host, process_count, argv
    "backend_ready",        # platform, device_count, local_device_count, seconds (since job_start)
    "checkpoint_skipped",   # step, reason: a checkpoint found unusable before restoring
    "restore_start",        # step
    "restore_end",          # step, seconds, data_restored (bool)
    "first_step",           # step, seconds (since job_start: startup, restore and compile included)
    "step",                 # step, step_time, data_wait (seconds); time = when the step ended
    "eval",                 # step, loss, tokens, seconds
    "checkpoint_save_start",  # step, reason: interval | final | preemption
    "checkpoint_save_end",  # step, seconds (start to final on disk), blocking_seconds
    "preemption",           # step, signal: the step reached when SIGTERM was seen
    "job_end",              # step, status: completed | preempted | interrupted | failed, seconds
)

_PROCESS_FILE = re.compile(r"^events(?:\.(\d+))?\.jsonl$")


def events_path(run_dir: str | Path, process_index: int = 0) -> Path:
    """Process 0 writes ``events.jsonl``; process ``i > 0`` writes ``events.<i>.jsonl``."""
    name = EVENTS_FILE if process_index == 0 else f"events.{process_index}.jsonl"
    return Path(run_dir) / name


def event_files(run_dir: str | Path) -> dict[int, Path]:
    """``{process index: events file}`` for every process that wrote one, in process order."""
    found = {}
    for path in Path(run_dir).iterdir():
        m = _PROCESS_FILE.match(path.name)
        if m and path.is_file():
            found[int(m.group(1) or 0)] = path
    return dict(sorted(found.items()))


def host_metrics_path(run_dir: str | Path, process_index: int) -> Path:
    """Process ``i`` samples its host into ``host_metrics.<i>.jsonl``."""
    return Path(run_dir) / f"host_metrics.{process_index}.jsonl"


def host_metrics_files(run_dir: str | Path) -> dict[int, Path]:
    """``{process index: host metrics file}``, in process order."""
    found = {int(m.group(1)): p for p in Path(run_dir).iterdir()
             if (m := HOST_METRICS.match(p.name)) and p.is_file()}
    return dict(sorted(found.items()))
