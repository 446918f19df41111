"""A corpus's files: finding them, naming them in messages, reading ArrayRecord files.

Shared by the text sources (:mod:`hypertron.data.sources`) and the pre-tokenised
corpus format (:mod:`hypertron.data.token_corpus`), which both read ArrayRecord
files and both name paths in their errors.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Sequence

import grain

from hypertron.errors import DataError, one_line

# Third-party packages installed into the interpreter are not the standard library.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_paths() -> list[str]:
    """Sorted paths of the ``.py`` files of the Python standard library (no site-packages)."""
    return files_under(sysconfig.get_paths()["stdlib"], (".py",))


def check_paths(source: str, paths: Sequence[str]) -> None:
    if not paths:
        raise DataError(f"data.paths: data.source={source} needs at least one path")
    for path in paths:
        if not os.path.exists(path):
            raise DataError(f"data.paths: {path} does not exist")


def files_under(root: str, suffixes: tuple[str, ...]) -> list[str]:
    """Sorted files below ``root`` whose names end in one of ``suffixes``."""
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS)
        found.extend(os.path.join(directory, name) for name in names if name.endswith(suffixes))
    return sorted(os.path.abspath(path) for path in found)


def describe_paths(paths: Iterable[str], source: str = "") -> str:
    """The first few of ``paths`` for a message (the stdlib directory for ``source="stdlib"``)."""
    if source == "stdlib":
        return sysconfig.get_paths()["stdlib"]
    paths = list(paths)
    shown = ", ".join(paths[:3])
    return shown + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def array_record_source(files: Sequence[str]) -> Sequence[bytes]:
    """The records of ArrayRecord files, in order, as Grain's thread-safe random-access source."""
    try:
        return grain.sources.ArrayRecordDataSource(list(files))
    except (RuntimeError, ValueError, ImportError) as e:
        raise DataError(f"data.paths: cannot read {describe_paths(files)} as ArrayRecord "
                        f"({one_line(e)})") from None
