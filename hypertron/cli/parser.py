"""The ``hypertron`` parser, whose commands register themselves (each ``cli`` module's
``register``), and ``main``, which parses, calls one function and turns a user mistake into one
line and exit code 2."""

from __future__ import annotations

import argparse
import os
import sys

from hypertron.cli import diffusing, launching, monitoring, serving, training
from hypertron.cli.flags import Parser
from hypertron.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    """The root parser and every command's, each added by its module's ``register``."""
    p = Parser(prog="hypertron", description="Train and serve LLMs, and train recommenders, in JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    for module in (training, launching, monitoring, serving, diffusing):
        module.register(sub)
    return p


def _leave_distributed_job(code: int) -> None:
    """In a multi-process job, exit at once: Python's normal exit would wait in JAX's shutdown
    barrier for the other processes (minutes), then abort with a C++ trace."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may come after options (argparse takes a positional list only in one piece)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        _leave_distributed_job(2)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
