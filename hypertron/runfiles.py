"""The files a training run directory holds that more than one layer reads: their names, the
job-event schema (``docs/events.md``) and the host-metric table (``docs/monitoring.md``).

``train`` writes them and ``monitor`` reads them; neither imports the other, so what both must
agree on lives here, below both. This module imports nothing of hypertron's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
HOST_METRICS_FILE = re.compile(r"^host_metrics\.(\d+)\.jsonl$")  # one per process (docs/monitoring.md)

# Every field an event may carry, and its JSON type: the four every event has, then the others.
EVENT_FIELDS: dict[str, type] = {
    "time": float, "event": str, "process": int, "step": int,  # step: null before training starts
    "pid": int, "host": str, "process_count": int, "argv": list, "platform": str, "device_count": int,
    "local_device_count": int, "mesh": dict, "mesh_coords": list, "seconds": float, "reason": str,
    "data_restored": bool, "step_time": float, "data_wait": float, "loss": float, "tokens": float, "auc": float,
    "samples": float, "signal": str, "blocking_seconds": float, "status": str, "batch_digest": str,
    "saved_topology": dict, "topology": dict,
}
COMMON_FIELDS = ("time", "event", "process", "step")
# The Unix times a run file's ``time`` may hold, and ``monitor --since`` take: 1970 to the end of
# year 9999 (what a date can show); a line with a time outside is skipped as unreadable.
TIME_RANGE = (0.0, 253402300799.0)

# Every event name, in the order they usually occur within a job, with the fields it adds to the
# common ones.
EVENTS: dict[str, tuple[str, ...]] = {
    "job_start": ("pid", "host", "process_count", "argv"),
    # seconds since job_start; mesh: axis sizes; mesh_coords: this process's devices' coordinates
    "backend_ready": ("platform", "device_count", "local_device_count", "seconds", "mesh", "mesh_coords",
                      "process_count"),
    "checkpoint_skipped": ("reason",),  # a checkpoint found unusable before restoring
    "restore_start": (),
    # saved_topology, topology: {processes, devices, mesh} of the run that saved the step, and of this one
    "restore_end": ("seconds", "data_restored", "saved_topology", "topology"),
    "first_step": ("seconds",),  # since job_start: startup, restore and compile included
    "step": ("step_time", "data_wait", "batch_digest"),  # seconds; time = when the step ended; the rows' CRC-32
    "eval": ("loss", "tokens", "auc", "samples", "seconds"),  # the task's: tokens (lm), auc and samples (dlrm)
    "checkpoint_save_start": ("reason",),  # interval | final | preemption
    "checkpoint_save_end": ("seconds", "blocking_seconds"),  # start to final on disk; training's wait
    "preemption": ("signal",),  # the step reached when SIGTERM was seen
    "job_end": ("status", "seconds"),  # completed | preempted | interrupted | failed
}

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
             if (m := HOST_METRICS_FILE.match(p.name)) and p.is_file()}
    return dict(sorted(found.items()))


# --- host metrics --------------------------------------------------------------------------------

Unit = Literal["seconds", "bytes", "bytes/s", "ratio", "watts", "celsius", "count", "number"]


@dataclass(frozen=True, kw_only=True)
class Metric:
    """One figure the monitor knows: where it is kept, its unit, and who shows it how.

    A host metric is a field of every line of ``host_metrics.<i>.jsonl`` (a number, or null when
    not measured in that interval), unless ``rate_of`` names a counter: then it is that counter's
    rate per second, which the report computes from consecutive samples and never written."""

    key: str  # the field of host_metrics.<i>.jsonl; with rate_of, the report's name for the rate
    unit: Unit  # how the report and the dashboard print it (ratio: 0-1, printed as a percentage)
    help: str  # what it is (Prometheus's HELP)
    label: str = ""  # the report's and the dashboard's name for it
    outlier: bool = False  # the report ranks the processes by its window mean and max
    straggler: tuple[int, float] | None = None  # scored for stragglers: (values per window, floor in seconds)
    rate_of: str | None = None  # the counter this is the per-second rate of
    prometheus: str | None = None  # its name on /metrics (ending in its unit), None: not shown there
    kind: Literal["gauge", "counter"] = "gauge"  # its Prometheus type
    # A figure the collector does not read itself: called in the collector's thread at each sample.
    sample: Callable[[], float | None] | None = None


# Every host metric: the collector writes them in this order; /metrics, the report's columns, its
# outliers and straggler scores and the dashboard's names and formats follow from here.
HOST_METRICS = (
    Metric(key="cpu_utilization_mean", unit="ratio", help="host CPU utilisation, mean over cores",
           label="CPU (mean)", outlier=True, prometheus="hypertron_host_cpu_utilization_ratio"),
    Metric(key="cpu_utilization_max", unit="ratio", help="host CPU utilisation of the busiest core",
           label="CPU (busiest core)", outlier=True, prometheus="hypertron_host_cpu_max_utilization_ratio"),
    Metric(key="host_memory_used_bytes", unit="bytes", help="host memory in use", label="host memory",
           outlier=True, prometheus="hypertron_host_memory_used_bytes"),
    Metric(key="rss_bytes", unit="bytes", help="this process's resident memory", label="process RSS",
           outlier=True, prometheus="hypertron_process_rss_bytes"),
    Metric(key="device_memory_used_bytes", unit="bytes", help="accelerator memory in use (this process's devices)",
           label="device memory", outlier=True, prometheus="hypertron_device_memory_used_bytes"),
    Metric(key="device_memory_peak_bytes", unit="bytes", help="peak accelerator memory in use",
           label="device memory peak", outlier=True, prometheus="hypertron_device_memory_peak_bytes"),
    Metric(key="device_memory_limit_bytes", unit="bytes", help="accelerator memory available to this process"),
    Metric(key="gpu_utilization", unit="ratio", help="GPU utilisation (NVML), mean over this process's GPUs",
           label="GPU utilisation", outlier=True, prometheus="hypertron_gpu_utilization_ratio"),
    Metric(key="gpu_power_watts", unit="watts", help="GPU power draw (NVML), summed", label="GPU power (W)",
           outlier=True, prometheus="hypertron_gpu_power_watts"),
    Metric(key="gpu_temperature_celsius", unit="celsius", help="GPU temperature (NVML), the hottest",
           label="GPU temperature (C)", outlier=True, prometheus="hypertron_gpu_temperature_celsius"),
    Metric(key="network_sent_bytes", unit="bytes", help="bytes the host sent",
           prometheus="hypertron_network_sent_bytes_total", kind="counter"),
    Metric(key="network_received_bytes", unit="bytes", help="bytes the host received",
           prometheus="hypertron_network_received_bytes_total", kind="counter"),
    Metric(key="network_sent_bytes_per_second", unit="bytes/s", help="bytes the host sent per second",
           label="network sent", outlier=True, rate_of="network_sent_bytes"),
    Metric(key="network_received_bytes_per_second", unit="bytes/s", help="bytes the host received per second",
           label="network received", outlier=True, rate_of="network_received_bytes"),
    Metric(key="steps", unit="count", help="steps finished since the last sample"),
    Metric(key="data_wait_mean", unit="seconds", help="the mean wait for a batch over those steps"),
    Metric(key="data_wait_max", unit="seconds", help="the longest wait for a batch over those steps"),
    Metric(key="step_time_mean", unit="seconds", help="the mean step time over those steps"),
    Metric(key="step_time_max", unit="seconds", help="the longest step time over those steps"),
    Metric(key="h2d_seconds", unit="seconds", help="the last timed host-to-device copy", label="host to device",
           outlier=True, straggler=(5, 0.005), prometheus="hypertron_host_to_device_seconds"),
    Metric(key="h2d_bytes", unit="bytes", help="the bytes of that copy"),
)


def sampled_metrics() -> tuple[Metric, ...]:
    """The fields of a host sample, in order: ``HOST_METRICS`` less the rates the report computes
    (read at each call, so a metric added to the table is seen everywhere)."""
    return tuple(m for m in HOST_METRICS if m.rate_of is None)
