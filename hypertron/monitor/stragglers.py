"""Stragglers and outlier processes: which process holds the others back, and which stands out.

In synchronous data parallelism every process takes the same step time (they wait for each
other in the collectives), so a slow process shows in what it does alone before a step: its
wait for the next batch (``data_wait`` of its step events) and its host-to-device copies
(``h2d_seconds`` of its host samples, :mod:`hypertron.monitor.collector`). For each of those
and each process, after nvidia-resiliency-ext's straggler scores:

* **current** = the median of its last ``window`` values (default 100 steps; 5 copy timings; a
  job's first batch, which holds the input pipeline's start, is left out);
* **relative score** = the fastest process's current / its current;
* **individual score** = its best (lowest) median over earlier blocks of ``window`` values /
  its current: a process that got slower than it was;
* both medians are raised to an absolute **floor** first (10 ms of data wait, 5 ms per copy),
  so microsecond noise never flags anyone;
* a process is a **straggler** when either score is under ``threshold`` (default 0.75).

**Outliers**, as the Cloud TPU/GPU monitoring dashboards' "Outliers [MEAN]" and "[MAX]"
tiles: per metric, the top ``top`` processes by their mean and by their max over the window
(the report's ``--since``/``--window``, else the run's last job).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hypertron.monitor.goodput import Job
from hypertron.monitor.read import Columns
from hypertron.monitor.settings import DEFAULTS

# metric: (values per score window, floor in seconds)
SCORED = {"data_wait": (100, 0.010), "h2d_seconds": (5, 0.005)}
# Host-sample metrics ranked for outliers (beside data_wait, from the step events), and the
# counters turned into rates first.
OUTLIER_METRICS = ("data_wait", "h2d_seconds", "cpu_utilization_mean", "cpu_utilization_max",
                   "host_memory_used_bytes", "rss_bytes", "device_memory_used_bytes", "device_memory_peak_bytes",
                   "gpu_utilization", "gpu_power_watts", "gpu_temperature_celsius",
                   "network_sent_bytes_per_second", "network_received_bytes_per_second")
RATES = {"network_sent_bytes_per_second": "network_sent_bytes",
         "network_received_bytes_per_second": "network_received_bytes"}


@dataclass
class Score:
    process: int
    metric: str
    current: float  # median of the last window, seconds
    best: float  # lowest median of a window so far
    relative: float
    individual: float
    samples: int
    straggler: bool


@dataclass
class Analysis:
    scores: list[Score] = field(default_factory=list)
    outliers: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)

    @property
    def stragglers(self) -> list[int]:
        return sorted({s.process for s in self.scores if s.straggler})


def block_medians(values: np.ndarray, window: int) -> np.ndarray:
    """Medians of consecutive blocks of ``window`` values, the last block ending at the last value
    (an incomplete first block is dropped, unless it is the only one)."""
    n = len(values)
    if n <= window:
        return np.array([np.median(values)]) if n else np.zeros(0)
    tail = values[n % window:] if n % window else values
    return np.median(tail.reshape(-1, window), axis=1)


def score(series: dict[int, np.ndarray], metric: str, threshold: float = DEFAULTS.straggler_threshold,
          window: int | None = None, floor: float | None = None) -> list[Score]:
    """The straggler scores of every process with values of ``metric`` (its time-ordered series)."""
    w, f = SCORED[metric]
    w, f = window or w, f if floor is None else floor
    medians = {p: block_medians(v[np.isfinite(v)], w) for p, v in series.items()}
    medians = {p: m for p, m in medians.items() if len(m)}
    if not medians:
        return []
    fastest = min(max(m[-1], f) for m in medians.values())
    out = []
    for p, m in sorted(medians.items()):
        current, best = max(m[-1], f), max(m.min(), f)
        relative, individual = fastest / current, best / current
        out.append(Score(p, metric, float(m[-1]), float(m.min()), float(relative), float(individual),
                         int(np.isfinite(series[p]).sum()), bool(min(relative, individual) < threshold)))
    return out


def analyse(jobs: dict[int, list[Job]], hosts: dict[int, Columns], window: tuple[float, float] | None = None,
            threshold: float = DEFAULTS.straggler_threshold, top: int = DEFAULTS.top) -> Analysis:
    """Scores and outliers from each process's jobs (:func:`hypertron.monitor.goodput.split_jobs`:
    their step ends and data waits) and host samples (``host_metrics.<i>.jsonl`` columns)."""
    out = Analysis()
    # Per process, its steps' (ends, data waits) in time order. A job's first batch holds the input
    # pipeline's start (goodput's synchronous data loading): only the later ones are compared.
    waits = {p: (np.concatenate([j.ends[1:] for j in js]), np.concatenate([j.data_waits[1:] for j in js]))
             for p, js in jobs.items() if js}
    out.scores += score({p: v for p, (_, v) in waits.items()}, "data_wait", threshold)
    h2d = {p: h["h2d_seconds"][np.isfinite(h["h2d_seconds"])] for p, h in hosts.items()}
    out.scores += score({p: v for p, v in h2d.items() if len(v)}, "h2d_seconds", threshold)

    last_start = jobs[0][-1].start if jobs.get(0) else -np.inf  # process 0's last job
    lo, hi = window if window is not None else (last_start, np.inf)
    series: dict[str, dict[int, np.ndarray]] = {m: {} for m in OUTLIER_METRICS}
    for p, (t, v) in waits.items():
        series["data_wait"][p] = v[(t >= lo) & (t <= hi)]
    for p, h in hosts.items():
        t = h["time"]
        keep = (t >= lo) & (t <= hi)
        for m in OUTLIER_METRICS:
            if m in RATES:
                c = h[RATES[m]]
                rate = np.full(len(t), np.nan)
                rate[1:] = np.diff(c) / np.maximum(np.diff(t), 1e-9)
                rate[1:][np.diff(c) < 0] = np.nan  # a counter reset (a reboot)
                series[m][p] = rate[keep]
            elif m in h.data:
                series[m][p] = h[m][keep]
    for m, per in series.items():
        stats = {p: v[np.isfinite(v)] for p, v in per.items()}
        stats = {p: v for p, v in stats.items() if len(v)}
        if stats:
            by = lambda f: sorted(((p, float(f(v))) for p, v in stats.items()), key=lambda x: (-x[1], x[0]))[:top]
            out.outliers[m] = {"mean": by(np.mean), "max": by(np.max)}
    return out


def to_json(a: Analysis) -> dict[str, Any]:
    return {"stragglers": a.stragglers, "scores": [vars(s) for s in a.scores],
            "outliers": {m: {k: [{"process": p, "value": v} for p, v in rows] for k, rows in d.items()}
                         for m, d in a.outliers.items()}}
