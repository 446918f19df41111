"""Every command's flags, as a recording: the whole argparse tree of ``hypertron.cli.build_parser()``
(each command and subcommand; each option's flags, dest, default, choices, nargs, required, type,
action, const, metavar and help) equals ``tests/golden/cli_flags.json``. A change to any flag shows
there as a diff to read: ``HYPERTRON_UPDATE_GOLDEN=1 pytest tests/test_cli_flags.py`` rewrites it.

Also: a settings dataclass's fields become flags of their defaults, types and choices (``bench
serve`` and ``monitor`` have exactly their dataclass's); no command module imports a sibling's
private name. Building the parser imports no JAX, so this runs in well under a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Literal

from hypertron.config import flag_field
from support import processes  # tests/support

GOLDEN = Path(__file__).parent / "golden" / "cli_flags.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Knobs:
    """A settings dataclass of each kind of field."""

    max_rows: int | None = flag_field(None, "rows, at most", "N")
    mode: Literal["fast", "exact"] = "exact"
    verbose: bool = False
    scale: float = 1.5


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
    r = processes.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.strip() == "[]", r.stdout


def _command(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def test_the_flags_of_a_settings_dataclass_are_its_fields(monkeypatch):
    """A field becomes ``--field-name`` with the field's default, its type (``X | None`` as ``X``),
    a ``Literal``'s choices, a ``bool`` as a switch, help and metavar from ``flag_field``; ``bench
    serve`` and ``monitor`` have exactly their dataclass's fields (serve: tests/test_config.py)."""
    from hypertron.cli import build_parser
    from hypertron.cli.flags import Parser, add_dataclass_flags
    from hypertron.loadgen import BenchSettings
    from hypertron.monitor.settings import ReportSettings

    p = Parser(prog="t")
    add_dataclass_flags(p, Knobs)
    assert vars(p.parse_args([])) == {"max_rows": None, "mode": "exact", "verbose": False, "scale": 1.5}
    got = p.parse_args(["--max-rows", "3", "--mode", "fast", "--verbose", "--scale", "2"])
    assert vars(got) == {"max_rows": 3, "mode": "fast", "verbose": True, "scale": 2.0}
    (rows,) = [a for a in p._actions if a.dest == "max_rows"]
    assert (rows.help, rows.metavar) == ("rows, at most", "N")
    given = Parser(prog="t")
    add_dataclass_flags(given, Knobs, {"scale": dict(help="how much")}, given_only=True, show_default=True)
    assert vars(given.parse_args(["--verbose"])) == {"verbose": True}
    assert [a.help for a in given._actions if a.dest == "scale"] == ["how much (default 1.5)"]

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # else --api-key's default is the environment's
    parser = build_parser()
    for names, settings in ((("bench", "serve"), BenchSettings), (("monitor",), ReportSettings)):
        flags = {a.dest: a.default for a in _command(parser, *names)._actions}
        fields = {f.name: f.default for f in dataclasses.fields(settings)}
        assert {k: flags[k] for k in fields} == fields, names


def test_no_command_module_imports_a_sibling_s_private_name():
    import ast

    cli = Path(__file__).parent.parent / "hypertron" / "cli"
    private = [(path.name, node.module, alias.name) for path in sorted(cli.glob("*.py"))
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
               and (node.module or "").startswith("hypertron.cli") for alias in node.names
               if alias.name.startswith("_")]
    assert not private, private
