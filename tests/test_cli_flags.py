"""Every command's flags, as a recording: the whole argparse tree of ``hypertron.cli.build_parser()``
(each command and subcommand; each option's flags, dest, default, choices, nargs, required, type,
action, const, metavar and help) equals ``tests/golden/cli_flags.json``. A change to any flag shows
there as a diff to read: ``HYPERTRON_UPDATE_GOLDEN=1 pytest tests/test_cli_flags.py`` rewrites it.

Building the parser imports no JAX, so this runs in well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden" / "cli_flags.json"


def _value(v):
    """A default, const or choice as JSON: argparse's SUPPRESS by name, a callable by its name."""
    if v is argparse.SUPPRESS:
        return "==SUPPRESS=="
    if callable(v):
        return getattr(v, "__name__", repr(v))
    if isinstance(v, tuple):
        return list(v)
    return v


def _record(parser: argparse.ArgumentParser) -> dict:
    """One parser's options in order, its mutually exclusive groups and defaults, and its
    subcommands, recursively."""
    options, commands = [], {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                commands[name] = {"help": helps.get(name), **_record(sub)}
            options.append({"subcommands": action.dest, "required": action.required})
            continue
        options.append({
            "flags": list(action.option_strings), "dest": action.dest, "action": type(action).__name__,
            "default": _value(action.default), "const": _value(action.const),
            "choices": None if action.choices is None else [_value(c) for c in action.choices],
            "nargs": action.nargs, "required": action.required,
            "type": None if action.type is None else getattr(action.type, "__name__", repr(action.type)),
            "metavar": _value(action.metavar), "help": action.help,
        })
    groups = [[a.dest for a in g._group_actions] for g in parser._mutually_exclusive_groups]
    return {"prog": parser.prog, "description": parser.description, "options": options,
            "exclusive": groups, "defaults": {k: _value(v) for k, v in sorted(parser._defaults.items())},
            "commands": commands}


def test_every_command_s_flags_equal_the_recording(monkeypatch):
    from hypertron.cli import build_parser

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # bench serve's --api-key default reads it
    text = json.dumps(_record(build_parser()), indent=1, sort_keys=False) + "\n"
    if os.environ.get("HYPERTRON_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "the CLI's flags changed: HYPERTRON_UPDATE_GOLDEN=1 rewrites the recording"


def test_building_the_parser_imports_no_jax():
    code = ("import sys; from hypertron.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('jax', 'numpy', 'httpx') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.strip() == "[]", r.stdout
