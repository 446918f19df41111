"""`hypertron monitor`: goodput by ml-goodput-measurement's definitions, checked against hand-computed
values, against the reference itself, and on a real run killed with SIGKILL and resumed.

Event histories are written in hypertron's own format (docs/events.md) by a small simulator of the
training loop (`History`): it places the events exactly where the loop writes them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from hypertron import cli
from hypertron.monitor import report as mon
from hypertron.monitor.goodput import BADPUT, PRODUCTIVE
from hypertron.train.loop import FAULT_DATA_DELAY
from support import processes  # tests/support
from support.tiny import TWO_LAYERS  # tests/support

ROOT = Path(__file__).resolve().parents[1]


class History:
    """Writes a run's events as the training loop does (times in seconds, chosen by the test)."""

    def __init__(self):
        self.events: list[dict] = []
        self.ref: list[dict] = []  # the same history in ml-goodput-measurement's entries

    def _ev(self, t, name, step=None, **fields):
        self.events.append({"time": t, "event": name, "process": 0, "step": step, **fields})

    def job(self, t0, *, backend, prep, first_batch, steps, restore=None, evals=None, saves=None,
            end=None, waits=0.1, pid=None, host="elsewhere"):
        """One job: ``steps`` = [(step, compute seconds)]; ``restore`` = (step, seconds, prep before
        it); ``evals`` = {step: seconds}; ``saves`` = {step: (blocking, total)}; ``end`` = (status,
        seconds after the last save) or None (killed). Returns the job's last event time."""
        evals, saves = evals or {}, saves or {}
        job_events = []
        ev = lambda *a, **k: job_events.append((a, k))  # noqa: E731
        t = t0
        ev(t, "job_start", pid=pid or 12345, host=host, process_count=1, argv=["hypertron", "train"])
        ref = [{"job_start_time": t}, {"tpu_init_start_time": t}]
        t += backend
        ev(t, "backend_ready", platform="cpu", device_count=1, local_device_count=1, seconds=backend)
        ref.append({"tpu_init_end_time": t})
        ref.append({"training_prep_start_time": t})
        if restore is not None:
            rstep, rsecs, before = restore
            t += before
            ev(t, "restore_start", rstep)
            ref.append({"training_prep_end_time": t})
            t += rsecs
            ev(t, "restore_end", rstep, seconds=rsecs, data_restored=True)
            ref.append({"checkpoint_manager_start_time": t - rsecs, "event_type": "restore", "step": rstep,
                        "directory": "/ckpt", "checkpoint_manager_duration_secs": rsecs,
                        "checkpointer_duration_secs": rsecs})
            ref.append({"training_prep_start_time": t})
            t += prep - before
        else:
            t += prep
        ref.append({"training_prep_end_time": t})
        loop_start = last_end = t
        ref.append({"data_loading_start_time": t})
        ref.append({"data_loading_end_time": t + first_batch})
        t += first_batch
        for i, (step, compute) in enumerate(steps):
            if i:
                ref.append({"step_count": step, "step_start_time": last_end})
            else:
                ref.append({"step_count": step, "step_start_time": t})
            t += compute
            wait = first_batch if i == 0 else waits
            ev(t, "step", step, step_time=t - last_end, data_wait=wait)
            last_end = t
            if step in evals:
                ref.append({"custom_badput_event_type": "eval", "custom_badput_event_start_time": t})
                t += evals[step]
                ev(t, "eval", step, loss=2.0, tokens=100, seconds=evals[step])
                ref.append({"custom_badput_event_type": "eval", "custom_badput_event_end_time": t})
            if step in saves:
                blocking, total = saves[step]
                ev(t, "checkpoint_save_start", step, reason="interval")
                ev(t + total, "checkpoint_save_end", step, seconds=total, blocking_seconds=blocking)
                ref.append({"checkpoint_manager_blocking_start_time": t, "event_type": "save", "step": step,
                            "directory": "/ckpt", "checkpoint_manager_blocking_duration_secs": blocking,
                            "checkpointer_blocking_duration_secs": blocking,
                            "wait_for_prev_duration_secs": 0.0, "get_old_steps_duration_secs": 0.0})
                t += blocking
            last_end = t
        if end is None:  # killed: the step after the last one had begun when the last one ended
            ref.append({"step_count": steps[-1][0] + 1, "step_start_time": last_step_end(job_events)})
        else:
            status, tail = end
            t += tail
            ev(t, "job_end", steps[-1][0], status=status, seconds=t - t0)
            ref.append({"job_end_time": t})
        job_events.sort(key=lambda e: e[0][0])  # a save's end is written when it happens
        for a, k in job_events:
            self._ev(*a, **k)
        self.ref += ref
        return max(a[0] for a, _ in job_events)

    def write(self, run_dir: Path, process: int = 0) -> Path:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / ("events.jsonl" if process == 0 else f"events.{process}.jsonl")
        with path.open("w") as f:
            for e in self.events:
                f.write(json.dumps({**e, "process": process}) + "\n")
        return path


