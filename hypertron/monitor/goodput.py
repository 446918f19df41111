"""Goodput and badput of a training run, from its job events, by ml-goodput-measurement's definitions.

The definitions are those of ml-goodput-measurement v0.2.x (``goodput.py``), computed locally from
``events.jsonl`` (process 0) over every job of the run; ``docs/monitoring.md`` states each one and
works them on an example. In short:

* Each job's steps are placed on a timeline of **step starts**. A ``step`` event is written when the
  step's results reach the host, with ``step_time`` (the time since the previous step's end, or since
  the loop began); so the step began at ``time - step_time``. A job's first step begins once its
  first batch has arrived (``+ data_wait``): that wait is the synchronous data loading.
* A **step's time** is the start of the next step minus its own start (consecutive steps only), so
  it holds the evaluation and the blocking part of a save that follow it, as in the reference.
  The step after a job's last one "starts" at the job's ``job_end``, or, for a job that was killed
  or is still running, when its last step ended (the loop had already dispatched the next one).
* A **disruption** is a job whose successor records one of its steps again (it resumed from an
  earlier checkpoint), or a job that did not end normally (killed, preempted, failed). The step
  times of the redone steps are **wasted progress**; the time from the disrupted job's last step
  start (as above) to the next job's start is **infrastructure recovery**.
* Per job, **program startup** = max(0, first step time - mean of its other counted step times).
* Each second of the run gets one cause: productive step time, or backend init (``job_start`` to
  ``backend_ready``), training preparation (from there to the loop's start, less the restore),
  checkpoint restore, synchronous data loading, program startup, evaluation and blocking checkpoint
  saves (inside the step times that hold them), wasted progress, infrastructure recovery, or other.
  Goodput = 100 x productive / total, total = the run's end (the last job's ``job_end``, the last
  event of a killed one, or now while one runs) - the first job's start, gaps between jobs included.

The reference is followed to the number (``tests/test_monitor.py`` checks it against the reference
itself); where it counts one second under two causes or follows its own log's order, this module
gives each second one cause instead, and says so in ``docs/monitoring.md``.

The whole run becomes a tiling of the timeline by labelled spans (phases of a job, step times,
gaps between jobs) with labelled inner spans (evaluations, blocking saves, program startup), so a
window (``--since``/``--window``) is the same arithmetic, clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hypertron.monitor.read import Columns

PRODUCTIVE = "productive"
# Badput causes, in the reference's order (ml-goodput-measurement's BadputType in brackets).
BADPUT = (
    "backend_init",             # TPU_INITIALIZATION
    "training_prep",            # TRAINING_PREP
    "program_startup",          # PROGRAM_STARTUP
    "data_loading_sync",        # DATA_LOADING_SYNC
    "checkpoint_save",          # UNPRODUCTIVE_CHECKPOINT_SAVE_TIME
    "checkpoint_restore",       # UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME
    "evaluation",               # CUSTOM_BADPUT_EVENTS["EVAL"]
    "wasted_progress",          # WASTED_PROGRESS_FROM_DISRUPTION
    "infrastructure_recovery",  # INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION
    "other",                    # OTHER
)
LABELS = (PRODUCTIVE, *BADPUT)
_LABEL = {name: i for i, name in enumerate(LABELS)}
# Job statuses beyond job_end's own (completed, preempted, interrupted, failed).
KILLED, RUNNING = "killed", "running"
_NORMAL_END = ("completed", "interrupted")


@dataclass
class Job:
    """One ``hypertron train`` invocation of a run, from process 0's events."""

    index: int
    start: float
    pid: int | None = None
    host: str | None = None
    backend_ready: float | None = None
    restores: list[tuple[float, float]] = field(default_factory=list)     # (start, end)
    evals: list[tuple[float, float]] = field(default_factory=list)        # (start, end)
    saves: list[tuple[float, float, int]] = field(default_factory=list)   # (start, blocking end, step)
    steps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ends: np.ndarray = field(default_factory=lambda: np.zeros(0))
    step_times: np.ndarray = field(default_factory=lambda: np.zeros(0))
    data_waits: np.ndarray = field(default_factory=lambda: np.zeros(0))
    end: float | None = None        # job_end's time
    status: str | None = None       # job_end's status; KILLED or RUNNING once classified
    last_event: float = 0.0

    @property
    def starts(self) -> np.ndarray:
        """When each step began: its end less its step time; the first after its first batch."""
        starts = self.ends - self.step_times
        if len(starts):
            starts[0] += _finite(self.data_waits[0])
        return starts

    @property
    def loop_start(self) -> float | None:
        return float(self.ends[0] - self.step_times[0]) if len(self.steps) else None

    @property
    def close(self) -> float:
        """Where the step after the job's last one begins: job_end, else its last step's end."""
        if self.end is not None:
            return self.end
        return float(self.ends[-1]) if len(self.steps) else self.last_event


