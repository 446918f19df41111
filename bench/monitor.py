"""How fast `hypertron monitor` analyses a big run: N steps x P processes of job events.

    python bench/monitor.py [--steps 1000000] [--processes 8] [--jobs 3] [--repeats 3] [--dir DIR]

Writes a synthetic run directory the way `hypertron train` writes one (``events.jsonl`` for process
0, ``events.<i>.jsonl`` for the others, one ``step`` event per step plus job, restore, save and eval
events, ``--jobs`` jobs with a disruption between each, and ``metrics.jsonl`` with a row per step),
then times the whole analysis, :func:`hypertron.monitor.report.build` (read every file, goodput over
all jobs, step-time deviation, each process's progress and hang check, loss alarms) and the JSON
report, and what the live dashboard computes on top for each update
(:func:`hypertron.monitor.dashboard.data`), best of ``--repeats``.
The files are written once and kept in ``--dir`` (default: a temporary directory, removed).

    python bench/monitor.py --collector [--train-steps 200] [--interval 10]

What the host collector (:mod:`hypertron.monitor.collector`) costs a training step: the time of
its per-step call (``scalars``), of one sample (every figure, with the host-to-device copy) and
of one copy, measured directly, and per step of the ``tiny`` model on this machine (CPU) the
cost they add at the default settings: a call per step, a sample every ``--interval`` seconds,
a copy every ``monitor.h2d_every`` steps. Then the same training run with and without a
collector sampling every second, for the end-to-end difference (noisy on a shared CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hypertron.config import MonitorConfig  # noqa: E402
from hypertron.monitor import dashboard  # noqa: E402
from hypertron.monitor import report as mon  # noqa: E402


def write_run(run: Path, steps: int, processes: int, jobs: int, seed: int = 0) -> int:
    """The run's event files; returns their total size in bytes."""
    rng = np.random.default_rng(seed)
    run.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    metrics: list[str] = []
    t, step = 1.7e9, 0
    per_job = steps // jobs
    for j in range(jobs):
        lines.append(json.dumps({"time": t, "event": "job_start", "process": 0, "step": None, "pid": 1,
                                 "host": "bench", "process_count": processes, "argv": ["hypertron", "train"]}))
        t += 2.0
        lines.append(json.dumps({"time": t, "event": "backend_ready", "process": 0, "step": None,
                                 "platform": "gpu", "device_count": 8 * processes, "local_device_count": 8,
                                 "seconds": 2.0}))
        if j:
            step = max(0, step - 500)  # resumed 500 steps back: a disruption
            lines.append(json.dumps({"time": t + 1, "event": "restore_start", "process": 0, "step": step}))
            t += 5.0
            lines.append(json.dumps({"time": t, "event": "restore_end", "process": 0, "step": step,
                                     "seconds": 4.0, "data_restored": True}))
        t += 3.0
        n = per_job if j < jobs - 1 else steps - per_job * (jobs - 1)
        times = np.where(rng.random(n) < 0.01, 2.0, 0.5) + rng.random(n) * 0.01
        times[0] += 60.0  # compile
        ends = t + np.cumsum(times)
        loss = 2.0 + 8.0 / np.sqrt(step + np.arange(1, n + 1)) + rng.random(n) * 0.05
        for i in range(n):
            step += 1
            lines.append(f'{{"time": {float(ends[i])!r}, "event": "step", "process": 0, "step": {step}, '
                         f'"step_time": {float(times[i])!r}, "data_wait": 0.0001}}')
            tps = 4096 / float(times[i])
            metrics.append(f'{{"step": {step}, "grad_norm": 1.0, "loss": {float(loss[i])!r}, "lr": 0.0003, '
                           f'"tokens": 32768.0, "step_time": {float(times[i])!r}, "tokens_per_sec_per_device": '
                           f'{tps!r}, "tflops_per_device": {tps * 6e9 / 1e12!r}, "mfu": {tps * 6e9 / 989e12!r}, '
                           f'"data_wait": 0.0001, "time": {float(ends[i])!r}}}')
            if step % 1000 == 0:
                lines.append(json.dumps({"time": ends[i], "event": "checkpoint_save_start", "process": 0,
                                         "step": step, "reason": "interval"}))
                lines.append(json.dumps({"time": ends[i] + 3, "event": "checkpoint_save_end", "process": 0,
                                         "step": step, "seconds": 3.0, "blocking_seconds": 0.2}))
        t = float(ends[-1])
        if j == jobs - 1:
            lines.append(json.dumps({"time": t + 1, "event": "job_end", "process": 0, "step": step,
                                     "status": "completed", "seconds": 1.0}))
        t += 120.0  # killed; the next job starts two minutes later
    text = ("\n".join(lines) + "\n").encode()
    (run / "metrics.jsonl").write_text("\n".join(metrics) + "\n")
    size = (run / "metrics.jsonl").stat().st_size
    for p in range(processes):
        path = run / ("events.jsonl" if p == 0 else f"events.{p}.jsonl")
        path.write_bytes(text if p == 0 else text.replace(b'"process": 0', b'"process": %d' % p))
        size += path.stat().st_size
    return size


