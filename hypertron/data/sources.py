"""Where training text comes from: corpora as lazy Grain datasets of documents.

A corpus is a list of documents: strings, or already tokenised ids. Sources:

* ``stdlib``: every non-empty ``.py`` file of the Python standard library, one
  document per file. It is already on every machine, so training works with
  no download and no data path.
* ``text``: files given in ``data.paths``, one document per file; directories
  are searched recursively for ``*.txt``, ``*.md`` and ``*.py``.
* ``jsonl``: one JSON object per line, the document is ``obj[text_field]``;
  directories are searched recursively for ``*.jsonl``.
* ``parquet``: one document per row, the string column ``text_field``;
  directories are searched recursively for ``*.parquet``.
* ``hf``: directories written by Hugging Face ``datasets``' ``save_to_disk``
  (one split each), column ``text_field``; needs ``datasets`` installed. Only
  local directories: a hub name would mean a download.
* ``arrayrecord``: ArrayRecord files (``*.array_record``), each record one
  UTF-8 document.
* ``tokens``: directories written by ``hypertron tokenize``; documents are
  int32 id arrays (see :mod:`hypertron.data.token_corpus`).

Files are only listed up front (plus parquet footers, ArrayRecord indices,
jsonl line offsets); a document is read when Grain asks for it, so the first
batch does not wait for the whole corpus. Grain has no source for "a directory
of text files", "lines of a JSON file" or "rows of parquet files", hence the
small readers below.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grain
import numpy as np

from hypertron.config.schema import DataSource, choices
from hypertron.data.files import array_record_source, check_paths, describe_paths, files_under, stdlib_paths
from hypertron.data.token_corpus import METADATA_FILE, token_documents
from hypertron.errors import DataError, one_line

SOURCES = choices(DataSource)
_SUFFIXES = {
    "text": (".txt", ".md", ".py"),
    "jsonl": (".jsonl",),
    "stdlib": (".py",),
    "parquet": (".parquet",),
    "arrayrecord": (".array_record",),
}
# Decoded parquet row groups kept in memory: enough that reading in order, or
# shuffling a corpus of a few hundred MB, reads each row group about once.
_PARQUET_CACHE_BYTES = 256 << 20


def check_source(source: str, paths: tuple[str, ...], text_field: str, *,
                 tokenizer: str | None = None) -> None:
    """Cheap validation of a data source, meant to run before anything compiles.

    Raises :class:`DataError` for an unknown source, a path that does not
    exist, a missing or non-string ``text_field`` column, or an empty corpus
    (all files empty, a directory without matching files, jsonl files without
    any text). It reads metadata only (parquet footers, ArrayRecord indices,
    ``hypertron tokenize`` metadata), and for jsonl parses lines only until the
    first document, so a bad line further on is reported when the pipeline
    reaches it. With ``tokenizer`` (the ``data.tokenizer`` string), a
    ``tokens`` corpus must have been made with that tokenizer.
    """
    _check_source_name(source)
    if source in ("hf", "tokens"):
        _indexed_documents(source, paths, text_field, tokenizer)
    elif source != "synthetic":
        _checked_files(source, paths, text_field)


def load_documents(source: str, paths: tuple[str, ...], text_field: str, *,
                   tokenizer: str | None = None) -> grain.MapDataset:
    """The corpus as a lazy Grain ``MapDataset`` of documents, in a fixed order.

    A document is a ``str``, or for ``source="tokens"`` an int32 array of ids
    of shape [num_tokens] (no bos/eos). Element ``i`` is read from disk when it
    is accessed. Files are sorted by path, so the order (and therefore sharding
    and shuffling downstream) is the same on every process and every run.
    Undecodable bytes become U+FFFD. Raises :class:`DataError` as
    :func:`check_source` does.
    """
    _check_source_name(source)
    if source == "synthetic":
        raise DataError("data.source: 'synthetic' has no documents; it generates token ids directly")
    if source in ("hf", "tokens"):
        return grain.MapDataset.source(_indexed_documents(source, paths, text_field, tokenizer))
    files = _checked_files(source, paths, text_field)
    if source == "jsonl":
        return grain.MapDataset.source(_JsonlDocuments(files, text_field))
    if source == "parquet":
        return grain.MapDataset.source(_ParquetDocuments(files, text_field))
    if source == "arrayrecord":
        return grain.MapDataset.source(array_record_source(files)).map(_decode_utf8)
    return grain.MapDataset.source(files).map(_read_text)


def _check_source_name(source: str) -> None:
    if source not in SOURCES:
        raise DataError(f"data.source: unknown source {source!r} (expected one of {', '.join(SOURCES)})")


def _checked_files(source: str, paths: Sequence[str], text_field: str) -> list[str]:
    """The files of a file-based source; raises :class:`DataError` if they hold no document."""
    files = _corpus_files(source, paths)
    if source == "jsonl":
        if not any(_first_jsonl_text(path, text_field) is not None for path in files):
            raise DataError(f"data: the corpus is empty (no {text_field!r} text in {describe_paths(paths)})")
    elif source == "parquet":
        if not len(_ParquetDocuments(files, text_field)):
            raise DataError(f"data: the corpus is empty (no rows in {describe_paths(paths)})")
    elif not files or (source == "arrayrecord" and not len(array_record_source(files))):
        raise DataError(f"data: the corpus is empty (no text in {describe_paths(paths, source)})")
    return files


def _indexed_documents(source: str, paths: Sequence[str], text_field: str,
                       tokenizer: str | None) -> Sequence:
    """Documents of a source that has its own index (``hf``, ``tokens``), checked non-empty."""
    check_paths(source, paths)
    if source == "tokens":
        documents = token_documents(paths, tokenizer)
    else:
        documents = _hf_documents(paths, text_field)
    if not len(documents):
        raise DataError(f"data: the corpus is empty (no documents in {describe_paths(paths)})")
    return documents


def _corpus_files(source: str, paths: Sequence[str]) -> list[str]:
    """Sorted, de-duplicated, non-empty files of a file-based source."""
    if source == "stdlib":
        found = stdlib_paths()
    else:
        check_paths(source, paths)
        found = []
        for path in paths:
            if os.path.isdir(path):
                found.extend(files_under(path, _SUFFIXES[source]))
            else:  # a file named explicitly is taken whatever its suffix
                found.append(os.path.abspath(path))
        if source == "arrayrecord":
            _refuse_token_records(found)
    # Empty files would only add [bos, eos] documents; stat is cheap next to reading.
    return sorted({path for path in found if os.path.getsize(path) > 0})


def _refuse_token_records(files: Iterable[str]) -> None:
    """Token records are not UTF-8: their reader is the ``tokens`` source, which checks the tokenizer."""
    for directory in sorted({os.path.dirname(path) for path in files}):
        if os.path.isfile(os.path.join(directory, METADATA_FILE)):
            raise DataError(f"data.source: {directory} was written by hypertron tokenize; "
                            "read it with data.source=tokens")


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _decode_utf8(record: bytes) -> str:
    return record.decode("utf-8", errors="replace")


# --- jsonl ---------------------------------------------------------------------


def _text_of_line(line: bytes, text_field: str, line_number: int, path: str) -> str:
    """The document in one jsonl line; a malformed line raises :class:`DataError`."""
    where = f"line {line_number} of {os.path.basename(path)}"
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
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


# --- parquet ---------------------------------------------------------------------


class _ParquetDocuments(Sequence):
    """Random access to a string column of parquet files, read one row group at a time.

    Up front only the footers are read (row counts, schema). A row group's
    column is read when one of its documents is first asked for and kept in a
    cache of :data:`_PARQUET_CACHE_BYTES`, so reading in order reads each row
    group once. Shuffled reading of a corpus much larger than the cache reads
    a whole row group for few documents: pre-tokenise such corpora with
    ``hypertron tokenize``, whose records are read one by one.
    """

    def __init__(self, files: Sequence[str], text_field: str):
        self._files, self._text_field = list(files), text_field
        groups = []  # (file id, row group, first row of the group in its file)
        starts = [0]  # first document of each row group, then the total
        for file_id, path in enumerate(self._files):
            metadata = _parquet_metadata(path, text_field)
            first_row = 0
            for group in range(metadata.num_row_groups):
                num_rows = metadata.row_group(group).num_rows
                groups.append((file_id, group, first_row))
                first_row += num_rows
                starts.append(starts[-1] + num_rows)
        self._groups = np.array(groups, np.int64).reshape(-1, 3)
        self._starts = np.array(starts, np.int64)
        self._cache: collections.OrderedDict = collections.OrderedDict()  # group -> pyarrow array
        self._lock = threading.Lock()  # reader threads share the cache

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> str:
        group = int(np.searchsorted(self._starts, index, side="right")) - 1
        row_in_group = index - int(self._starts[group])
        text = self._column(group)[row_in_group].as_py()
        if not isinstance(text, str):  # null
            file_id, _, first_row = (int(v) for v in self._groups[group])
            where = f"row {first_row + row_in_group} of {os.path.basename(self._files[file_id])}"
            raise DataError(f"data.text_field: {self._text_field!r} is null in {where}")
        return text

    def _column(self, group: int):
        with self._lock:
            if group in self._cache:
                self._cache.move_to_end(group)
                return self._cache[group]
        import pyarrow.parquet as pq

        file_id, row_group, _ = (int(v) for v in self._groups[group])
        table = pq.ParquetFile(self._files[file_id]).read_row_group(row_group, columns=[self._text_field])
        column = table.column(0).combine_chunks()
        with self._lock:  # two threads may read the same group; the second copy replaces the first
            self._cache[group] = column
            while len(self._cache) > 1 and sum(c.nbytes for c in self._cache.values()) > _PARQUET_CACHE_BYTES:
                self._cache.popitem(last=False)
        return column


def _parquet_metadata(path: str, text_field: str):
    """The footer of a parquet file whose ``text_field`` is a string column, else :class:`DataError`."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("data.source: 'parquet' needs pyarrow, which is not installed") from None
    try:
        parquet_file = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"data.paths: cannot read {path} as parquet ({one_line(e)})") from None
    schema = parquet_file.schema_arrow
    if text_field not in schema.names:
        raise DataError(f"data.text_field: {text_field!r} is not a column of {path} "
                        f"(columns: {', '.join(schema.names)})")
    column_type = schema.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)
            or pa.types.is_string_view(column_type)):
        raise DataError(f"data.text_field: {text_field!r} of {path} holds {column_type}, not strings")
    return parquet_file.metadata