def _finite(x: float) -> float:
    return 0.0 if not math.isfinite(x) else float(x)


def split_jobs(ev: Columns) -> tuple[list[Job], int]:
    """Process 0's events cut into jobs at each ``job_start``; events before the first are counted
    and dropped (a file that does not begin with one was damaged). Without pid and host columns,
    they come from the job_start lines ``ev.picked``."""
    names, times = ev["event"], ev["time"]
    ok = np.isfinite(times)
    starts = np.flatnonzero((names == "job_start") & ok)
    orphans = int(starts[0]) if len(starts) else int(ev.rows)
    jobs = []
    bounds = list(starts) + [ev.rows]
    for j in range(len(starts)):
        lo, hi = int(bounds[j]), int(bounds[j + 1])
        sl = slice(lo, hi)
        n, t, steps = names[sl], times[sl], ev["step"][sl]
        job = Job(index=j, start=float(t[0]), last_event=float(np.nanmax(t)))
        if "pid" in ev.data:
            pid, job.host = ev["pid"][lo], ev["host"][lo]
        elif j < len(ev.picked):
            pid, job.host = ev.picked[j].get("pid"), ev.picked[j].get("host")
        else:
            pid = None
        job.pid = int(pid) if isinstance(pid, (int, np.integer)) and pid >= 0 else None
        is_step = (n == "step") & np.isfinite(t) & np.isfinite(ev["step_time"][sl])
        job.steps = steps[is_step]
        job.ends = t[is_step]
        job.step_times = ev["step_time"][sl][is_step]
        job.data_waits = np.nan_to_num(ev["data_wait"][sl][is_step]) if "data_wait" in ev.data \
            else np.zeros(len(job.steps))
        if "seconds" not in ev.data:  # a progress read: steps, and how the job ended
            ended = np.flatnonzero(n == "job_end")
            if len(ended) and "status" in ev.data:
                job.end, job.status = float(t[ended[-1]]), ev["status"][lo + ended[-1]]
            jobs.append(job)
            continue
        seconds, blocking = ev["seconds"][sl], ev["blocking_seconds"][sl]
        for i in np.flatnonzero(~is_step & (n != "job_start")):
            name, when, secs = n[i], float(t[i]), _finite(seconds[i])
            if name == "backend_ready" and job.backend_ready is None:
                job.backend_ready = when
            elif name == "restore_end":
                job.restores.append((when - secs, when))
            elif name == "eval":
                job.evals.append((when - secs, when))
            elif name == "checkpoint_save_end":
                job.saves.append((when - secs, when - secs + _finite(blocking[i]), int(steps[i])))
            elif name == "job_end":
                job.end, job.status = when, ev["status"][lo + i]
        jobs.append(job)
    return jobs, orphans


def classify(jobs: list[Job], alive: bool | None, now: float) -> None:
    """Give every job without a ``job_end`` its status: the last one is RUNNING if its process is
    alive (``alive`` None: unknown, then it runs if its last event is under a minute old), every
    other one was KILLED."""
    for job in jobs:
        if job.end is None:
            job.status = KILLED
    if jobs and jobs[-1].end is None:
        last = jobs[-1]
        running = alive if alive is not None else now - last.last_event < 60.0
        last.status = RUNNING if running else KILLED


@dataclass
class Disruption:
    job: int                 # the disrupted job
    status: str              # how it ended
    last_step: int | None    # its last step (None: it had none)
    resumed_at: int | None   # the first step of the next job with steps (None: none yet)
    redone_steps: int
    wasted: float
    recovery: float


