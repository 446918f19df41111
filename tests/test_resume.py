"""Surviving kills: exact resume after SIGKILL, clean stop on SIGTERM, damaged checkpoints, job events.

The kill tests run the real ``hypertron train`` in a subprocess, on the tiny model, compiled fast
(``processes.FAST_COMPILE``). The process a test signals sleeps half a second in each batch's loading
(``HYPERTRON_FAULT_DATA_DELAY``, which changes no loss): a window of seconds between "checkpoint 6 is
final" and the end of the run to send its signal, at no cost in CPU.
"""

from __future__ import annotations

import io
import json
import shutil
import signal
import time
from pathlib import Path

import pytest
from rich.console import Console

from hypertron.checkpoint import MANIFEST, CheckpointError, _write_manifest
from hypertron.config import load_config
from hypertron.runfiles import EVENTS
from hypertron.train.events import read_events
from hypertron.train.loop import FAULT_DATA_DELAY, train
from support import runs  # tests/support
from support import processes  # tests/support
from support.tiny import TWO_LAYERS  # tests/support

# A small, fast run, on the stdlib corpus so data order matters.
TINY = [*TWO_LAYERS, "train.log_every=1", "data.source=stdlib"]
ENV = processes.fast_compile(processes.hypertron_env())
# The environment of a process to signal: steps of at least half a second.
PAUSED = {**ENV, FAULT_DATA_DELAY: "*:0.5"}


def _train_cmd(*overrides: str) -> list[str]:
    return processes.hypertron_argv("train", *overrides)






@pytest.mark.slow
def test_sigkill_after_a_final_checkpoint_then_resume_is_bit_identical(tmp_path):
    """12 steps straight == 6 steps, SIGKILL once checkpoint 6 is final, resume to 12: same losses, bit for bit."""
    common = [*TINY, "train.steps=12", "checkpoint.every=6"]
    # One after the other: the later processes load the programs the first compiled (the session's cache).
    straight = processes.run(_train_cmd(*common, f"run_dir={tmp_path / 'a'}"), env=ENV)
    assert straight.returncode == 0, straight.stderr
    run = tmp_path / "b"
    killed = processes.start(_train_cmd(*common, f"run_dir={run}"), env=PAUSED)
    try:
        processes.wait_for(lambda: (run / "checkpoints" / "6" / MANIFEST).exists(), killed, "checkpoint 6 became final")
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert not (run / "checkpoints" / "12").exists(), "the run finished before the kill; steps too fast"
        assert max(runs.steps(run)) < 12
    finally:
        processes.kill(killed)
    resumed = processes.run(_train_cmd(*common, f"run_dir={run}"), env=ENV)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step 6" in resumed.stderr
    want, got = runs.losses(tmp_path / "a"), runs.losses(run)
    assert sorted(want) == sorted(got) == list(range(1, 13))
    assert [got[s] for s in range(1, 13)] == [want[s] for s in range(1, 13)]  # exact float equality


@pytest.mark.slow
def test_sigterm_saves_the_step_reached_exits_0_and_the_next_run_resumes(tmp_path):
    run = tmp_path / "run"
    started = time.time()
    proc = processes.start(_train_cmd(*TINY, "train.steps=1000", "checkpoint.every=1000", f"run_dir={run}"),
                            env=PAUSED)
    try:
        processes.wait_for(lambda: len(runs.steps(run)) >= 3, proc, "three steps")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    finally:
        processes.kill(proc)
    reached = max(runs.steps(run))
    assert reached < 1000
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [reached]
    assert (run / "checkpoints" / str(reached) / MANIFEST).exists()

    again = processes.run(_train_cmd(*TINY, f"train.steps={reached + 2}", "checkpoint.every=1000",
                                      f"run_dir={run}"), env=ENV)
    assert again.returncode == 0, again.stderr
    assert f"resuming from step {reached}" in again.stderr
    assert (run / "checkpoints" / str(reached + 2) / MANIFEST).exists()

    # The events of both jobs, in order: a SIGTERM, its save, then a restore of that save.
    events = read_events(run / "events.jsonl")
    assert {e["event"] for e in events} <= set(EVENTS)
    key = [(e["event"], e["step"]) for e in events if e["event"] != "step"]
    assert key == [
        ("job_start", None), ("backend_ready", None), ("first_step", 1),
        ("preemption", reached), ("checkpoint_save_start", reached), ("checkpoint_save_end", reached),
        ("job_end", reached),
        ("job_start", None), ("backend_ready", None), ("restore_start", reached), ("restore_end", reached),
        ("first_step", reached + 1), ("checkpoint_save_start", reached + 2),
        ("checkpoint_save_end", reached + 2), ("job_end", reached + 2),
    ]
    by_name = {}
    for e in events:
        by_name.setdefault(e["event"], []).append(e)
    assert [e["status"] for e in by_name["job_end"]] == ["preempted", "completed"]
    assert by_name["checkpoint_save_start"][0]["reason"] == "preemption"
    assert by_name["restore_end"][0]["data_restored"] is True
    times = [e["time"] for e in events]
    assert times == sorted(times) and started <= times[0] and times[-1] <= time.time()
    steps = by_name["step"]
    assert [e["step"] for e in steps] == list(range(1, reached + 1)) + [reached + 1, reached + 2]
    assert all(0 < e["step_time"] < 60 and 0 <= e["data_wait"] < e["step_time"] + 1 for e in steps)
    assert 0 < by_name["checkpoint_save_end"][0]["seconds"] < 60
    assert (run / "tensorboard").is_dir() and any((run / "tensorboard").iterdir())


