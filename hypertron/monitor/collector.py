"""What each training process measures about its host, off the step's critical path.

:class:`Collector` is a sink of the training loop's tracker interface
(:mod:`hypertron.tracker`); ``hypertron train`` adds one per process unless
``monitor.collect=false``. From the loop it only keeps each step's data wait and step time
(appending to a list: no device access, nothing that waits). A background thread samples,
every ``monitor.interval`` seconds:

* host CPU utilisation (mean and max over cores), host memory in use, the process's RSS;
* accelerator memory in use, its peak and limit (``device.memory_stats()``, summed over
  this process's devices; absent on the CPU backend);
* GPU utilisation, power and temperature through NVML when ``nvidia-ml-py`` is installed;
* network bytes sent and received (the host's counters);
* the data wait and step time of the steps since the last sample (mean and max);
* every ``monitor.h2d_every`` steps, the time to copy ``monitor.h2d_bytes`` to the first local
  device and wait for it: it blocks on the copy, so it is sampled, never timed every step.

Each sample is a line of ``host_metrics.<i>.jsonl`` (schema in docs/monitoring.md). With
``monitor.port=N`` process ``i`` also serves them to Prometheus on ``monitor.host:N+i``, read
at scrape time from the latest sample (names end in their unit: ``_seconds``, ``_bytes``,
``_ratio``, ``_total``; labels ``run``, ``host``, ``process``).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from hypertron.config import MonitorConfig
from hypertron.errors import UserError
from hypertron.runfiles import host_metrics_path
from hypertron.tracker import Tracker


class Collector(Tracker):
    """Samples this process's host every ``cfg.interval`` seconds into ``host_metrics.<i>.jsonl``."""

    def __init__(self, run_dir: str | Path, cfg: MonitorConfig | None = None, process_index: int | None = None):
        self.run_dir, self.cfg = Path(run_dir), cfg or MonitorConfig()
        self.index = process_index  # None: jax.process_index() when the loop begins
        self.labels = {"run": self.run_dir.name, "host": socket.gethostname(), "process": ""}
        self.latest: dict[str, Any] = {}  # the last sample, what Prometheus is shown
        self.last_step: dict[str, Any] = {}
        self._steps: list[tuple[int, float | None, float | None]] = []  # (step, data_wait, step_time)
        self._steps_total = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = self._file = self._server = None
        self._h2d_at = None  # the step of the last transfer timing
        self.last_h2d: float | None = None  # its seconds
        self._nvml = None

    # --- the tracker interface -----------------------------------------------------------

    def begin(self, step: int, total: int) -> None:
        if self._thread is not None:
            return
        import jax
        import psutil

        if self.index is None:
            self.index = jax.process_index()
        self.labels["process"] = str(self.index)
        self._devices = jax.local_devices()
        self._h2d_at = step
        self._buffer = np.ones(max(1, self.cfg.h2d_bytes // 4), np.float32)
        self._proc = psutil.Process()
        psutil.cpu_percent(percpu=True)  # the first reading starts the interval
        self._nvml = _nvml_handles(len(self._devices))
        if self.cfg.port:
            self._serve()
        self._file = host_metrics_path(self.run_dir, self.index).open("a", buffering=1)
        self._thread = threading.Thread(target=self._run, name="hypertron-monitor", daemon=True)
        self._thread.start()

    def scalars(self, step: int, values: Mapping[str, Any], group: str = "train") -> None:
        if group != "train":
            return
        with self._lock:
            self._steps.append((step, values.get("data_wait"), values.get("step_time")))
            self._steps_total += 1
            self.last_step = {"step": step, "loss": values.get("loss"), "step_time": values.get("step_time"),
                              "data_wait": values.get("data_wait")}

    def finish(self, status: str) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            self._sample()  # the job's last figures
        finally:
            self._file.close()
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._server = None

    # --- sampling ------------------------------------------------------------------------

    def _run(self) -> None:
        warned = False
        while not self._stop.wait(self.cfg.interval):
            try:
                self._sample()
            except Exception as e:  # a figure that failed to read must not end the job, nor go unsaid
                if not warned:
                    print(f"monitor: a host sample failed ({type(e).__name__}: {e}); trying again "
                          f"every {self.cfg.interval:g} s", file=sys.stderr)
                    warned = True

    def _sample(self) -> dict[str, Any]:
        import psutil

        with self._lock:
            steps, self._steps = self._steps, []
            last = self.last_step.get("step")
        cores = psutil.cpu_percent(percpu=True)
        net = psutil.net_io_counters()
        row: dict[str, Any] = {
            "time": time.time(), "process": self.index, "step": last,
            "cpu_utilization_mean": float(np.mean(cores)) / 100 if cores else None,
            "cpu_utilization_max": float(np.max(cores)) / 100 if cores else None,
            "host_memory_used_bytes": psutil.virtual_memory().used,
            "rss_bytes": self._proc.memory_info().rss,
            **_device_memory(self._devices), **_gpu_figures(self._nvml),
            "network_sent_bytes": net.bytes_sent if net else None,
            "network_received_bytes": net.bytes_recv if net else None,
            "steps": len(steps),
        }
        for name, k in (("data_wait", 1), ("step_time", 2)):
            xs = [s[k] for s in steps if s[k] is not None]
            row[f"{name}_mean"] = float(np.mean(xs)) if xs else None
            row[f"{name}_max"] = float(np.max(xs)) if xs else None
        row["h2d_seconds"] = row["h2d_bytes"] = None
        if self.cfg.h2d_every and last is not None and last - self._h2d_at >= self.cfg.h2d_every:
            row["h2d_seconds"], row["h2d_bytes"] = self._time_h2d(), self._buffer.nbytes
            self._h2d_at, self.last_h2d = last, row["h2d_seconds"]
        self._file.write(json.dumps(row) + "\n")
        self.latest = row
        return row

    def _time_h2d(self) -> float:
        import jax

        t0 = time.perf_counter()
        jax.device_put(self._buffer, self._devices[0]).block_until_ready()
        return time.perf_counter() - t0

    # --- Prometheus ----------------------------------------------------------------------

    def _serve(self) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Exposition(self))
        port = self.cfg.port + self.index
        try:
            self._server, _ = start_http_server(port, addr=self.cfg.host, registry=registry)
        except OSError as e:
            raise UserError(f"monitor.port: cannot serve process {self.index}'s metrics on "
                            f"{self.cfg.host}:{port} ({e.strerror or e})") from None


# What Prometheus is shown: (name, help, kind, sample key or a function of the collector).
_EXPOSED = (
    ("hypertron_step", "the last finished step", "gauge", lambda c: c.last_step.get("step")),
    ("hypertron_steps_total", "steps finished by this process in this job", "counter", lambda c: c._steps_total),
    ("hypertron_loss", "the training loss of the last step", "gauge", lambda c: c.last_step.get("loss")),
    ("hypertron_step_time_seconds", "the last step's time", "gauge", lambda c: c.last_step.get("step_time")),
    ("hypertron_data_wait_seconds", "the last step's wait for its batch", "gauge",
     lambda c: c.last_step.get("data_wait")),
    ("hypertron_host_to_device_seconds", "the last timed host-to-device copy", "gauge", lambda c: c.last_h2d),
    ("hypertron_host_cpu_utilization_ratio", "host CPU utilisation, mean over cores", "gauge",
     "cpu_utilization_mean"),
    ("hypertron_host_cpu_max_utilization_ratio", "host CPU utilisation of the busiest core", "gauge",
     "cpu_utilization_max"),
    ("hypertron_host_memory_used_bytes", "host memory in use", "gauge", "host_memory_used_bytes"),
    ("hypertron_process_rss_bytes", "this process's resident memory", "gauge", "rss_bytes"),
    ("hypertron_device_memory_used_bytes", "accelerator memory in use (this process's devices)", "gauge",
     "device_memory_used_bytes"),
    ("hypertron_device_memory_peak_bytes", "peak accelerator memory in use", "gauge", "device_memory_peak_bytes"),
    ("hypertron_gpu_utilization_ratio", "GPU utilisation (NVML), mean over this process's GPUs", "gauge",
     "gpu_utilization"),
    ("hypertron_gpu_power_watts", "GPU power draw (NVML), summed", "gauge", "gpu_power_watts"),
    ("hypertron_gpu_temperature_celsius", "GPU temperature (NVML), the hottest", "gauge", "gpu_temperature_celsius"),
    ("hypertron_network_sent_bytes_total", "bytes the host sent", "counter", "network_sent_bytes"),
    ("hypertron_network_received_bytes_total", "bytes the host received", "counter", "network_received_bytes"),
)


class _Exposition:
    """A prometheus-client collector: the figures at scrape time, nothing kept in between."""

    def __init__(self, collector: Collector):
        self.c = collector

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names, values = list(self.c.labels), list(self.c.labels.values())
        latest = self.c.latest
        for name, doc, kind, source in _EXPOSED:
            value = source(self.c) if callable(source) else latest.get(source)
            if value is None:
                continue
            if kind == "counter":
                family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=names)
            else:
                family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, float(value))
            yield family


