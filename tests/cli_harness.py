"""Running ``hypertron`` subprocesses concurrently and checking what they leave on disk.

Shared by tests/test_cli_errors.py: start every command at once (output to
files, so none blocks on a full pipe), collect exit code, output and each
child's own CPU time, and snapshot directories to prove nothing changed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 240.0


@dataclass
class Result:
    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float  # user + sys of the child itself, independent of how many run at once

    def describe(self) -> str:
        return (
            f"argv: {self.argv}\nrc: {self.rc}  wall: {self.wall_s:.1f}s  cpu: {self.cpu_s:.1f}s\n"
            f"--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}"
        )


@dataclass
class Spec:
    args: list[str]  # after "python -m hypertron.cli", or a full argv when raw
    cwd: Path
    log_compiles: bool = True
    raw: bool = False
    nice: int = 0  # >0 lets the subprocesses others wait for go first


def _env(log_compiles: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_LOG_COMPILES", None)
    if log_compiles:
        env["JAX_LOG_COMPILES"] = "1"
    return env


@dataclass
class Batch:
    """Subprocesses started together; :func:`wait_all` collects them."""

    running: dict
    logs: Path


def start_all(specs: dict[str, Spec], logs: Path) -> Batch:
    """Start every spec at once, output to files (so none blocks on a full pipe)."""
    logs.mkdir(parents=True, exist_ok=True)
    running = {}
    for name, spec in specs.items():
        spec.cwd.mkdir(parents=True, exist_ok=True)
        argv = spec.args if spec.raw else [sys.executable, "-m", "hypertron.cli", *spec.args]
        out = open(logs / f"{name}.out", "w")
        err = open(logs / f"{name}.err", "w")
        proc = subprocess.Popen(
            argv, cwd=spec.cwd, env=_env(spec.log_compiles), stdin=subprocess.DEVNULL,
            stdout=out, stderr=err,
        )
        if spec.nice:
            os.setpriority(os.PRIO_PROCESS, proc.pid, spec.nice)
        running[name] = (proc, argv, out, err, time.monotonic())
    return Batch(running, logs)


def wait_all(batch: Batch) -> dict[str, Result]:
    """Wait for a batch; collect exit code, output and each child's own CPU time."""
    results: dict[str, Result] = {}
    running, logs = batch.running, batch.logs
    deadline = time.monotonic() + TIMEOUT_S
    while running:
        for name in list(running):
            proc, argv, out, err, t0 = running[name]
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == 0:
                if time.monotonic() < deadline:
                    continue
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            out.close()
            err.close()
            results[name] = Result(
                argv=argv, rc=proc.returncode,
                stdout=(logs / f"{name}.out").read_text(errors="replace"),
                stderr=(logs / f"{name}.err").read_text(errors="replace"),
                wall_s=time.monotonic() - t0, cpu_s=usage.ru_utime + usage.ru_stime,
            )
            del running[name]
        time.sleep(0.02)
    return results


def run_all(specs: dict[str, Spec], logs: Path) -> dict[str, Result]:
    return wait_all(start_all(specs, logs))


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry below ``root``: directories by name, files by size, mtime and content hash."""
    snap: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            snap[os.path.relpath(os.path.join(dirpath, d), root)] = ("dir",)
        for f in filenames:
            p = os.path.join(dirpath, f)
            st = os.stat(p)
            digest = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            snap[os.path.relpath(p, root)] = ("file", st.st_size, st.st_mtime_ns, digest)
    return snap


def assert_unchanged(root: Path, before: dict[str, tuple], r: Result) -> None:
    after = snapshot(root)
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    assert not (added or removed or changed), (
        f"{root} changed: added {added}, removed {removed}, modified {changed}\n" + r.describe()
    )
