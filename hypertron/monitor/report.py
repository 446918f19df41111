"""``hypertron monitor RUN_DIR``: where a run's time went, whether it is healthy, as a table or JSON.

Reads only the run directory (events of every process, ``metrics.jsonl``), never the training
code: a finished, running, multi-job or multi-process run is reported the same way, locally, in
about a second per million steps. Goodput is :mod:`hypertron.monitor.goodput`'s; the health checks:

* **hung**: a running job (its process alive, or, seen from another host, an event in the last
  minute) whose last step ended more than ``hang_factor`` x the ideal step time ago, and at least
  ``hang_min`` seconds; checked for every process;
* **loss**: a step whose loss is NaN or infinite, and loss spikes: a loss more than 6 MADs and
  5% above the median of the previous block of 100 steps.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hypertron.config.numbers import check_number
from hypertron.errors import UserError
from hypertron.units import describe_bytes, describe_duration, describe_seconds
from hypertron.monitor.goodput import BADPUT, KILLED, PRODUCTIVE, RUNNING, Goodput, Job, compute, classify, split_jobs
from hypertron.monitor import stragglers
from hypertron.monitor.settings import DEFAULTS
from hypertron.monitor.read import (EVENT_COLUMNS, JOB_START, METRICS_COLUMNS, PROGRESS_COLUMNS, Columns,
                                    host_columns, read_jsonl)
from hypertron.runfiles import METRICS_FILE, TIME_RANGE, event_files, host_metrics_files

SPIKE_MADS, SPIKE_BLOCK = 6.0, 100


class MonitorError(UserError):
    """A run directory that cannot be reported on; one line."""


class UnreadableFile(MonitorError):
    """A run file none of whose lines could be read (binary, garbage, every line out of range):
    ``hypertron monitor`` says so in one line and exits 1, as for an alarm."""


@dataclass
class Process:
    index: int
    jobs: int
    last_step: int | None
    last_step_end: float | None
    status: str | None
    median_step_time: float | None
    hung: bool = False


@dataclass
class Report:
    run_dir: Path
    now: float
    goodput: Goodput | None
    processes: list[Process]
    alarms: list[str] = field(default_factory=list)
    bad_lines: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    window: dict[str, Any] | None = None
    analysis: stragglers.Analysis | None = None
    jobs: dict[int, list[Job]] = field(default_factory=dict)  # every process's jobs (process 0's classified)
    metrics: Columns | None = None  # metrics.jsonl's METRICS_COLUMNS


def pid_alive(pid: int | None, host: str | None, started: float) -> bool | None:
    """Whether the job's process still runs: None when it ran on another host (cannot tell)."""
    if pid is None or host != socket.gethostname():
        return None
    import psutil

    try:
        proc = psutil.Process(pid)
        # A pid reused by a later process is not the job's.
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= started + 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def build(run_dir: str | Path, now: float | None = None, hang_factor: float = DEFAULTS.hang_factor,
          hang_min: float = DEFAULTS.hang_min, window: tuple[float, float] | None = None,
          straggler_threshold: float = DEFAULTS.straggler_threshold, top: int = DEFAULTS.top) -> Report:
    """The report of ``run_dir`` at ``now`` (default: the present)."""
    run_dir = Path(run_dir)
    now = time.time() if now is None else now
    if not run_dir.exists():
        raise MonitorError(f"{run_dir} does not exist")
    if not run_dir.is_dir():
        raise MonitorError(f"{run_dir} is not a directory")
    files = event_files(run_dir)
    if 0 not in files:
        what = "holds no events.jsonl" + (f" (but events of processes {sorted(files)})" if files else "")
        raise MonitorError(f"{run_dir} {what}: not a hypertron training run, or it has not started yet")
    report = Report(run_dir, now, None, [])
    ev = read_jsonl(files[0], EVENT_COLUMNS)
    _count_bad(report, files[0], ev)
    jobs, orphans = split_jobs(ev)
    if orphans:
        report.notes.append(f"{orphans} events before the first job_start were ignored")
    if not jobs:
        report.notes.append("no job has started yet" if not ev.rows else "no job_start event: nothing to report")
        return report
    classify(jobs, pid_alive(jobs[-1].pid, jobs[-1].host, jobs[-1].start), now)
    report.goodput = compute(jobs, now)
    if window is not None:
        report.window = report.goodput.window(*window)
    ideal = report.goodput.steps.ideal
    report.processes.append(_process(0, jobs, ideal, now, hang_factor, hang_min))
    per_process = report.jobs = {0: jobs}
    for index, path in files.items():
        if index == 0:
            continue
        cols = read_jsonl(path, PROGRESS_COLUMNS, pick=JOB_START)
        _count_bad(report, path, cols)
        pjobs, _ = split_jobs(cols)
        per_process[index] = pjobs
        if pjobs:
            classify(pjobs, pid_alive(pjobs[-1].pid, pjobs[-1].host, pjobs[-1].start), now)
            report.processes.append(_process(index, pjobs, ideal, now, hang_factor, hang_min))
    for p in report.processes:
        if p.hung:
            report.alarms.append(
                f"hung: process {p.index} is alive but has not finished a step for "
                f"{describe_duration(now - (p.last_step_end or now))} (last step {p.last_step}; "
                f"ideal step time {describe_seconds(ideal)})")
    _loss_alarms(report, run_dir / METRICS_FILE)
    hosts = {}
    for index, path in host_metrics_files(run_dir).items():
        hosts[index] = read_jsonl(path, host_columns())
        _count_bad(report, path, hosts[index])
    report.analysis = stragglers.analyse(per_process, hosts, window, straggler_threshold, top)
    for s in report.analysis.scores:
        if s.straggler:
            report.alarms.append(
                f"straggler: process {s.process}'s {s.metric} is {describe_seconds(s.current)} (median of its last "
                f"{min(s.samples, stragglers.scored()[s.metric][0])}); relative score {s.relative:.2f}, "
                f"individual {s.individual:.2f} (under {straggler_threshold:g})")
    return report


