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

Each sample is a line of ``host_metrics.<i>.jsonl``: the fields of
:data:`hypertron.runfiles.HOST_METRICS` (docs/monitoring.md), null where not measured. With
``monitor.port=N`` process ``i`` also serves them to Prometheus on ``monitor.host:N+i``, read
at scrape time from each figure's last measured value, under the table's names (ending in their
unit: ``_seconds``, ``_bytes``, ``_ratio``, ``_total``; labels ``run``, ``host``, ``process``).
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
from hypertron import runfiles
from hypertron.runfiles import Metric, host_metrics_path
from hypertron.tracker import Tracker


class Collector(Tracker):
    """Samples this process's host every ``cfg.interval`` seconds into ``host_metrics.<i>.jsonl``."""

    def __init__(self, run_dir: str | Path, cfg: MonitorConfig | None = None, process_index: int | None = None):
        self.run_dir, self.cfg = Path(run_dir), cfg or MonitorConfig()
        self.index = process_index  # None: jax.process_index() when the loop begins
        self.labels = {"run": self.run_dir.name, "host": socket.gethostname(), "process": ""}
        self.known: dict[str, Any] = {}  # each figure's last measured value, what Prometheus is shown
        self.last_step: dict[str, Any] = {}
        self._steps: list[tuple[int, float | None, float | None]] = []  # (step, data_wait, step_time)
        self._steps_total = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = self._file = self._server = None
        self._h2d_at = None  # the step of the last transfer timing
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
        """One line of host_metrics.<i>.jsonl: ``runfiles.HOST_METRICS``'s fields, null where not measured."""
        with self._lock:
            steps, self._steps = self._steps, []
            last = self.last_step.get("step")
        figures = {**self._host_figures(), **_device_memory(self._devices), **_gpu_figures(self._nvml),
                   **_step_figures(steps), **self._h2d_figures(last)}
        metrics = runfiles.sampled_metrics()
        figures.update({m.key: m.sample() for m in metrics if m.sample is not None})
        row = {"time": time.time(), "process": self.index, "step": last, **{m.key: figures.get(m.key) for m in metrics}}
        self._file.write(json.dumps(row) + "\n")
        # A figure measured now and then (a copy's time) is shown as of the last time it was.
        self.known = {**self.known, **{k: v for k, v in row.items() if v is not None}}
        return row

    def _host_figures(self) -> dict[str, Any]:
        import psutil

        cores = psutil.cpu_percent(percpu=True)
        net = psutil.net_io_counters()
        return {"cpu_utilization_mean": float(np.mean(cores)) / 100 if cores else None,
                "cpu_utilization_max": float(np.max(cores)) / 100 if cores else None,
                "host_memory_used_bytes": psutil.virtual_memory().used, "rss_bytes": self._proc.memory_info().rss,
                "network_sent_bytes": net.bytes_sent if net else None,
                "network_received_bytes": net.bytes_recv if net else None}

    def _h2d_figures(self, last: int | None) -> dict[str, Any]:
        """Every ``h2d_every`` steps, the time to copy the buffer to the first device and its bytes."""
        if not (self.cfg.h2d_every and last is not None and last - self._h2d_at >= self.cfg.h2d_every):
            return {}
        self._h2d_at = last
        return {"h2d_seconds": self._time_h2d(), "h2d_bytes": self._buffer.nbytes}

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


# What Prometheus is shown of the last step, from the loop (the host's figures are HOST_METRICS').
_LAST_STEP = (
    Metric(key="step", unit="count", help="the last finished step", prometheus="hypertron_step"),
    Metric(key="steps_total", unit="count", help="steps finished by this process in this job",
           prometheus="hypertron_steps_total", kind="counter"),
    Metric(key="loss", unit="number", help="the training loss of the last step", prometheus="hypertron_loss"),
    Metric(key="step_time", unit="seconds", help="the last step's time", prometheus="hypertron_step_time_seconds"),
    Metric(key="data_wait", unit="seconds", help="the last step's wait for its batch",
           prometheus="hypertron_data_wait_seconds"),
)


class _Exposition:
    """A prometheus-client collector: the figures at scrape time, nothing kept in between."""

    def __init__(self, collector: Collector):
        self.c = collector

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names, values = list(self.c.labels), list(self.c.labels.values())
        figures = {**self.c.known, **self.c.last_step, "steps_total": self.c._steps_total}
        for m in (*_LAST_STEP, *runfiles.HOST_METRICS):
            value = figures.get(m.key)
            if m.prometheus is None or value is None:
                continue
            if m.kind == "counter":
                family = CounterMetricFamily(m.prometheus.removesuffix("_total"), m.help, labels=names)
            else:
                family = GaugeMetricFamily(m.prometheus, m.help, labels=names)
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


def _step_figures(steps: list[tuple[int, float | None, float | None]]) -> dict[str, Any]:
    """How many steps finished since the last sample, and their data waits' and step times' mean and max."""
    out: dict[str, Any] = {"steps": len(steps)}
    for name, k in (("data_wait", 1), ("step_time", 2)):
        xs = [s[k] for s in steps if s[k] is not None]
        out[f"{name}_mean"] = float(np.mean(xs)) if xs else None
        out[f"{name}_max"] = float(np.max(xs)) if xs else None
    return out