def last_step_end(job_events):
    return max(a[0] for a, _ in job_events if a[1] == "step")


def hand_built() -> History:
    """Two jobs: a slow compile and a slow first batch, a save at 3, killed after step 5, resumed
    from 3 with a restore, an evaluation and saves, completed at 8 (docs/monitoring.md works it)."""
    h = History()
    h.job(1000.0, backend=2.0, prep=3.0, first_batch=1.5,
          steps=[(1, 10.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 1.0)], saves={3: (0.5, 2.0)})
    h.job(1030.0, backend=1.0, prep=1.5, restore=(3, 2.0, 1.0), first_batch=0.5,
          steps=[(4, 6.0), (5, 1.0), (6, 1.0), (7, 1.0), (8, 1.0)], evals={5: 0.75},
          saves={6: (0.25, 1.0), 8: (1.0, 1.0)}, end=("completed", 0.25))
    return h


def test_hand_built_history_gives_the_hand_computed_values(tmp_path):
    hand_built().write(tmp_path)
    rep = mon.build(tmp_path, now=2000.0)
    g = rep.goodput
    # Worked in docs/monitoring.md. Job 0 spans 1000-1021 (killed after step 5, whose end is 1021),
    # job 1 spans 1030-1047.25.
    startup0 = 10.0 - (1.0 + 1.5) / 2                # 8.75: first step 10 s, others 1 and 1.5 (with the save)
    startup1 = 6.0 - (1.0 + 1.25 + 1.0) / 3          # step 5's 1.75 s less its 0.75 s eval; the tail is not averaged
    productive = (10 + 1 + 1.5 - startup0 - 0.5) + (6 + 1.75 + 1.25 + 1 + 2.25 - 0.75 - 0.25 - 1.0 - startup1)
    expect = {
        "backend_init": 2.0 + 1.0, "training_prep": 3.0 + 1.5, "checkpoint_restore": 2.0,
        "data_loading_sync": 1.5 + 0.5, "program_startup": startup0 + startup1,
        "checkpoint_save": 0.5 + 0.25 + 1.0, "evaluation": 0.75,
        "wasted_progress": 1.0 + 1.0,         # steps 4 and 5 of job 0, done again by job 1
        "infrastructure_recovery": 1030.0 - 1021.0, "other": 0.0,
    }
    assert g.total == pytest.approx(47.25, abs=1e-9)
    assert g.seconds[PRODUCTIVE] == pytest.approx(productive, abs=1e-9)
    for k in BADPUT:
        assert g.seconds[k] == pytest.approx(expect[k], abs=1e-9), k
    assert g.goodput == pytest.approx(100 * productive / 47.25, abs=1e-9)
    assert sum(g.seconds.values()) == pytest.approx(g.total, abs=1e-9)
    assert g.data_loading_async == pytest.approx(0.8, abs=1e-9)
    (d,) = g.disruptions
    assert (d.job, d.status, d.last_step, d.resumed_at, d.redone_steps) == (0, "killed", 5, 4, 2)
    assert d.wasted == pytest.approx(2.0, abs=1e-9) and d.recovery == pytest.approx(9.0, abs=1e-9)
    assert g.startup == pytest.approx([startup0, startup1], abs=1e-9)
    assert g.steps.ideal == pytest.approx(1.0, abs=1e-9) and g.steps.anomalous == 0
    assert (g.max_productive_step, g.last_step) == (8, 8)
    # A window clips the same timeline: 1010-1030 holds startup, steps 1-3, the save, the redone
    # steps and the recovery.
    w = g.window(1010.0, 1030.0)
    assert w["total"] == pytest.approx(20.0, abs=1e-9)
    assert w["seconds"]["program_startup"] == pytest.approx(1006.5 + startup0 - 1010.0, abs=1e-9)
    assert w["seconds"][PRODUCTIVE] == pytest.approx(1.25 + 1.0 + 1.0, abs=1e-9)
    assert w["seconds"]["wasted_progress"] == pytest.approx(2.0, abs=1e-9)
    assert w["seconds"]["infrastructure_recovery"] == pytest.approx(9.0, abs=1e-9)
    assert w["goodput"] == pytest.approx(100 * 3.25 / 20, abs=1e-9)
    assert g.window(0.0, 999.0)["total"] == 0 and g.window(0.0, 999.0)["goodput"] is None
    assert g.window(0.0, 1e4)["seconds"] == pytest.approx(g.seconds, abs=1e-9)  # the whole run


