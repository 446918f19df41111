"""Starting processes, for the tests whose subject is a process: signals, several processes, exit
codes, one end-to-end run. Everything else runs the command in process (:mod:`support.cli`).

Children inherit the suite's environment (8 simulated CPU devices, the session's JAX compilation
cache: tests/conftest.py) unless a test drops or sets variables.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

DEVNULL, PIPE, STDOUT = subprocess.DEVNULL, subprocess.PIPE, subprocess.STDOUT

TIMEOUT_S = 300.0

# XLA's CPU backend without LLVM's optimisations, for processes whose subject is the process (several
# processes, a scheduler's job, the campaign's smoke rows) and whose time goes to compiling tiny
# programs: 2026-11-26, 2 cores under load, the T2 smoke took 57 s of CPU with it, 105 s without.
# Steps run 2-4x slower, so not where the steps are the work (test_resume.py's 32 x 128 batches: 5-10 s
# a step with it). Results change in the last bits (a loss of 4.8238993 becomes 4.8238988): a test
# that compares such a process bit for bit compares it with another that has the flag.
FAST_COMPILE = "--xla_backend_optimization_level=0"
# XLA's CPU compiler made cheaper for the suite's tiny programs: its LLVM IR emitters instead of its
# MLIR fusion emitters (a third of the compile time), and each module compiled in one piece rather
# than split for parallel codegen (whose threads cost ~15 % more CPU, and 2 busy cores gain no wall
# time from them). tests/conftest.py sets them for the whole suite; FAST_COMPILE's processes, which
# may start from an environment without the suite's XLA_FLAGS, get them too.
SUITE_CPU_FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
FAST_COMPILE += " " + SUITE_CPU_FLAGS


def fast_compile(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`FAST_COMPILE` added to its ``XLA_FLAGS``."""
    return {**env, "XLA_FLAGS": " ".join(f for f in (env.get("XLA_FLAGS", ""), FAST_COMPILE) if f)}


def hypertron_argv(*args: object) -> list[str]:
    """The ``hypertron`` command as this interpreter runs it."""
    return [sys.executable, "-m", "hypertron.cli", *map(str, args)]


def hypertron_env(drop: Iterable[str] = (), **set_: str) -> dict[str, str]:
    """The suite's environment on CPU, without the variables starting with any of ``drop``, plus ``set_``."""
    prefixes = tuple(drop)
    env = {k: v for k, v in os.environ.items() if not (prefixes and k.startswith(prefixes))}
    if "XLA_FLAGS" not in set_ and not any("XLA_FLAGS".startswith(p) for p in prefixes):
        env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(set_)
    return env


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` with the suite's defaults: the suite's environment, no stdin, text output
    captured, a timeout (each overridable)."""
    kwargs.setdefault("env", hypertron_env())
    if "input" not in kwargs:
        kwargs.setdefault("stdin", subprocess.DEVNULL)
    if "stdout" not in kwargs and "stderr" not in kwargs:
        kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", TIMEOUT_S)
    return subprocess.run(argv, **kwargs)


def run_hypertron(*args: object, **kwargs) -> subprocess.CompletedProcess:
    return run(hypertron_argv(*args), **kwargs)


def start(argv: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` with the suite's defaults: the suite's environment, no stdin, stdout
    dropped, stderr kept as text for a failure message (each overridable)."""
    kwargs.setdefault("env", hypertron_env())
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    kwargs.setdefault("stdout", subprocess.DEVNULL)
    kwargs.setdefault("stderr", subprocess.PIPE)
    if kwargs["stderr"] is subprocess.PIPE or kwargs["stdout"] is subprocess.PIPE:
        kwargs.setdefault("text", True)
    return subprocess.Popen(argv, **kwargs)


def start_hypertron(*args: object, **kwargs) -> subprocess.Popen:
    return start(hypertron_argv(*args), **kwargs)


def wait_for(predicate: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 180.0,
             poll_s: float = 0.01) -> None:
    """Until ``predicate()``; a process that ends first, or a timeout (which kills it), fails the test
    with its stderr."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the process ended (exit {proc.returncode}) before {what}:\n"
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def kill(*procs: subprocess.Popen) -> None:
    """SIGKILL whatever still runs, and reap it."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