def _count_bad(report: Report, path: Path, cols: Columns) -> None:
    """Count ``path``'s skipped lines in the report; :class:`UnreadableFile` when no line was read."""
    if cols.unreadable:
        n = cols.bad_lines
        raise UnreadableFile(f"{path}: no line could be read ({n} line{'s' * (n != 1)} skipped: not JSON objects "
                             "holding a run's fields)")
    if cols.bad_lines:
        report.bad_lines[path.name] = cols.bad_lines


def _process(index: int, jobs: list[Job], ideal: float | None, now: float, factor: float, floor: float) -> Process:
    last = jobs[-1]
    with_steps = [j for j in jobs if len(j.steps)]
    times = np.concatenate([j.step_times[1:] for j in with_steps]) if with_steps else np.zeros(0)
    p = Process(index=index, jobs=len(jobs), last_step=int(with_steps[-1].steps[-1]) if with_steps else None,
                last_step_end=float(last.ends[-1]) if len(last.steps) else None, status=last.status,
                median_step_time=float(np.median(times)) if len(times) else None)
    if last.status == RUNNING and p.last_step_end is not None and ideal is not None:
        p.hung = now - p.last_step_end > max(factor * ideal, floor)
    return p


def _loss_alarms(report: Report, path: Path) -> None:
    if not path.is_file():
        return
    m = report.metrics = read_jsonl(path, METRICS_COLUMNS)
    _count_bad(report, path, m)
    # Step rows carry a loss (NaN when it diverged); eval rows carry eval_loss instead.
    rows = np.flatnonzero((m["step"] >= 0) & np.isnan(m["eval_loss"]))
    loss, steps = m["loss"][rows], m["step"][rows]
    bad = ~np.isfinite(loss)
    if bad.any():
        report.alarms.append(f"loss is not finite at {int(bad.sum())} steps (first: step {int(steps[bad][0])})")
    spikes = loss_spikes(loss)
    if len(spikes):
        report.alarms.append(f"loss spikes at {len(spikes)} steps (first: step {int(steps[spikes[0]])}, "
                             f"loss {loss[spikes[0]]:.4g})")


