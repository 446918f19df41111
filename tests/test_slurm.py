"""Slurm for real: Debian's slurm-wlm and munge started on localhost (``tests/support/slurm.py``),
``hypertron workload create --scheduler slurm`` submitting the job, and ``workload delete``,
Slurm's signals and the script's own requeue acting on it.

Skipped, saying why, where Slurm is not installed or the tests do not run as root
(``make test`` installs it as root).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from hypertron.launch import recipes, slurm
from hypertron.train.events import read_events

from support import processes, runs  # tests/support
from support.cli import cli_output
from support.slurm import LocalSlurm, missing

GOLDEN = Path(__file__).parent / "golden" / "launch" / "llama3.1-70b-a3mega.sbatch"
# The tiny run of tests/test_multiprocess.py, as a recipe of 1 node x 2 processes of 4 CPU devices.
RECIPE = """\
model: {preset: tiny, num_layers: 2, embed_dim: 64, mlp_dim: 192}
data: {source: stdlib}
train: {global_batch: 8, seq_len: 32, log_every: 1, schedule: constant, warmup_steps: 0, steps: 100000}
checkpoint: {every: 1000}
monitor: {collect: false}
launch:
  machine: cpu
  nodes: 1
  processes_per_node: 2
  xla_flags: [{value: --xla_force_host_platform_device_count=4, reason: four devices per process},
              """ + ", ".join(f"{{value: {flag}, reason: compiled fast}}" for flag in processes.FAST_COMPILE.split()) + """]
  env: [{value: JAX_PLATFORMS=cpu, reason: the CPU}]