# --- devices ---------------------------------------------------------------------------------

def _device_memory(devices) -> dict[str, Any]:
    used = peak = limit = None
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # a backend without memory statistics
            stats = None
        if not stats:
            continue
        used = (used or 0) + stats.get("bytes_in_use", 0)
        peak = (peak or 0) + stats.get("peak_bytes_in_use", 0)
        limit = (limit or 0) + stats.get("bytes_limit", 0)
    return {"device_memory_used_bytes": used, "device_memory_peak_bytes": peak, "device_memory_limit_bytes": limit}


def _nvml_handles(count: int):
    """NVML handles of this process's GPUs (the first ``count`` visible), or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(min(count, pynvml.nvmlDeviceGetCount()))]
    except Exception:  # no nvidia-ml-py, no driver, or no GPU
        return None


def _gpu_figures(handles) -> dict[str, Any]:
    out = {"gpu_utilization": None, "gpu_power_watts": None, "gpu_temperature_celsius": None}
    if not handles:
        return out
    try:
        import pynvml

        out["gpu_utilization"] = float(np.mean([pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles])) / 100
        out["gpu_power_watts"] = sum(pynvml.nvmlDeviceGetPowerUsage(h) for h in handles) / 1000
        out["gpu_temperature_celsius"] = max(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
                                             for h in handles)
    except Exception:  # a figure this GPU does not report
        pass
    return out