def loss_spikes(loss: np.ndarray) -> np.ndarray:
    """Indices of losses more than SPIKE_MADS MADs and 5% above the median of the previous block."""
    finite = np.where(np.isfinite(loss), loss, np.nan)
    n = len(finite) // SPIKE_BLOCK
    if n < 1:
        return np.zeros(0, np.int64)
    blocks = finite[: n * SPIKE_BLOCK].reshape(n, SPIKE_BLOCK)
    med = np.nanmedian(blocks, axis=1)
    mad = np.nanmedian(np.abs(blocks - med[:, None]), axis=1)
    # Step i is judged against the last full block that ends before it.
    idx = np.arange(SPIKE_BLOCK, len(finite))
    b = idx // SPIKE_BLOCK - 1
    b = np.minimum(b, n - 1)
    limit = med[b] + np.maximum(SPIKE_MADS * mad[b], 0.05 * np.abs(med[b]))
    return idx[finite[idx] > limit]


# --- output -------------------------------------------------------------------------------

def to_json(report: Report) -> dict[str, Any]:
    g = report.goodput
    out: dict[str, Any] = {"run_dir": str(report.run_dir), "time": report.now, "notes": report.notes,
                           "alarms": report.alarms, "bad_lines": report.bad_lines}
    if g is None:
        return out
    out.update({
        "goodput_percent": g.goodput, "total_seconds": g.total, "start": g.start, "end": g.end,
        "productive_seconds": g.seconds[PRODUCTIVE],
        "badput_seconds": g.badput(),
        "badput_percent": {k: 100 * v / g.total if g.total else None for k, v in g.badput().items()},
        "data_loading_async_seconds": g.data_loading_async,
        "disruptions": [vars(d) for d in g.disruptions],
        "max_productive_step": g.max_productive_step, "last_step": g.last_step,
        "jobs": [{"index": j.index, "start": j.start, "end": j.end, "status": j.status, "pid": j.pid,
                  "host": j.host, "steps": len(j.steps), "first_step": int(j.steps[0]) if len(j.steps) else None,
                  "last_step": int(j.steps[-1]) if len(j.steps) else None, "program_startup": s}
                 for j, s in zip(g.jobs, g.startup)],
        "step_time": {"ideal": g.steps.ideal, "deviation": g.steps.deviation,
                      "deviation_interval": g.steps.deviation_interval, "steps": len(g.steps.times),
                      "anomalous_steps": g.steps.anomalous, "anomalous_extra_seconds": g.steps.anomalous_extra},
        "processes": [vars(p) for p in report.processes],
    })
    if report.window is not None:
        out["window"] = report.window
    if report.analysis is not None:
        out.update(stragglers.to_json(report.analysis))
    return out


_TITLES = {
    "backend_init": "backend init", "training_prep": "training preparation",
    "program_startup": "program startup (compile)", "data_loading_sync": "data loading (first batch)",
    "checkpoint_save": "checkpoint save (blocking)", "checkpoint_restore": "checkpoint restore",
    "evaluation": "evaluation", "wasted_progress": "wasted progress (redone steps)",
    "infrastructure_recovery": "infrastructure recovery", "other": "other",
}


