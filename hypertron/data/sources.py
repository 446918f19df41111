"""Where training text comes from: corpora as lazy Grain datasets of documents.

A corpus is a list of documents (strings). Sources:

* ``stdlib``: every non-empty ``.py`` file of the Python standard library, one
  document per file. It is already on every machine, so training works with
  no download and no data path.
* ``text``: files given in ``data.paths``, one document per file; directories
  are searched recursively for ``*.txt``, ``*.md`` and ``*.py``.
* ``jsonl``: one JSON object per line, the document is ``obj[text_field]``;
  directories are searched recursively for ``*.jsonl``.

Files are only listed (and, for jsonl, split into line offsets) up front; the
text itself is read lazily when Grain asks for a document, so the first batch
does not wait for the whole corpus. Grain has no source for "a directory of
text files" or "lines of a JSON file", hence the small readers below.
"""

from __future__ import annotations

import itertools
import json
import os
import sysconfig
from collections.abc import Iterable, Sequence

import grain
import numpy as np

from hypertron.errors import UserError

SOURCES = ("stdlib", "synthetic", "text", "jsonl")
_SUFFIXES = {"text": (".txt", ".md", ".py"), "jsonl": (".jsonl",), "stdlib": (".py",)}
# Third-party packages installed into the interpreter are not the standard library.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class DataError(UserError):
    """A user mistake in the data settings; its message is one line naming the key."""


def stdlib_paths() -> list[str]:
    """Sorted paths of the ``.py`` files of the Python standard library (no site-packages)."""
    return _files_under(sysconfig.get_paths()["stdlib"], _SUFFIXES["stdlib"])


def check_source(source: str, paths: tuple[str, ...], text_field: str) -> None:
    """Cheap validation of a data source, meant to run before anything compiles.

    Raises :class:`DataError` for an unknown source, a path that does not
    exist, or an empty corpus (all files empty, a directory without matching
    files, jsonl files without any text). For jsonl it parses lines only until
    the first document is found, so a bad line further on is reported when the
    pipeline reaches it.
    """
    _check_source_name(source)
    if source != "synthetic":
        _checked_files(source, paths, text_field)


def load_documents(source: str, paths: tuple[str, ...], text_field: str) -> grain.MapDataset:
    """The corpus as a lazy Grain ``MapDataset`` of documents (``str``), in a fixed order.

    Element ``i`` is read from disk when it is accessed. Files are sorted by
    path, so the order (and therefore sharding and shuffling downstream) is the
    same on every process and every run. Undecodable bytes become U+FFFD.
    Raises :class:`DataError` as :func:`check_source` does.
    """
    _check_source_name(source)
    if source == "synthetic":
        raise DataError("data.source: 'synthetic' has no documents; it generates token ids directly")
    files = _checked_files(source, paths, text_field)
    if source == "jsonl":
        return grain.MapDataset.source(_JsonlDocuments(files, text_field))
    return grain.MapDataset.source(files).map(_read_text)


def _check_source_name(source: str) -> None:
    if source not in SOURCES:
        raise DataError(f"data.source: unknown source {source!r} (expected one of {', '.join(SOURCES)})")


def _checked_files(source: str, paths: Sequence[str], text_field: str) -> list[str]:
    """The files of a file-based source; raises :class:`DataError` if they hold no document."""
    files = _corpus_files(source, paths)
    if source == "jsonl":
        if not any(_first_jsonl_text(path, text_field) is not None for path in files):
            raise DataError(f"data: the corpus is empty (no {text_field!r} text in {_describe(paths)})")
    elif not files:
        raise DataError(f"data: the corpus is empty (no text in {_describe(paths, source)})")
    return files


def _corpus_files(source: str, paths: Sequence[str]) -> list[str]:
    """Sorted, de-duplicated, non-empty files of a file-based source."""
    if source == "stdlib":
        found = stdlib_paths()
    else:
        if not paths:
            raise DataError(f"data.paths: data.source={source} needs at least one path")
        found = []
        for path in paths:
            if not os.path.exists(path):
                raise DataError(f"data.paths: {path} does not exist")
            if os.path.isdir(path):
                found.extend(_files_under(path, _SUFFIXES[source]))
            else:  # a file named explicitly is taken whatever its suffix
                found.append(os.path.abspath(path))
    # Empty files would only add [bos, eos] documents; stat is cheap next to reading.
    return sorted({path for path in found if os.path.getsize(path) > 0})


def _files_under(root: str, suffixes: tuple[str, ...]) -> list[str]:
    """Sorted files below ``root`` whose names end in one of ``suffixes``."""
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS)
        found.extend(os.path.join(directory, name) for name in names if name.endswith(suffixes))
    return sorted(os.path.abspath(path) for path in found)


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _describe(paths: Iterable[str], source: str = "") -> str:
    if source == "stdlib":
        return sysconfig.get_paths()["stdlib"]
    paths = list(paths)
    shown = ", ".join(paths[:3])
    return shown + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _text_of_line(line: bytes, text_field: str, line_number: int, path: str) -> str:
    """The document in one jsonl line; a malformed line raises :class:`DataError`."""
    where = f"line {line_number} of {os.path.basename(path)}"
    try:
        record = json.loads(line)
    except ValueError:
        raise DataError(f"data.paths: {where} is not valid JSON") from None
    if not isinstance(record, dict) or text_field not in record:
        raise DataError(f"data.text_field: {text_field!r} missing in {where}")
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"data.text_field: {text_field!r} in {where} is not a string")
    return text


def _first_jsonl_text(path: str, text_field: str) -> str | None:
    """The first non-empty document of a jsonl file, or None; checks lines up to it."""
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, 1):
            text = _text_of_line(line, text_field, line_number, path) if line.strip() else ""
            if text:
                return text
    return None


class _JsonlDocuments(Sequence):
    """Random access to the documents of jsonl files, one per non-blank line.

    Only where each line lies is kept in memory (four int64 per line); the line
    is read and parsed when its document is accessed.
    """

    def __init__(self, files: Sequence[str], text_field: str):
        self._files = list(files)
        self._text_field = text_field
        spans = (span for file_id, path in enumerate(self._files) for span in _line_spans(file_id, path))
        # Columns: file id, byte start, byte end, 1-based line number; shape [num_lines, 4].
        # fromiter over a flat stream avoids holding one Python tuple per line.
        flat = np.fromiter(itertools.chain.from_iterable(spans), dtype=np.int64)
        self._spans = flat.reshape(-1, 4)

    def __len__(self) -> int:
        return len(self._spans)

    def __getitem__(self, index: int) -> str:
        file_id, start, end, line_number = (int(v) for v in self._spans[index])
        path = self._files[file_id]
        with open(path, "rb") as f:
            f.seek(start)
            line = f.read(end - start)
        return _text_of_line(line, self._text_field, line_number, path)


def _line_spans(file_id: int, path: str) -> Iterable[tuple[int, int, int, int]]:
    """(file_id, byte start, byte end, line number) of each non-blank line of a file."""
    start = 0
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, 1):
            if line.strip():  # blank lines carry no document
                yield file_id, start, start + len(line), line_number
            start += len(line)