def _median_call(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def collector_cost(train_steps: int, interval: float) -> None:
    from hypertron.config import MonitorConfig, load_config
    from hypertron.monitor.collector import Collector
    from hypertron.train.loop import train

    def run(trackers, where):
        cfg = load_config(None, ["model=tiny", f"train.steps={train_steps}", "train.log_every=1000000",
                                 "checkpoint.enabled=false", f"run_dir={where}"])
        rows = train(cfg, trackers=trackers).rows[1:]
        return float(np.median([r["step_time"] for r in rows]))

    defaults = MonitorConfig()
    with tempfile.TemporaryDirectory() as tmp:
        c = Collector(tmp, MonitorConfig(interval=3600), process_index=0)
        c.begin(0, 1)
        values = {"loss": 1.0, "step_time": 0.1, "data_wait": 0.001, "mfu": None}
        per_call = _median_call(lambda: c.scalars(1, values), 20_000)
        sample = _median_call(c._sample, 50)
        copy = _median_call(c._time_h2d, 50)
        c.finish("completed")
        plain = run([], Path(tmp) / "plain")
        watched = run([Collector(Path(tmp) / "watched", MonitorConfig(interval=1.0))], Path(tmp) / "watched")
    step = plain
    added = per_call + sample * step / interval + copy / defaults.h2d_every
    print(f"# hypertron collector bench  {datetime.date.today()}  {platform.node()}  {os.cpu_count()} CPUs  "
          f"Python {platform.python_version()}")
    print(f"# command: python bench/monitor.py --collector --train-steps {train_steps} --interval {interval:g}")
    print(f"per step: scalars() {per_call * 1e6:.1f} us | one sample {sample * 1e3:.2f} ms | one "
          f"{defaults.h2d_bytes >> 20} MiB host-to-device copy {copy * 1e3:.2f} ms")
    print(f"tiny step (CPU, median of {train_steps - 1}): {step * 1e3:.1f} ms; the collector adds "
          f"{added * 1e6:.0f} us per step at interval={interval:g} s, h2d_every={defaults.h2d_every}: "
          f"{100 * added / step:.3f}% of a step")
    print(f"end to end: median step {plain * 1e3:.1f} ms without, {watched * 1e3:.1f} ms with a collector "
          f"sampling every 1 s ({100 * (watched / plain - 1):+.1f}%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collector", action="store_true", help="measure the host collector's cost per step instead")
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--interval", type=float, default=MonitorConfig().interval)
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, help="keep the run here (written if it holds no events.jsonl)")
    args = ap.parse_args()
    if args.collector:
        return collector_cost(args.train_steps, args.interval)
    tmp = None if args.dir else tempfile.mkdtemp(prefix="hypertron-monitor-bench-")
    run = args.dir or Path(tmp)
    try:
        t0 = time.perf_counter()
        if not (run / "events.jsonl").exists():
            size = write_run(run, args.steps, args.processes, args.jobs)
        else:
            size = sum(p.stat().st_size for p in run.glob("*.jsonl"))
        wrote = time.perf_counter() - t0
        best = page = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            rep = mon.build(run, now=2e9)
            json.dumps(mon.to_json(rep), default=str)
            best = min(best, time.perf_counter() - t0)
            # What the dashboard adds to each of its updates: the series and heatmaps from the report.
            t0 = time.perf_counter()
            body = json.dumps(dashboard.data(rep), allow_nan=False, separators=(",", ":"))
            page = min(page, time.perf_counter() - t0)
        g = rep.goodput
        print(f"# hypertron monitor bench  {datetime.date.today()}  {platform.node()}  "
              f"{os.cpu_count()} CPUs  Python {platform.python_version()}")
        print(f"# command: python bench/monitor.py --steps {args.steps} --processes {args.processes} "
              f"--jobs {args.jobs} --repeats {args.repeats}")
        print(f"events: {args.steps:,} steps x {args.processes} processes, {args.jobs} jobs, "
              f"{size / 1e6:,.0f} MB (written in {wrote:.1f} s)")
        print(f"analysis (read all files, goodput, deviation, per-process progress, JSON): best of "
              f"{args.repeats} = {best:.2f} s")
        print(f"dashboard data on top (curves thinned to {dashboard.POINTS} points, {dashboard.BINS} time bins): "
              f"best of {args.repeats} = {page:.2f} s, {len(body) / 1e3:,.0f} kB of JSON per update")
        print(f"check: goodput {g.goodput:.2f}%, {len(g.disruptions)} disruptions, "
              f"{len(rep.processes)} processes, last step {g.last_step}, ideal step {g.steps.ideal:.4f} s")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
