"""A benchmark's table on the console: fixed-width columns, each a title and a format spec stated
once, so that a header and its rows cannot drift apart."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

_ALIGN_WIDTH = re.compile(r"[<>^]?\d*")


def cell(value, spec: str) -> str:
    """``value`` formatted by ``spec`` (``">9.1f"``); a string (a title, ``"n/a"``, ``""``) by the
    spec's alignment and width only."""
    if isinstance(value, str):
        spec = _ALIGN_WIDTH.match(spec).group()
    return format(value, spec)


def print_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence]) -> None:
    """Print a line of the ``columns``' titles, then a line per row of ``rows``: ``columns`` are
    ``(title, format spec)`` pairs such as ``("ms/step", ">9.1f")``, a row one value per column."""
    print(" ".join(cell(title, spec) for title, spec in columns))
    for row in rows:
        print(" ".join(cell(value, spec) for value, (_, spec) in zip(row, columns, strict=True)))