def _reference(entries, tmp_path):
    """ml-goodput-measurement's calculator over ``entries``, with its own tests' in-memory logger."""
    goodput = pytest.importorskip("ml_goodput_measurement.src.goodput")

    class MemoryLogger:  # what ml-goodput-measurement's goodput_test.py uses instead of Cloud Logging
        def __init__(self):
            self.entries = []

        def write_cloud_logging_entry(self, entry):
            self.entries.append(entry)

        def read_cloud_logging_entries(self, start_time=None, end_time=None, last_entry_info=None):
            return list(self.entries), None

    logger = MemoryLogger()
    for e in sorted(entries, key=lambda e: next(v for k, v in e.items() if "time" in k)):
        logger.write_cloud_logging_entry({"job_name": "run", **e})
    calc = goodput.GoodputCalculator("run", "log", cloud_logger=logger, cache_dir=str(tmp_path / "cache"))
    percent, breakdown, _ = calc.get_job_goodput(include_badput_breakdown=True)
    return percent, breakdown, calc._number_of_interruptions


def _random_history(seed: int) -> History:
    """Two jobs as `hypertron train` runs them: the first killed after an interval save, the second
    resumed from it; random step times with a few slow ones, a slow compile and first batch,
    evaluations and saves at counted steps."""
    import random

    r = random.Random(seed)
    h = History()
    every, kill_after = 4, r.randint(9, 11)  # saves at 4 and 8; killed a few steps past 8
    steps = [(s, (r.uniform(20, 40) if s == 1 else r.choice([r.uniform(1, 1.3)] * 9 + [r.uniform(3, 5)])))
             for s in range(1, kill_after + 1)]
    saves = {s: (r.uniform(0.1, 0.6), r.uniform(1, 3)) for s in range(every, kill_after + 1, every)}
    evals = {s: r.uniform(0.5, 2) for s in (3, 6)}
    t = h.job(1.7e9, backend=r.uniform(1, 5), prep=r.uniform(2, 9), first_batch=r.uniform(0.5, 4),
              steps=steps, saves=saves, evals=evals, waits=r.uniform(0, 0.05))
    n = 20
    steps = [(s, (r.uniform(10, 20) if s == 9 else r.uniform(1, 1.3))) for s in range(9, n + 1)]
    saves = {s: (r.uniform(0.1, 0.6), r.uniform(1, 3)) for s in (12, 16, n)}
    h.job(t + r.uniform(30, 300), backend=r.uniform(1, 5), prep=r.uniform(3, 9), restore=(8, r.uniform(1, 4), 1.0),
          first_batch=r.uniform(0.5, 4), steps=steps, saves=saves, evals={14: r.uniform(0.5, 2)},
          end=("completed", r.uniform(0.05, 0.5)), waits=r.uniform(0, 0.05))
    return h