# --- ArrayRecord and Hugging Face datasets -----------------------------------------


def read_records(source: str, paths: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """Every record of a ``jsonl``, ``parquet`` or ``hf`` source, whole (all its fields), in file
    order: ``(where, record)``, ``where`` naming the line or row and file for errors (``line 3 of
    chats.jsonl``, ``row 3 of chats.parquet``). Fine-tuning reads its examples so
    (:mod:`hypertron.data.finetune`); pre-training reads one text field lazily
    (:func:`load_documents`). A jsonl line that is not JSON is a :class:`DataError`."""
    if source not in ("jsonl", "parquet", "hf"):
        raise DataError(f"data.source={source}: fine-tuning reads jsonl, parquet or hf records")
    if source == "hf":
        check_paths(source, paths)
        for path in paths:
            for i, row in enumerate(_load_hf(path)):
                yield f"row {i} of {os.path.basename(os.path.normpath(path))}", row
        return
    for path in _corpus_files(source, paths):
        name = os.path.basename(path)
        if source == "parquet":
            import pyarrow.parquet as pq

            i = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    yield f"row {i} of {name}", row
                    i += 1
            continue
        with open(path, "rb") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):
                    raise DataError(f"data.paths: line {line_number} of {name} is not valid JSON") from None
                yield f"line {line_number} of {name}", record