def render(report: Report):
    """The report as rich renderables."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    g = report.goodput
    head = Text(f"{report.run_dir}", style="bold")
    if g is None:
        parts.append(head)
        parts += _bad_lines(report)
        parts += [Text(n) for n in report.notes]
        return Group(*parts)
    status = g.jobs[-1].status
    head.append(f"  ·  {len(g.jobs)} job{'s' * (len(g.jobs) != 1)}  ·  step {g.last_step}  ·  {status}",
                style="" if status != KILLED else "yellow")
    parts.append(head)
    parts.append(Text(f"goodput {g.goodput:.2f}%  (productive {describe_duration(g.seconds[PRODUCTIVE])} of "
                      f"{describe_duration(g.total)})", style="bold green" if g.goodput >= 90 else "bold yellow"))
    table = Table(title="badput by cause", title_justify="left", show_edge=False)
    table.add_column("cause")
    table.add_column("seconds", justify="right")
    table.add_column("% of total", justify="right")
    for key in BADPUT:
        v = g.seconds[key]
        table.add_row(_TITLES[key], f"{v:.3f}", f"{100 * v / g.total:.2f}" if g.total else "-")
    table.add_row("data loading (later batches, overlapped; not badput)", f"{g.data_loading_async:.3f}", "",
                  style="dim")
    parts.append(table)
    if report.window is not None:
        w = report.window
        text = f"window {_clock(w['start'])} .. {_clock(w['end'])}: "
        if w["total"] > 0:
            parts.append(Text(text + f"goodput {w['goodput']:.2f}% of the {describe_duration(w['total'])} the run "
                              f"spent in it (productive {describe_duration(w['seconds'][PRODUCTIVE])})"))
        else:
            parts.append(Text(text + "the run did not run then", style="yellow"))
    jobs = Table(title="jobs", title_justify="left", show_edge=False)
    for col in ("job", "started", "ran", "steps", "status", "startup"):
        jobs.add_column(col, justify="right" if col in ("ran", "startup") else "left")
    for j, s in zip(g.jobs, g.startup):
        end = j.end if j.end is not None else (report.now if j.status == RUNNING else j.last_event)
        steps = f"{int(j.steps[0])}-{int(j.steps[-1])}" if len(j.steps) else "none"
        jobs.add_row(str(j.index), _clock(j.start), describe_duration(end - j.start), steps, j.status or "",
                     describe_duration(s))
    parts.append(jobs)
    if g.disruptions:
        dis = Table(title=f"disruptions ({len(g.disruptions)})", title_justify="left", show_edge=False)
        for col in ("job", "ended", "last step", "resumed at", "redone", "wasted", "recovery"):
            dis.add_column(col)
        for d in g.disruptions:
            dis.add_row(str(d.job), d.status, str(d.last_step), str(d.resumed_at), str(d.redone_steps),
                        describe_duration(d.wasted), describe_duration(d.recovery))
        parts.append(dis)
    s = g.steps
    if s.ideal is not None:
        parts.append(Text(f"step time: ideal {describe_seconds(s.ideal)}, deviation {describe_seconds(s.deviation)} "
                          f"over {len(s.times)} steps; {s.anomalous} anomalous "
                          f"(+{describe_duration(s.anomalous_extra)})"))
    if len(report.processes) > 1:
        procs = Table(title="processes", title_justify="left", show_edge=False)
        for col in ("process", "jobs", "last step", "since last step", "median step", "status"):
            procs.add_column(col)
        for p in report.processes:
            since = describe_duration(report.now - p.last_step_end) if p.last_step_end else "-"
            procs.add_row(str(p.index), str(p.jobs), str(p.last_step), since, describe_seconds(p.median_step_time),
                          ("hung" if p.hung else p.status or ""), style="red" if p.hung else "")
        parts.append(procs)
    if report.analysis is not None:
        parts += _render_analysis(report.analysis)
    for alarm in report.alarms:
        parts.append(Text("alarm: " + alarm, style="bold red"))
    parts += _bad_lines(report)
    for note in report.notes:
        parts.append(Text(note, style="dim"))
    return Group(*parts)


def _render_analysis(a: stragglers.Analysis) -> list[Any]:
    from rich.table import Table

    parts: list[Any] = []
    names = metric_names()
    if len({s.process for s in a.scores}) > 1:
        t = Table(title="straggler scores (1 = the fastest / its own best; under the threshold: straggler)",
                  title_justify="left", show_edge=False)
        for col in ("process", "metric", "median now", "best", "relative", "own", ""):
            t.add_column(col, justify="right" if col not in ("metric", "") else "left")
        for s in a.scores:
            t.add_row(str(s.process), names.get(s.metric, s.metric), describe_seconds(s.current),
                      describe_seconds(s.best), f"{s.relative:.2f}", f"{s.individual:.2f}",
                      "straggler" if s.straggler else "", style="red" if s.straggler else "")
        parts.append(t)
    if a.outliers and len({p for d in a.outliers.values() for p, _ in d["mean"]}) > 1:
        t = Table(title="outliers: top processes by window mean | by window max", title_justify="left",
                  show_edge=False)
        t.add_column("metric")
        t.add_column("by mean")
        t.add_column("by max")
        for m, d in a.outliers.items():
            fmt = lambda rows: ", ".join(f"{p}: {describe_metric(m, v)}" for p, v in rows)
            t.add_row(names.get(m, m), fmt(d["mean"]), fmt(d["max"]))
        parts.append(t)
    return parts


def _bad_lines(report: Report) -> list[Any]:
    from rich.text import Text

    return [Text(f"{name}: {n} unreadable line{'s' * (n != 1)} skipped", style="yellow")
            for name, n in report.bad_lines.items()]


def metric_names() -> dict[str, str]:
    """What the report and the dashboard call each metric (:func:`stragglers.metrics`), by key."""
    return {k: m.label or k for k, m in stragglers.metrics().items()}


def describe_metric(metric: str, v: float) -> str:
    """A value of ``metric`` for people, by its unit: ``1.5 GiB``, ``12.5 ms``, ``87%``, ``312``."""
    known = stragglers.metrics().get(metric)
    unit = known.unit if known else None
    if unit in ("bytes", "bytes/s"):
        return describe_bytes(v, per_second=unit == "bytes/s")
    if unit == "seconds":
        return describe_seconds(v)
    if unit == "ratio":
        return f"{100 * v:.0f}%"
    return f"{v:.3g}"


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


# --- time arguments ---------------------------------------------------------------------------

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str, what: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d`` as seconds (positive)."""
    t = text.strip().lower()
    number, unit = (t[:-1], _UNITS[t[-1]]) if t and t[-1] in _UNITS else (t, 1.0)
    value, reason = check_number(number, float)
    if value is None and reason.startswith("expected"):
        raise MonitorError(f"{what}={text!r}: not a duration (use 90s, 30m, 2h or 1d)")
    if value is None or not 0 < value * unit <= TIME_RANGE[1]:
        raise MonitorError(f"{what}={text!r}: must be a positive duration, at most {TIME_RANGE[1]:.0f}s")
    return value * unit


def parse_time(text: str, now: float) -> float:
    """``--since``: a Unix time, an ISO date-time (local time unless it names its zone), or a
    duration before now (``2h``)."""
    from datetime import datetime

    t = text.strip()
    value, reason = check_number(t, float, low=TIME_RANGE[0], high=TIME_RANGE[1])
    if value is not None:
        return value
    if not reason.startswith("expected"):
        raise MonitorError(f"--since={text!r}: {reason} (a Unix time is in {TIME_RANGE[0]:.0f}..{TIME_RANGE[1]:.0f})")
    try:
        return datetime.fromisoformat(t).timestamp()
    except (ValueError, OverflowError, OSError):
        pass
    try:
        return now - parse_duration(t, "--since")
    except MonitorError:
        raise MonitorError(f"--since={text!r}: not a time (use an ISO date-time, a Unix time, or a "
                           "duration before now such as 2h)") from None


def window_of(since: str | None, window: str | None, now: float) -> tuple[float, float] | None:
    """[since, since + window], [since, now], or the last ``window`` seconds."""
    if since is None and window is None:
        return None
    length = parse_duration(window, "--window") if window is not None else None
    if since is None:
        return (now - length, now)
    lo = parse_time(since, now)
    return (lo, lo + length if length is not None else now)
