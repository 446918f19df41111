"""What the commands' flags share: the parser with the CLI's one-line errors, a command added with
its function, flags made from a settings dataclass, sizes as flag values, ``--json``, and the
``--dry-run`` / ``--output`` pair."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from pathlib import Path

from hypertron.config import choices
from hypertron.config.numbers import INT64, check_number
from hypertron.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's own error shape: one ``error:`` line and exit code 2 (the usage is
    what ``--help`` shows). ``renamed`` maps a flag this command once had to the line that names
    its new spelling; given, that line is the error, before any other check of the command's flags."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.renamed: dict[str, str] = {}

    def parse_known_args(self, args=None, namespace=None):
        # argparse hands a subcommand its own arguments through this method, so a command's renamed
        # flags are looked for among the arguments it was given (up to a "--": what follows is not its)
        given = list(sys.argv[1:] if args is None else args)
        own = given[:given.index("--")] if "--" in given else given
        for name in (a.split("=")[0] for a in own):
            if name in self.renamed:
                self.exit(2, f"error: {self.renamed[name]}\n")
        return super().parse_known_args(given, namespace)

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def add_command(sub: argparse._SubParsersAction, name: str, func: typing.Callable[[argparse.Namespace], int], *,
                help: str) -> Parser:
    """Add the command ``name`` to ``sub``, run by ``func(args)``; its parser, for its flags. ``help``
    is the command's line in the list of commands; its ``--help`` description is ``func``'s docstring
    (white space folded, as argparse prints it), so that what a command does is written once."""
    description = " ".join(func.__doc__.split()) if func.__doc__ else None
    command = sub.add_parser(name, help=help, description=description)
    command.set_defaults(func=func)
    return command


def add_command_group(sub: argparse._SubParsersAction, name: str, *, help: str, dest: str = "action",
                      func: typing.Callable[[argparse.Namespace], int] | None = None) -> argparse._SubParsersAction:
    """Add the command ``name`` to ``sub``, whose own subcommands (one required, its name in
    ``args.<dest>``) are added to what this returns; ``func``, if given, runs each of them."""
    group = sub.add_parser(name, help=help)
    if func is not None:
        group.set_defaults(func=func)
    return group.add_subparsers(dest=dest, required=True)


def flag(key: str) -> str:
    """The flag of a settings key: ``max_slots`` is ``--max-slots``."""
    return "--" + key.replace("_", "-")


def add_dataclass_flags(parser: argparse.ArgumentParser, settings: type, options: dict[str, dict] | None = None,
                        given_only: bool = False, show_default: bool = False) -> None:
    """One flag per field of the dataclass ``settings``, in field order: ``--field-name``, its
    default the field's, its ``choices`` a ``Literal`` type's (or ``Literal | None``'s), its type ``int`` or ``float`` (``X | None``
    as ``X``), a ``bool`` a switch (``--x``; one whose default is True also ``--no-x``). Help, metavar, ``aliases`` and any other ``add_argument`` option
    come from the field's ``metadata`` (:func:`hypertron.config.flag_field` puts them there),
    overridden by ``options[field name]``.

    ``given_only``: a flag not given is left out of the namespace (its default is a file's, or the
    dataclass's later); ``show_default``: the help ends with ``(default X)`` where X is not None."""
    hints = typing.get_type_hints(settings)
    for field in dataclasses.fields(settings):
        tp = hints[field.name]
        kind = next((a for a in typing.get_args(tp) if a is not type(None)), tp)  # int | None -> int
        opts = {**field.metadata, **(options or {}).get(field.name, {})}
        aliases = opts.pop("aliases", ())
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        literal = next((t for t in (tp, kind) if typing.get_origin(t) is typing.Literal), None)  # L, L | None
        if literal is not None:
            opts.setdefault("choices", choices(literal))
        elif kind is bool:
            opts.setdefault("action", argparse.BooleanOptionalAction if default is True else "store_true")
        elif kind in (int, float):
            opts.setdefault("type", number_arg(kind))
        if show_default and default not in (None, ""):
            opts["help"] = (opts.get("help", "") + f" (default {default})").strip()
        opts.setdefault("default", argparse.SUPPRESS if given_only else default)
        parser.add_argument(flag(field.name), *aliases, dest=field.name, **opts)


def number_arg(kind: type = float, *, low: float | None = None, high: float | None = None,
               above: float | None = None) -> typing.Callable[[str], int | float]:
    """A flag's ``type=``: the text as ``kind`` (``int`` or ``float``), finite and in range (see
    :func:`hypertron.config.numbers.check_number`), else argparse's one line naming the flag. Text
    that is no number at all keeps argparse's own words (``invalid int value: 'x'``)."""

    def parse(text: str) -> int | float:
        number, reason = check_number(text, kind, low=low, high=high, above=above)
        if number is None:
            if reason.startswith("expected"):
                raise ValueError(reason)  # argparse: "invalid int value: 'x'"
            raise argparse.ArgumentTypeError(reason)
        return number

    parse.__name__ = kind.__name__
    return parse


def bytes_arg(text: str) -> int:
    """A size typed by a person (``80GB``, ``16GiB``, ``1e9``) in bytes; argparse's error otherwise."""
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6,
             "gb": 1e9, "tb": 1e12}
    number = text.rstrip("bBkKmMgGtTiI ")
    unit = text[len(number):].strip().lower()
    value, reason = check_number(number, float, high=INT64[1] / units.get(unit, 1))
    if unit not in units or reason.startswith("expected"):
        raise argparse.ArgumentTypeError(f"{text!r}: not a size (e.g. 80GB, 16GiB, 1e9)") from None
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r}: {reason}")
    if value * units[unit] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return int(value * units[unit])


