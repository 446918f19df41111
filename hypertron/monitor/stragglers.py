"""Stragglers and outlier processes: which process holds the others back, and which stands out.

In synchronous data parallelism every process takes the same step time (they wait for each
other in the collectives), so a slow process shows in what it does alone before a step: its
wait for the next batch (``data_wait`` of its step events) and its host-to-device copies
(the copy times of its host samples, :mod:`hypertron.monitor.collector`). For each of those
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

Which metrics are scored and ranked, their windows and floors, is said by their records:
:data:`DATA_WAIT` and :data:`hypertron.runfiles.HOST_METRICS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hypertron import runfiles
from hypertron.monitor.goodput import Job
from hypertron.monitor.read import Columns
from hypertron.monitor.settings import DEFAULTS
from hypertron.runfiles import Metric

# The step events' data wait, ranked and scored beside the host metrics (runfiles.HOST_METRICS).
DATA_WAIT = Metric(key="data_wait", unit="seconds", help="a step's wait for its batch (its step event)",
                   label="data wait", outlier=True, straggler=(100, 0.010))


def metrics() -> dict[str, Metric]:
    """Every metric the analysis knows, by key: the data wait, then the host metrics."""
    return {m.key: m for m in (DATA_WAIT, *runfiles.HOST_METRICS)}


def scored() -> dict[str, tuple[int, float]]:
    """The metrics scored for stragglers: (values per score window, floor in seconds)."""
    return {k: m.straggler for k, m in metrics().items() if m.straggler}


def ranked() -> list[Metric]:
    """The metrics ranked for outliers, those scored for stragglers first; the host counters are
    ranked by their rates (a metric with ``rate_of``)."""
    return sorted((m for m in metrics().values() if m.outlier), key=lambda m: m.straggler is None)


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
    w, f = scored()[metric]
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
    out.scores += score({p: v for p, (_, v) in waits.items()}, DATA_WAIT.key, threshold)
    for m in runfiles.HOST_METRICS:
        if m.straggler:
            values = {p: h[m.key][np.isfinite(h[m.key])] for p, h in hosts.items()}
            out.scores += score({p: v for p, v in values.items() if len(v)}, m.key, threshold)

    last_start = jobs[0][-1].start if jobs.get(0) else -np.inf  # process 0's last job
    lo, hi = window if window is not None else (last_start, np.inf)
    outliers = ranked()
    series: dict[str, dict[int, np.ndarray]] = {m.key: {} for m in outliers}
    for p, (t, v) in waits.items():
        series[DATA_WAIT.key][p] = v[(t >= lo) & (t <= hi)]
    for p, h in hosts.items():
        t = h["time"]
        keep = (t >= lo) & (t <= hi)
        for m in outliers:
            if m is not DATA_WAIT:
                series[m.key][p] = (_rate(h[m.rate_of], t) if m.rate_of else h[m.key])[keep]
    for m, per in series.items():
        stats = {p: v[np.isfinite(v)] for p, v in per.items()}
        stats = {p: v for p, v in stats.items() if len(v)}
        if stats:
            by = lambda f: sorted(((p, float(f(v))) for p, v in stats.items()), key=lambda x: (-x[1], x[0]))[:top]
            out.outliers[m] = {"mean": by(np.mean), "max": by(np.max)}
    return out


def _rate(counter: np.ndarray, t: np.ndarray) -> np.ndarray:
    """A counter's rate per second between consecutive samples (NaN at the first and at a reset)."""
    rate = np.full(len(t), np.nan)
    rate[1:] = np.diff(counter) / np.maximum(np.diff(t), 1e-9)
    rate[1:][np.diff(counter) < 0] = np.nan  # a counter reset (a reboot)
    return rate


def to_json(a: Analysis) -> dict[str, Any]:
    return {"stragglers": a.stragglers, "scores": [vars(s) for s in a.scores],
            "outliers": {m: {k: [{"process": p, "value": v} for p, v in rows] for k, rows in d.items()}
                         for m, d in a.outliers.items()}}