def _train_quiet(overrides):
    out = io.StringIO()
    result = train(load_config(None, overrides), console=Console(file=out, width=200))
    return result, out.getvalue()


def _largest_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST), key=lambda p: p.stat().st_size)


@pytest.mark.slow
def test_damaged_checkpoints_are_skipped_with_one_line_and_refused_when_none_is_left(tmp_path):
    run = tmp_path / "run"
    common = [*TINY, f"run_dir={run}", "checkpoint.every=2", "checkpoint.keep=3"]
    _train_quiet([*common, "train.steps=6"])
    ckpts = run / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [2, 4, 6]

    # Step 6 truncated: resume from 4, say so in one line, keep step 6 aside rather than delete it.
    victim = _largest_file(ckpts / "6")
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    result, out = _train_quiet([*common, "train.steps=7"])
    lines = [line for line in out.splitlines() if "checkpoint 6" in line]
    assert len(lines) == 1 and "unusable" in lines[0] and victim.name in lines[0]
    assert result.first_step == 4 and result.last_step == 7
    assert any((run / "unusable_checkpoints").iterdir())
    skipped = [e for e in read_events(run / "events.jsonl") if e["event"] == "checkpoint_skipped"]
    assert [e["step"] for e in skipped] == [6]

    # A file removed from every remaining step: refuse, and start nothing over.
    for step_dir in (p for p in ckpts.iterdir() if p.name.isdigit()):
        _largest_file(step_dir).unlink()
    before = sorted(p.name for p in ckpts.iterdir())
    with pytest.raises(CheckpointError, match="no usable checkpoint.*missing"):
        _train_quiet([*common, "train.steps=9"])
    assert sorted(p.name for p in ckpts.iterdir()) == before


@pytest.mark.slow
def test_a_checkpoint_that_fails_to_load_falls_back_to_the_previous(tmp_path):
    """Damage the manifest cannot see (same size, garbage bytes): the restore fails and the one before is used."""
    run = tmp_path / "run"
    common = [*TINY, f"run_dir={run}", "checkpoint.every=2"]
    _train_quiet([*common, "train.steps=4"])
    meta = run / "checkpoints" / "4" / "meta" / "metadata"
    meta.write_bytes(b"\0" * meta.stat().st_size)
    result, out = _train_quiet([*common, "train.steps=5"])
    assert "checkpoint 4 could not be read" in out
    assert result.first_step == 2 and result.last_step == 5


def test_a_config_that_fits_no_checkpoint_is_refused_and_nothing_is_moved(tmp_path):
    """Not damage: every step fails to load because the optimiser state changed shape. Refuse, touch nothing."""
    run = tmp_path / "run"
    common = [*TINY, f"run_dir={run}", "checkpoint.every=2"]
    _train_quiet([*common, "train.steps=4"])
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="could be read .*if the config changed"):
        _train_quiet([*common, "train.steps=6", "train.clip_norm=0"])  # no clipping state
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert not (run / "unusable_checkpoints").exists()
    result, _ = _train_quiet([*common, "train.steps=5"])  # the original config resumes as before
    assert result.first_step == 4


def test_a_data_position_saved_by_two_processes_resumes_in_one(tmp_path):
    """data.shards=4: checkpoint 2's data position rewritten as two processes would have saved it
    (shards 0-1 and 2-3 in process_0-of-2.json and process_1-of-2.json), then resumed in this one
    process: the uninterrupted run's losses, bit for bit, with no "starts afresh" (issue 46's
    elastic resume at the loop; tests/test_data.py covers the streams on 1, 2 and 4 processes)."""
    common = [*TINY, "data.shards=4", "train.global_batch=8", "checkpoint.every=2", "train.schedule=constant",
              "train.warmup_steps=0"]
    straight, _ = _train_quiet([*common, "train.steps=4", f"run_dir={tmp_path / 'a'}"])
    run = tmp_path / "b"
    first, _ = _train_quiet([*common, "train.steps=2", f"run_dir={run}"])
    data = run / "checkpoints" / "2" / "data"
    saved = json.loads((data / "process_0-of-1.json").read_text())["shards"]
    assert sorted(saved) == ["0", "1", "2", "3"]
    (data / "process_0-of-1.json").unlink()
    for p, shards in enumerate((["0", "1"], ["2", "3"])):
        (data / f"process_{p}-of-2.json").write_text(json.dumps({"shards": {v: saved[v] for v in shards}}))
    _write_manifest(run / "checkpoints" / "2")  # the files the two processes' save would have listed
    # A copy missing process 1's file: its shards' positions are not there, so the stream starts afresh
    # (the checkpoint itself is good: no earlier step is tried, nothing is moved aside).
    partial = tmp_path / "c"
    shutil.copytree(run, partial)
    (partial / "checkpoints" / "2" / "data" / "process_1-of-2.json").unlink()
    _write_manifest(partial / "checkpoints" / "2")
    afresh, said = _train_quiet([*common, "train.steps=3", f"run_dir={partial}"])
    assert afresh.first_step == 2 and "no state for shards [2, 3]" in said and "starts afresh" in said
    resumed, out = _train_quiet([*common, "train.steps=4", f"run_dir={run}"])
    assert "starts afresh" not in out and resumed.first_step == 2
    assert first.losses + resumed.losses == straight.losses
