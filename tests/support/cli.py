"""``hypertron ARGS`` in this process: exit code, what it printed, and how many programs JAX lowered.

A user mistake must end before anything is compiled; in process, JAX's monitoring events count
what a subprocess's ``JAX_LOG_COMPILES`` lines showed: every lowering to MLIR (which precedes a
compile, or a load from the persistent cache) is one event.
"""

from __future__ import annotations

import contextlib
import io
import threading
from dataclasses import dataclass
from pathlib import Path

import jax

from hypertron.cli import main

_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lowerings = 0
_lock = threading.Lock()


def _count(event: str, duration: float, **kwargs) -> None:
    global _lowerings
    if event == _LOWERING_EVENT:
        with _lock:
            _lowerings += 1


jax.monitoring.register_event_duration_secs_listener(_count)


@dataclass
class Result:
    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    compiles: int  # programs lowered while the command ran

    def describe(self) -> str:
        return (f"argv: {self.argv}\nrc: {self.rc}  compiles: {self.compiles}\n"
                f"--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}")


def run_cli(argv: list[str], cwd: Path | str | None = None) -> Result:
    """``main(argv)`` with stdout and stderr captured, in ``cwd`` (made if missing) when given."""
    out, err = io.StringIO(), io.StringIO()
    before = _lowerings
    with contextlib.ExitStack() as stack:
        if cwd is not None:
            Path(cwd).mkdir(parents=True, exist_ok=True)
            stack.enter_context(contextlib.chdir(cwd))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's errors and --help
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return Result(list(map(str, argv)), rc, out.getvalue(), err.getvalue(), _lowerings - before)


def one_error_line(r: Result, *needles: str) -> str:
    """The CLI's answer to a user mistake: exit 2, nothing on stdout, exactly one ``error:`` line on
    stderr naming each needle, no traceback, nothing compiled."""
    assert r.rc == 2, r.describe()
    assert "Traceback" not in r.stdout + r.stderr, r.describe()
    assert r.stdout == "", r.describe()
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), "one error: line\n" + r.describe()
    for needle in needles:
        assert needle in lines[0], f"the error should name {needle!r}\n" + r.describe()
    assert r.compiles == 0, "failed only after compiling\n" + r.describe()
    return lines[0]




def cli_output(*argv: object) -> tuple[int, str, str]:
    """:func:`run_cli` as (exit code, stdout, stderr)."""
    r = run_cli(list(argv))
    return r.rc, r.stdout, r.stderr