def _load_hf(path: str):
    """The ``datasets.Dataset`` saved at ``path`` (memory-mapped: no row is read); a
    :class:`DataError` without the package, for what is not one, and for a dict of splits."""
    try:
        import datasets
    except ImportError:
        raise DataError("data.source: 'hf' needs the datasets package, which is not installed "
                        "(pip install datasets)") from None
    try:
        dataset = datasets.load_from_disk(path)
    except (OSError, ValueError) as e:
        raise DataError(f"data.paths: {path} is not a saved Hugging Face dataset ({one_line(e)})") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise DataError(f"data.paths: {path} holds the splits {', '.join(dataset)}; give one split's directory")
    return dataset


def _hf_documents(paths: Sequence[str], text_field: str) -> Sequence[str]:
    """The ``text_field`` column of datasets saved with ``save_to_disk``, concatenated in path order."""
    parts = []
    for path in paths:
        dataset = _load_hf(path)
        feature = dataset.features.get(text_field)
        if feature is None:
            raise DataError(f"data.text_field: {text_field!r} is not a column of {path} "
                            f"(columns: {', '.join(dataset.column_names)})")
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise DataError(f"data.text_field: {text_field!r} of {path} holds {feature}, not strings")
        parts.append(dataset.select_columns([text_field]))
    if len(parts) > 1:
        import datasets  # _load_hf found it

        return _HFDocuments(datasets.concatenate_datasets(parts), text_field)
    return _HFDocuments(parts[0], text_field)


class _HFDocuments(Sequence):
    """Random access to one string column of a memory-mapped ``datasets.Dataset``."""

    def __init__(self, dataset, text_field: str):
        self._dataset, self._text_field = dataset, text_field

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> str:
        text = self._dataset[int(index)][self._text_field]
        if not isinstance(text, str):
            raise DataError(f"data.text_field: {self._text_field!r} is null in row {index}")
        return text