def add_json_flag(parser: argparse.ArgumentParser, what: str = "") -> None:
    """``--json``: print ``what`` (the plan, the report; or the command's output) as JSON."""
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON" if what else "print as JSON")


def add_output_flags(parser: argparse.ArgumentParser, verb: str) -> None:
    """``--dry-run`` or ``--output FILE``: show or write the objects a command would ``verb``."""
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--dry-run", action="store_true", help=f"print the objects; {verb} nothing")
    out.add_argument("--output", metavar="FILE", help=f"write the objects to a new FILE; {verb} nothing")


COMPILE_CACHE_OFF = ("none", "off")
COMPILE_CACHE_HELP = ("JAX's persistent compilation cache: a later process loads the programs an earlier one "
                      "compiled (default: $JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/hypertron/jax); none: off")


def default_compile_cache() -> str:
    """The persistent compilation cache's folder without ``--compile-cache``: JAX's own
    ``JAX_COMPILATION_CACHE_DIR`` where it is set, else ``$XDG_CACHE_HOME/hypertron/jax`` (per user)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hypertron" / "jax")


def add_compile_cache(command: argparse.ArgumentParser) -> None:
    """``--compile-cache DIR|none`` on ``command``; :func:`use_compile_cache` applies it."""
    command.add_argument("--compile-cache", default=None, metavar="DIR", help=COMPILE_CACHE_HELP)


def use_compile_cache(value: str | None) -> Path | None:
    """Switch JAX's persistent compilation cache on in ``value``'s folder (None: :func:`default_compile_cache`),
    made if missing, for every program however quick its compile (unless
    ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise), or off for ``none``/``off``. Call
    it before the command's first compile. Returns the folder, or None when off."""
    import jax

    if value is not None and value.lower() in COMPILE_CACHE_OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    folder = Path(value if value is not None else default_compile_cache()).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--compile-cache {folder}: not a directory (a folder, or none to turn the cache off)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--compile-cache {folder}: cannot make the folder ({e.strerror or e})") from None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder


def recipe_config(overrides: list[str]):
    """The config of ``[RECIPE] key=value ...`` (train, plan, diffusion cache)."""
    from hypertron.config import load_config

    overrides = list(overrides)
    recipe = overrides.pop(0) if overrides and "=" not in overrides[0] else None
    return load_config(recipe, overrides)