REFERENCE_NAMES = {  # ml-goodput-measurement's BadputType for each shared cause
    "backend_init": "TPU_INITIALIZATION", "training_prep": "TRAINING_PREP",
    "program_startup": "PROGRAM_STARTUP", "data_loading_sync": "DATA_LOADING_SYNC",
    "checkpoint_save": "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
    "checkpoint_restore": "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
    "wasted_progress": "WASTED_PROGRESS_FROM_DISRUPTION",
    "infrastructure_recovery": "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION", "other": "OTHER",
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_goodput_matches_ml_goodput_measurement(tmp_path, seed):
    history = hand_built() if seed == 0 else _random_history(seed)
    percent, breakdown, interruptions = _reference(history.ref, tmp_path)
    history.write(tmp_path / "run")
    g = mon.build(tmp_path / "run", now=2e9).goodput
    from ml_goodput_measurement.src.goodput_utils import BadputType

    assert g.goodput == pytest.approx(percent, abs=1e-6)
    for ours, theirs in REFERENCE_NAMES.items():
        assert 100 * g.seconds[ours] / g.total == pytest.approx(breakdown[BadputType[theirs]], abs=1e-6), ours
    assert 100 * g.seconds["evaluation"] / g.total == pytest.approx(
        breakdown[BadputType.CUSTOM_BADPUT_EVENTS].get("EVAL", 0.0), abs=1e-6)
    assert len(g.disruptions) == interruptions == 1


@pytest.mark.slow
def test_a_real_run_killed_after_step_9_and_resumed(tmp_path):
    """SIGSTOP after step 9 (checkpoint at 6, final): alive but not stepping, so hung; SIGKILL: killed;
    resumed to 12: one disruption, wasted = the first job's steps 7-9, recovery as defined."""
    run = tmp_path / "run"
    args = processes.hypertron_argv("train", *TWO_LAYERS, f"run_dir={run}", "data.source=stdlib", "train.steps=12",
                                    "checkpoint.every=6", "train.log_every=100")
    # One device, compiled fast; steps of at least 0.2 s (a sleep in each batch's loading), so the
    # SIGSTOP lands well before the end, and a stopped process soon counts as hung.
    env = processes.fast_compile(processes.hypertron_env(XLA_FLAGS=""))
    proc = processes.start(args, env={**env, FAULT_DATA_DELAY: "*:0.2"})
    events = run / "events.jsonl"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            # Stopped once step 9 is recorded and the asynchronous save of step 6 is final (else the
            # resumed job would rightly start over): usually right after step 9.
            text = events.read_text() if events.exists() else ""
            if '"step": 9,' in text and '"checkpoint_save_end"' in text:
                os.kill(proc.pid, signal.SIGSTOP)
                break
            time.sleep(0.001)
        else:
            pytest.fail(f"the run never reached step 9: {proc.stderr.read()[-2000:] if proc.poll() else ''}")
        time.sleep(1.0)
        stopped = mon.build(run, hang_factor=2.0, hang_min=0.5)
        assert stopped.goodput.jobs[0].status == "running"
        assert stopped.processes[0].hung and any(a.startswith("hung: process 0") for a in stopped.alarms)
    finally:
        proc.kill()
        proc.wait()
    killed = mon.build(run, hang_factor=2.0, hang_min=0.5)
    assert killed.goodput.jobs[0].status == "killed" and not killed.alarms
    first = [e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "step"]
    last = first[-1]["step"]
    assert last >= 9  # the kill lands after step 9 (rarely after 10: the rule below still holds)
    resumed = processes.run(args, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    g = mon.build(run).goodput
    assert [j.status for j in g.jobs] == ["killed", "completed"]
    assert [int(j.steps[0]) for j in g.jobs] == [1, 7] and g.last_step == 12
    (d,) = g.disruptions
    assert (d.last_step, d.resumed_at, d.redone_steps) == (last, 7, last - 6)
    step_times = {e["step"]: e["step_time"] for e in first}
    assert d.wasted == pytest.approx(sum(step_times[s] for s in range(7, last + 1)), abs=1e-3)
    assert g.seconds["wasted_progress"] == pytest.approx(d.wasted, abs=1e-9)
    assert d.recovery == pytest.approx(g.jobs[1].start - first[-1]["time"], abs=1e-9)
    assert g.seconds["checkpoint_restore"] > 0 and g.seconds["program_startup"] > 0
    assert sum(g.seconds.values()) == pytest.approx(g.total, abs=1e-6)
    assert cli.main(["monitor", str(run)]) == 0


def test_running_processes_hang_and_the_multi_process_table(tmp_path):
    """Process 1 of a running two-process job stops stepping while alive: it alone is hung."""
    now = time.time()
    sleeper = processes.start([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        time.sleep(0.2)
        start = time.time()
        for process, last in ((0, 60), (1, 25)):
            h = History()
            h.job(start, backend=0.5, prep=0.5, first_batch=0.1, steps=[(s, 0.5) for s in range(1, last + 1)],
                  pid=sleeper.pid, host=socket.gethostname())
            h.events = [e for e in h.events if e["time"] <= start + 30]
            h.write(tmp_path, process)
        rep = mon.build(tmp_path, now=start + 30.5, hang_factor=10, hang_min=0)
        assert [p.index for p in rep.processes] == [0, 1]
        assert [p.status for p in rep.processes] == ["running", "running"]
        assert [p.hung for p in rep.processes] == [False, True]
        assert rep.processes[1].last_step == 25 and rep.processes[1].median_step_time == pytest.approx(0.5)
        (alarm,) = rep.alarms
        assert alarm.startswith("hung: process 1")
    finally:
        sleeper.kill()
        sleeper.wait()
    rep = mon.build(tmp_path, now=now + 60)
    assert rep.goodput.jobs[-1].status == "killed" and not rep.alarms


def test_bad_run_directories_get_one_line(tmp_path, capsys):
    assert cli.main(["monitor", str(tmp_path / "missing")]) == 2
    (tmp_path / "file").write_text("x")
    assert cli.main(["monitor", str(tmp_path / "file")]) == 2
    assert cli.main(["monitor", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {tmp_path / 'missing'} does not exist",
                   f"error: {tmp_path / 'file'} is not a directory",
                   f"error: {tmp_path} holds no events.jsonl: not a hypertron training run, or it has not started yet"]
    (tmp_path / "events.jsonl").write_text("")
    assert cli.main(["monitor", str(tmp_path)]) == 0
    assert "no job has started yet" in capsys.readouterr().out
    assert cli.main(["monitor", str(tmp_path), "--window", "soon"]) == 2
    assert capsys.readouterr().err.strip() == "error: --window='soon': not a duration (use 90s, 30m, 2h or 1d)"


def test_torn_and_damaged_lines_are_skipped_and_counted(tmp_path, capsys):
    hand_built().write(tmp_path)
    path = tmp_path / "events.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    # A torn line where job 1 was killed (the next job starts on a fresh line, as EventLog does),
    # a line of garbage, a step whose step_time is a string, and a half-written last line.
    cut = next(i for i, line in enumerate(lines) if '"job_start"' in line and i)
    lines.insert(cut, '{"time": 1021.5, "event": "st\n')
    lines.insert(3, "not json\n")
    lines.insert(4, '{"time": 1003.0, "event": "step", "step": 99, "step_time": "fast"}\n')
    path.write_text("".join(lines) + '{"time": 1048.0, "event": "st')
    rep = mon.build(tmp_path, now=2000.0)
    assert rep.bad_lines == {"events.jsonl": 4}
    assert rep.goodput.total == pytest.approx(47.25)  # the readable events say the same as before
    assert cli.main(["monitor", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bad_lines"] == {"events.jsonl": 4} and out["goodput_percent"] == pytest.approx(rep.goodput.goodput)


def test_loss_alarms_and_time_arguments(tmp_path):
    hand_built().write(tmp_path)
    rows = [{"step": s, "loss": 3.0 + 0.01 * (s % 7)} for s in range(1, 400)]
    rows[250]["loss"] = 9.0                   # a spike
    rows[300]["loss"] = float("nan")          # json.dumps writes NaN
    rows.insert(100, {"step": 100, "eval_loss": 50.0, "eval_tokens": 10})  # eval rows are not steps
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = mon.build(tmp_path, now=2000.0)
    assert rep.alarms == ["loss is not finite at 1 steps (first: step 301)",
                          "loss spikes at 1 steps (first: step 251, loss 9)"]
    assert cli.main(["monitor", str(tmp_path)]) == 1  # an alarm: exit 1
    assert mon.window_of(None, "30m", 5000.0) == (3200.0, 5000.0)
    assert mon.window_of("1000", "90s", 5000.0) == (1000.0, 1090.0)
    assert mon.window_of("2h", None, 9000.0) == (1800.0, 9000.0)
    assert mon.parse_time("1970-01-01T00:16:40+00:00", 0.0) == 1000.0
