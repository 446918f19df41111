"""Slurm: a recipe as an sbatch script, submitted, watched, cancelled and requeued through Slurm's
own commands (``sbatch``, ``squeue``, ``scancel``, ``scontrol``).

The run directory (``<storage>/<name>``, on the cluster's shared file system) is made before
submission and holds everything: the resolved recipe (``recipe.yaml``), the script
(``sbatch.sh``) and the job's output (``slurm-<jobid>.out``). The script starts one task per node
or per GPU (``launch.processes_per_node``) with ``srun``; each task is a ``hypertron train``
process that finds the job from Slurm's variables (JAX's own Slurm detection: the coordinator on
the first node, the process id from ``SLURM_PROCID``). Slurm has no requeue-on-exit-code of its
own, so the script requeues the job itself (``scontrol requeue``) when the step exits with
:data:`~hypertron.launch.recipes.PREEMPT_EXIT_CODE`, the code a SIGTERM'd run exits with under a
scheduler; the requeued job resumes from the checkpoint that SIGTERM saved.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from hypertron.errors import UserError
from hypertron.launch.recipes import PREEMPT_EXIT_CODE, Recipe

COMMENT = "hypertron"  # every job hypertron submits carries it (squeue's %k), so list shows only ours
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]*$")  # what an #SBATCH value may hold unquoted
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$")


@dataclass(frozen=True)
class Job:
    name: str
    recipe: Recipe
    storage: str                   # the shared directory run directories go under
    partition: str = ""
    time: str = ""                 # Slurm's time limit: minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]
    python: str = sys.executable   # the interpreter with hypertron installed, on every node

    @property
    def run_dir(self) -> Path:
        return Path(self.storage).absolute() / self.name


def check(job: Job) -> None:
    """Every value the script holds: a control character (a newline would end a directive or a
    command and start another) is refused, and so is a backslash in the run directory (sbatch reads
    one in ``--output`` as "no %j here")."""
    for what, value in (("--storage", job.storage), ("--recipe", job.recipe.name), ("the interpreter", job.python),
                        *((f"launch.env {k}", f"{k}={v}") for k, v in job.recipe.env().items())):
        if any(unicodedata.category(c) == "Cc" for c in value):
            raise UserError(f"{what}={value!r}: holds a control character; a script cannot carry it safely")
    if "\\" in str(job.run_dir):
        raise UserError(f"--storage={job.storage!r}: a backslash cannot be written into Slurm's --output pattern")
    if not _NAME.match(job.name):
        raise UserError(f"job name {job.name!r}: letters, digits, '.', '_' and '-', starting with a letter or digit")
    if job.time and not _TIME.match(job.time):
        raise UserError(f"--time={job.time!r}: Slurm's form: minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]")
    if job.partition and not re.match(r"^[A-Za-z0-9_.-]+$", job.partition):
        raise UserError(f"--partition={job.partition!r}: not a partition name")


def directive(value: str) -> str:
    """``value`` as sbatch reads it back from an ``#SBATCH`` line, which no shell parses: sbatch
    splits the line at white space outside quotes, drops the quotes, takes the character after a
    backslash as it is, and ends the line at a ``#`` (older versions even inside quotes). A value
    of plain characters stays as it is; any other is double-quoted with ``\\``, ``"``, ``'`` and ``#``
    escaped by a backslash."""
    if _PLAIN.match(value):
        return value
    return '"' + re.sub(r"([\\\"'#])", r"\\\1", value) + '"'


def script(job: Job) -> str:
    """The sbatch script (directives, the recipe's environment, srun, the requeue on the restart code)."""
    check(job)
    r, run = job.recipe, job.run_dir
    q = shlex.quote
    pattern = str(run).replace("%", "%%")  # --output expands %j; %% is a literal %
    directives = [f"--job-name={job.name}", f"--nodes={r.nodes}", f"--ntasks-per-node={r.processes_per_node}",
                  *([f"--gpus-per-node={r.machine.gpus}", "--exclusive"] if r.machine.gpus else []),
                  f"--chdir={directive(str(run))}", f"--output={directive(pattern + '/slurm-%j.out')}",
                  "--open-mode=append", "--requeue",
                  f"--comment={COMMENT}",
                  *([f"--partition={job.partition}"] if job.partition else []),
                  *([f"--time={job.time}"] if job.time else [])]
    lines = ["#!/bin/bash",
             f"# {job.name}: {r.name} on {r.nodes} node{'s' * (r.nodes > 1)} x {r.processes_per_node} "
             f"process{'es' * (r.processes_per_node > 1)}, rendered by hypertron workload create --scheduler slurm",
             *(f"#SBATCH {d}" for d in directives), "",
             "# The recipe's environment (XLA flags, NCCL and the network).",
             *(f"export {k}={q(v)}" for k, v in r.env().items()), "",  # k: a name (config.validation)
             "# One hypertron train per task; jax.distributed finds the job from Slurm's variables.",
             f"srun --kill-on-bad-exit=1 {q(job.python)} -m hypertron.cli train {q(str(run / 'recipe.yaml'))}",
             "code=$?",
             f"# SIGTERM before the last step: the checkpoint is saved and the step exits {PREEMPT_EXIT_CODE}; "
             "Slurm has no requeue on an exit code, so the job requeues itself and resumes.",
             f'if [ "$code" -eq {PREEMPT_EXIT_CODE} ]; then',
             '    echo "hypertron: stopped by SIGTERM (exit ' + str(PREEMPT_EXIT_CODE) + '): requeueing job $SLURM_JOB_ID"',
             '    scontrol requeue "$SLURM_JOB_ID"',
             "fi",
             'exit "$code"', ""]
    return "\n".join(lines)


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise UserError(f"{name} is not on PATH: run this on a Slurm login node (or install Slurm's client commands)")
    return path


def _run(cmd: list[str], what: str) -> str:
    r = subprocess.run([_tool(cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        message = " ".join(r.stderr.split()).removeprefix(f"{cmd[0]}: error: ") or f"exit {r.returncode}"
        raise UserError(f"{what}: {cmd[0]} said: {message}")
    return r.stdout


def submit(job: Job) -> tuple[str, Path]:
    """Write the recipe and the script into the run directory, then ``sbatch`` it; (job id, script)."""
    check(job)
    _tool("sbatch")  # before anything is written
    run = job.run_dir
    run.mkdir(parents=True, exist_ok=True)
    (run / "recipe.yaml").write_text(job.recipe.run_config(str(run), "hypertron workload create --scheduler slurm"))
    path = run / "sbatch.sh"
    path.write_text(script(job))
    out = _run(["sbatch", "--parsable", str(path)], f"sbatch refused job {job.name}")
    return out.strip().split(";")[0], path


def jobs(name: str | None = None) -> list[dict]:
    """hypertron's jobs that Slurm knows (pending, running, or ended within MinJobAge)."""
    fields = ("id", "name", "state", "nodes", "time", "reason", "comment", "workdir")
    out = _run(["squeue", "--noheader", "--states=all", "--format=%i|%j|%T|%D|%M|%r|%k|%Z",
                *([f"--name={name}"] if name else [])], "squeue")
    rows = [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line.strip()]
    return [r for r in rows if r.get("comment") == COMMENT]


def describe(name: str) -> str:
    found = jobs(name)
    if not found:
        raise UserError(f"no Slurm job named {name!r} (squeue knows jobs until MinJobAge after they end)")
    return "\n".join(_run(["scontrol", "show", "job", j["id"]], "scontrol") for j in found)


def logs(name: str, storage: str) -> str:
    """The newest ``slurm-<jobid>.out`` of the run directory ``<storage>/<name>``."""
    run = Path(storage).absolute() / name
    outs = sorted(run.glob("slurm-*.out"), key=os.path.getmtime)
    if not outs:
        raise UserError(f"no job output in {run} (give --storage as at create)")
    return outs[-1].read_text()


def cancel(name: str) -> list[str]:
    """``scancel`` every running or pending job of that name: SIGTERM to its steps (the run saves
    and stops) and to the script, then SIGKILL after Slurm's KillWait."""
    live = [j["id"] for j in jobs(name) if j["state"] in ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED",
                                                           "SUSPENDED", "COMPLETING")]
    if not live:
        raise UserError(f"no pending or running Slurm job named {name!r}")
    _run(["scancel", *live], "scancel")
    return live