"""


def test_the_sbatch_script_of_a_multi_node_recipe_equals_its_golden_file():
    job = slurm.Job("llama70", recipes.load("a3mega-h100/llama3.1-70b"), storage="/shared/runs", partition="a3mega",
                    time="2-00:00:00", python="/opt/hypertron/bin/python")
    text = slurm.script(job)
    if os.environ.get("HYPERTRON_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "HYPERTRON_UPDATE_GOLDEN=1 rewrites it; read the diff"
    assert "#SBATCH --nodes=32" in text and "#SBATCH --gpus-per-node=8" in text and "--requeue" in text
    bash = processes.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert bash.returncode == 0, bash.stderr  # valid shell


@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory):
    why = missing()
    if why:
        pytest.skip(why)
    s = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield s
    s.stop()



def test_bad_input_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    code, out, err = cli_output("workload", "create", "w", "--scheduler", "slurm", "--recipe", "cpu/tiny",
                          "--storage", str(tmp_path / "runs"))
    assert code == 2 and err == "error: sbatch is not on PATH: run this on a Slurm login node (or install Slurm's " \
        "client commands)\n" and not (tmp_path / "runs").exists()
    code, out, err = cli_output("workload", "create", "w", "--scheduler", "slurm", "--recipe", "cpu/tiny",
                          "--time", "soon", "--dry-run")
    assert code == 2 and err.startswith("error: --time='soon'") and err.count("\n") == 1


def test_sbatch_reads_a_run_directory_of_spaces_quotes_and_percent_back_intact(local_slurm, tmp_path):
    """The script's #SBATCH lines (sbatch parses them, not a shell) with a nasty --storage, under a
    body that prints where it ran: the job runs there and its output lands there."""
    (tmp_path / "tiny2.yaml").write_text(RECIPE)
    job = slurm.Job("w", recipes.load(str(tmp_path / "tiny2.yaml")), storage=str(tmp_path / "my runs/it's #1 \"q\" 50%"))
    directives = [line for line in slurm.script(job).splitlines() if line.startswith("#SBATCH ")]
    job.run_dir.mkdir(parents=True)
    (job.run_dir / "where.sh").write_text("\n".join(["#!/bin/bash", *directives, "pwd"]) + "\n")
    out = processes.run(["sbatch", "--parsable", str(job.run_dir / "where.sh")], env=local_slurm.env,
                        capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    log = job.run_dir / f"slurm-{out.stdout.strip().split(';')[0]}.out"
    _wait(lambda: log.is_file() and log.read_text().strip(), "the job's output", detail=local_slurm.logs)
    assert log.read_text().strip() == str(job.run_dir)


def _wait(predicate, what: str, timeout: float = 240.0, detail=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}\n{detail()}"
        time.sleep(0.3)




def _state(job_id: str, env: dict) -> str:
    out = processes.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w).get("JobState", "")


@pytest.mark.slow
def test_a_slurm_job_trains_like_one_process_resumes_after_delete_and_requeues_itself(local_slurm, tmp_path,
                                                                                       capsys, monkeypatch):
    from test_multiprocess import _reference_losses  # one process fed the same global batches

    monkeypatch.setenv("SLURM_CONF", local_slurm.env["SLURM_CONF"])
    env = local_slurm.env
    (tmp_path / "tiny2.yaml").write_text(RECIPE)
    storage, run = tmp_path / "runs", tmp_path / "runs" / "tiny2"
    create = ["workload", "create", "tiny2", "--scheduler", "slurm", "--recipe", str(tmp_path / "tiny2.yaml"),
              "--storage", str(storage)]

    # An unknown partition: Slurm refuses it, in one line.
    code, _, err = cli_output(*create, "--partition", "nope")
    assert code == 2 and "invalid partition" in err and err.count("\n") == 1, err

    # 1. Submitted; deleted while it runs (scancel: SIGTERM, the run saves), then created again: it resumes.
    code, out, err = cli_output(*create)
    assert code == 0 and "submitted Slurm job" in out, err
    first = out.split()[3]
    _wait(lambda: len(runs.steps(run)) >= 3, "three steps")
    assert cli_output("workload", "delete", "tiny2", "--scheduler", "slurm")[0] == 0
    _wait(lambda: _state(first, env) == "CANCELLED", "the cancelled job to end")
    saved = max(runs.steps(run))
    assert (run / "checkpoints" / str(saved)).is_dir()
    code, out, err = cli_output(*create, f"train.steps={saved + 2}")
    assert code == 0, err
    second = out.split()[3]
    _wait(lambda: _state(second, env) == "COMPLETED", "the resumed job to complete")
    assert f"resuming from step {saved}" in (run / f"slurm-{second}.out").read_text()
    rows = [r for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, saved + 3))
    np.testing.assert_allclose([r["loss"] for r in rows], _reference_losses(saved + 2), rtol=2e-5)

    # 2. A job whose step exits with the restart code (SIGTERM to its tasks, as a preemption)
    #    requeues itself and resumes. Slurm holds a requeued job for its credential lifetime
    #    (AuthInfo=cred_expire, 20 s in the test Slurm, 120 s by default); the next pass of
    #    its scheduler (sched_interval, 2 s there, 60 s by default) starts it
    #    again by itself. (Moving that hold to "now" raced the old allocation's cleanup: the job
    #    started while its credential was still revoked and failed.)
    code, out, err = cli_output(*create)
    third = out.split()[3]
    _wait(lambda: max(runs.steps(run)) > saved + 2, "the third job's first step")
    processes.run(["scancel", "--signal=TERM", third], env=env, check=True)
    _wait(lambda: {"Restarts=1", "JobState=PENDING", "Reason=BeginTime"} <= set(processes.run(
        ["scontrol", "show", "job", third], env=env, capture_output=True, text=True).stdout.split()), "the requeue")
    events = run / "events.jsonl"
    _wait(lambda: [e["event"] for e in read_events(events)].count("first_step") == 4,
          "the requeued job's first step", detail=lambda: processes.run(
              ["scontrol", "show", "job", third], env=env, capture_output=True, text=True).stdout
          + (run / f"slurm-{third}.out").read_text()[-2000:] + local_slurm.logs())
    assert cli_output("workload", "delete", "tiny2", "--scheduler", "slurm")[0] == 0
    _wait(lambda: _state(third, env) == "CANCELLED", "the requeued job to end")
    log = (run / f"slurm-{third}.out").read_text()
    assert "hypertron: stopped by SIGTERM (exit 42): requeueing job" in log
    order = [(e["event"], e["step"]) for e in read_events(events) if e["event"] in ("preemption", "restore_end")]
    last = max(i for i, (name, _) in enumerate(order) if name == "restore_end")
    assert order[last - 1][0] == "preemption" and order[last][1] == order[last - 1][1] > saved + 2, order