@dataclass
class Timeline:
    """The run as labelled spans: ``bounds`` tile [run start, run end]; span k = [bounds[k],
    bounds[k+1]] has label ``labels[k]``; each inner span (start, end, label) lies inside the base
    span ``inner_in`` and takes its time from that span's label."""

    bounds: np.ndarray
    labels: np.ndarray
    inner: np.ndarray        # (m, 2) float
    inner_labels: np.ndarray
    inner_in: np.ndarray

    def totals(self, lo: float | None = None, hi: float | None = None) -> dict[str, float]:
        """Seconds per label over [lo, hi] (default: the whole run)."""
        lo = self.bounds[0] if lo is None else lo
        hi = self.bounds[-1] if hi is None else hi
        base = _overlap(self.bounds[:-1], self.bounds[1:], lo, hi)
        out = np.bincount(self.labels, base, minlength=len(LABELS))
        if len(self.inner):
            inner = _overlap(self.inner[:, 0], self.inner[:, 1], lo, hi)
            out -= np.bincount(self.labels[self.inner_in], inner, minlength=len(LABELS))
            out += np.bincount(self.inner_labels, inner, minlength=len(LABELS))
        return {name: float(out[i]) for i, name in enumerate(LABELS)}


def _overlap(a: np.ndarray, b: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return np.clip(np.minimum(b, hi) - np.maximum(a, lo), 0.0, None)


@dataclass
class StepStats:
    """Step-time deviation as the reference computes it, over counted steps (each job's first excluded)."""

    steps: np.ndarray
    times: np.ndarray
    ideal: float | None
    deviation: float | None            # the reference's cumulative-mode figure
    deviation_interval: float | None   # its interval-mode figure
    anomalous: int
    anomalous_extra: float


@dataclass
class Goodput:
    start: float
    end: float
    total: float
    seconds: dict[str, float]
    jobs: list[Job]
    disruptions: list[Disruption]
    startup: list[float]
    data_loading_async: float
    max_productive_step: int
    last_step: int
    steps: StepStats
    timeline: Timeline

    @property
    def goodput(self) -> float:
        return 100.0 * self.seconds[PRODUCTIVE] / self.total if self.total > 0 else float("nan")

    def badput(self) -> dict[str, float]:
        return {k: self.seconds[k] for k in BADPUT}

    def window(self, lo: float, hi: float) -> dict[str, Any]:
        """Goodput and badput over the part of [lo, hi] the run covers (``total`` 0: none)."""
        a, b = max(lo, self.start), min(hi, self.end)
        total = max(0.0, b - a)
        seconds = self.timeline.totals(a, b) if total > 0 else dict.fromkeys(LABELS, 0.0)
        return {"start": lo, "end": hi, "total": total, "seconds": seconds,
                "goodput": 100.0 * seconds[PRODUCTIVE] / total if total > 0 else None}


@dataclass
class _Spans:
    """What ``compute`` gathers job by job: the base spans' starts and labels (in chunks), the inner
    spans, and the per-job figures the ``Goodput`` reports."""

    bounds: list[np.ndarray] = field(default_factory=list)
    labels: list[np.ndarray] = field(default_factory=list)
    inner: list[tuple[float, float, int]] = field(default_factory=list)
    startup: list[float] = field(default_factory=list)           # per job
    counted_steps: list[np.ndarray] = field(default_factory=list)
    counted_times: list[np.ndarray] = field(default_factory=list)
    max_productive: int = 0

    def base(self, a: float, label: str) -> None:
        """A base span starts at ``a`` (it ends where the next one starts)."""
        self.bounds.append(np.array([a], float))
        self.labels.append(np.array([_LABEL[label]]))

    def timeline(self, run_end: float) -> Timeline:
        """The spans as a ``Timeline`` ending at ``run_end``; each inner span clipped to its base span."""
        starts_arr = np.concatenate(self.bounds)
        bounds_arr = np.maximum.accumulate(np.append(starts_arr, max(run_end, starts_arr[-1])))
        labels_arr = np.concatenate(self.labels).astype(np.int64)
        if not self.inner:
            return Timeline(bounds_arr, labels_arr, np.zeros((0, 2)), np.zeros(0, np.int64), np.zeros(0, np.int64))
        spans = np.array([(a, b) for a, b, _ in self.inner])
        where = np.clip(np.searchsorted(bounds_arr, spans[:, 0], side="right") - 1, 0, len(labels_arr) - 1)
        spans[:, 0] = np.maximum(spans[:, 0], bounds_arr[where])
        spans[:, 1] = np.clip(spans[:, 1], spans[:, 0], bounds_arr[where + 1])
        return Timeline(bounds_arr, labels_arr, spans, np.array([lab for _, _, lab in self.inner]), where)


def _inner_in_steps(job: Job, rec_times: np.ndarray, acc: _Spans) -> tuple[np.ndarray, np.ndarray]:
    """Adds the job's evaluations and blocking saves as inner spans (they take their own cause);
    returns the seconds of each inside each step time (evaluation, save), [n steps] each."""
    n_pairs = len(rec_times) - 1
    pair_start = rec_times[:-1]
    eval_in = np.zeros(n_pairs)
    save_in = np.zeros(n_pairs)
    for spans, label, acc_in in ((job.evals, "evaluation", eval_in),
                                 ([(a, b) for a, b, _ in job.saves], "checkpoint_save", save_in)):
        for a, b in spans:
            k = int(np.searchsorted(pair_start, a, side="right")) - 1
            if 0 <= k < n_pairs and b <= rec_times[k + 1]:
                acc_in[k] += b - a
            acc.inner.append((a, b, _LABEL[label]))
    return eval_in, save_in


def _program_startup(job: Job, starts: np.ndarray, adjusted: np.ndarray, nontail: np.ndarray,
                     acc: _Spans) -> float:
    """The reference's per-segment rule: the first counted step's excess over the mean of the others
    (``adjusted``: step times less evaluations; ``nontail``: counted and not the tail), added as an
    inner span at the step's start."""
    if not (nontail[0] and nontail.sum() >= 2):
        return 0.0
    others = adjusted[1:][nontail[1:]]
    startup = max(0.0, float(adjusted[0] - others.mean()))
    # Placed at the step's start; never past the step's own end (before its eval/save).
    startup = min(startup, float(job.ends[0] - starts[0]))
    if startup > 0:
        acc.inner.append((float(starts[0]), float(starts[0]) + startup, _LABEL["program_startup"]))
    return startup


def _step_spans(job: Job, limit: int, acc: _Spans) -> tuple[float, int, float]:
    """Adds a job with steps from its loop's start: its step times (productive up to step ``limit``,
    where the next job resumed; wasted past it) and their inner spans. Returns where the step after
    its last one begins, the steps redone and their seconds (the wasted progress)."""
    starts = job.starts
    acc.base(job.loop_start, "data_loading_sync")
    # Step starts, and where the step after the last one begins.
    rec_steps = np.append(job.steps, job.steps[-1] + 1)
    rec_times = np.append(starts, max(job.close, float(starts[-1])))
    tail = job.end is not None  # the last step runs to job_end (the reference's rule)
    consecutive = np.diff(rec_steps) == 1
    counted = consecutive & (rec_steps[1:] <= limit)
    wasted = consecutive & ~counted
    raw = np.diff(rec_times)
    acc.bounds.append(rec_times[:-1].astype(float))
    acc.labels.append(np.where(counted, _LABEL[PRODUCTIVE], _LABEL["wasted_progress"]))
    eval_in, save_in = _inner_in_steps(job, rec_times, acc)
    # Program startup: evaluations left out, the tail excluded.
    nontail = counted.copy()
    if tail:
        nontail[-1] = False
    acc.startup.append(_program_startup(job, starts, raw - eval_in, nontail, acc))
    if counted.any():
        acc.max_productive = max(acc.max_productive, int(rec_steps[:-1][counted].max()))
    # Step times for the deviation: counted steps but each job's first, net of eval and save.
    keep = nontail.copy()
    keep[0] = False
    acc.counted_steps.append(job.steps[keep[: len(job.steps)]])
    acc.counted_times.append((raw - eval_in - save_in)[keep])
    return float(rec_times[-1]), int(wasted.sum()), float((raw * wasted).sum())


def compute(jobs: list[Job], now: float) -> Goodput:
    """Goodput of a run from its classified jobs (``classify``); ``now`` ends a running one."""
    if not jobs:
        raise ValueError("no job in the events")
    acc = _Spans()
    disruptions: list[Disruption] = []
    with_steps = [j for j in jobs if len(j.steps)]
    for job in jobs:
        nxt = next((k for k in with_steps if k.index > job.index), None)
        resumed = int(nxt.steps[0]) if nxt is not None else None
        last = int(job.steps[-1]) if len(job.steps) else None
        redone = last is not None and resumed is not None and resumed <= last
        ended_badly = job.status not in (*_NORMAL_END, RUNNING)
        disrupted = job.index < jobs[-1].index and (redone or ended_badly)

        # The phases before the first step.
        acc.base(job.start, "backend_init" if job.backend_ready is not None else "training_prep")
        if job.backend_ready is not None:
            acc.base(job.backend_ready, "training_prep")
        for a, b in job.restores:
            acc.inner.append((a, b, _LABEL["checkpoint_restore"]))
        if last is not None:
            limit = resumed if redone else np.iinfo(np.int64).max
            close, redone_steps, lost = _step_spans(job, limit, acc)
        else:
            close = job.close
            acc.startup.append(0.0)
            redone_steps, lost = 0, 0.0
        # The gap to the next job (recovery after a disruption), or to the run's end.
        if disrupted:
            following = jobs[job.index + 1]
            disruptions.append(Disruption(job=job.index, status=job.status or "", last_step=last,
                                          resumed_at=resumed, redone_steps=redone_steps, wasted=lost,
                                          recovery=float(following.start - close)))
        acc.base(close, "infrastructure_recovery" if disrupted else "other")
    run_end = jobs[-1].end if jobs[-1].end is not None else (
        now if jobs[-1].status == RUNNING else jobs[-1].last_event)
    timeline = acc.timeline(run_end)
    bounds_arr = timeline.bounds
    seconds = timeline.totals()
    start = float(bounds_arr[0])
    async_wait = float(sum(j.data_waits[1:].sum() for j in jobs if len(j.steps)))
    last_step = max((int(j.steps[-1]) for j in with_steps), default=0)
    max_productive = acc.max_productive
    if jobs[-1].end is not None and len(jobs[-1].steps):
        max_productive = max(max_productive, int(jobs[-1].steps[-1]))
    stats = step_stats(np.concatenate(acc.counted_steps) if acc.counted_steps else np.zeros(0, np.int64),
                       np.concatenate(acc.counted_times) if acc.counted_times else np.zeros(0))
    return Goodput(start=start, end=float(bounds_arr[-1]), total=float(bounds_arr[-1] - start),
                   seconds=seconds, jobs=jobs, disruptions=disruptions, startup=acc.startup,
                   data_loading_async=async_wait, max_productive_step=max_productive, last_step=last_step,
                   steps=stats, timeline=timeline)


RECENT, BASELINE, SPIKE_PERCENTILE = 100, 1000, 90


def ideal_step_time(times: np.ndarray) -> float | None:
    """Mean of the step times at most median + 3 MAD (the reference also drops steps under 1 s;
    hypertron keeps them, so CPU runs with millisecond steps have an ideal step time too)."""
    if not len(times):
        return None
    med = float(np.median(times))
    mad = float(np.median(np.abs(times - med)))
    normal = times[times <= med + 3 * mad]
    return float(normal.mean()) if len(normal) else None


def percentile(values: np.ndarray, q: float) -> float:
    """Linear-interpolated percentile, as the reference computes it."""
    return float(np.percentile(values, q)) if len(values) else 0.0


def step_stats(steps: np.ndarray, times: np.ndarray) -> StepStats:
    ideal = ideal_step_time(times)
    if ideal is None:
        return StepStats(steps, times, None, None, None, 0, 0.0)
    dev = np.abs(times - ideal)
    if len(dev) < RECENT:
        cumulative = interval = float(dev.mean())
    else:
        interval = percentile(dev[-RECENT:], SPIKE_PERCENTILE)
        cumulative = interval
        if len(dev) >= RECENT + BASELINE:
            cumulative = interval - float(np.median(dev[-(RECENT + BASELINE):-RECENT]))
    med = float(np.median(times))
    mad = float(np.median(np.abs(times - med)))
    anomalous = times > med + 3 * mad
    extra = float(times[anomalous].sum() - anomalous.sum() * times[~anomalous].mean()) if anomalous.any() else 0.0
    return StepStats(steps, times, ideal, cumulative, interval, int(anomalous.sum()), extra)
