"""``hypertron tokenize``: a corpus tokenised once, read back as ``data.source=tokens``.

Tokenising on the fly costs CPU in every epoch of every run, and subword
tokenisers are far slower than the byte one. A pre-tokenised corpus is read
with no tokeniser at all, and one document is one small read whatever the
original format was (a shuffled parquet corpus reads whole row groups).

The output is a directory holding

* ``tokens-00000.array_record``, ``tokens-00001.array_record``, ...: one
  record per document, in the source's document order (a new file every
  :data:`_SHARD_TOKENS` tokens). A record is the document's ids as
  little-endian int32, ``np.frombuffer(record, "<i4")``, without bos/eos: the
  pipeline adds those as it does for text, so the batches are the same as when
  tokenising on the fly.
* ``hypertron_tokens.json`` (:data:`METADATA_FILE`): format name and version,
  the shard names, document and token counts, the source it was made from,
  and the tokenizer's identity: the ``data.tokenizer`` string, its kind and
  the sha256 of its file.

Why ArrayRecord and not a flat ``.npy`` of ids plus an offsets ``.npy``: Grain
reads it natively with thread-safe random access (``ArrayRecordDataSource``),
``array_record`` is already a dependency of Grain on every platform Grain has
wheels for but Windows, and records can be compressed. They are written with
``group_size:1`` so each record is read alone, and zstd level 1: ids below
2**16 leave two zero bytes in four, and about a third of the size goes for a
small cost in reading. A memory-mapped ``.npy`` would be zero-copy but four
bytes a token, and would need its offsets rewritten to grow.

The format itself (file names, metadata, the tokenizer check on reading) is in
:mod:`hypertron.data.token_corpus`, which the ``tokens`` source reads with.

Writing is atomic: everything goes to a hidden temporary sibling directory,
renamed to ``--out`` only when complete. An existing non-empty ``--out`` is
refused, so nothing is ever overwritten, and a failed run leaves nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable

import grain

from hypertron.config import TOKENIZABLE_SOURCES
from hypertron.data.sources import SOURCES, check_source, load_documents
from hypertron.data.token_corpus import FORMAT, METADATA_FILE, VERSION
from hypertron.errors import DataError, one_line
from hypertron.tokenizer import Tokenizer, get_tokenizer, tokenizer_identity
_SHARD_TOKENS = 1 << 28  # 1 GiB of int32 before compression
_WRITER_OPTIONS = "group_size:1,zstd:1"
# Threads that read and encode documents ahead of the writer, in order.
_READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=64)


def tokenize_corpus(*, source: str, paths: tuple[str, ...] = (), text_field: str = "text",
                    tokenizer: str, out: str, log: Callable[[str], None] | None = None) -> dict:
    """Tokenise every document of a source into the directory ``out``; returns the metadata written.

    ``source`` / ``paths`` / ``text_field`` / ``tokenizer`` mean what the
    ``data.*`` keys of the same names mean. ``log`` gets a line per finished
    shard. Raises :class:`DataError` for bad input or an ``out`` that exists
    and is not empty; on any failure nothing is left at ``out``.
    """
    if source in SOURCES and source not in TOKENIZABLE_SOURCES:
        raise DataError(f"data.source: {source!r} cannot be tokenised (it is already token ids)")
    _check_out(out)
    check_source(source, paths, text_field)
    text_tokenizer = get_tokenizer(tokenizer)
    identity = tokenizer_identity(tokenizer)
    documents = load_documents(source, paths, text_field)

    parent, name = os.path.split(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    # Beside out, so the final rename stays on one filesystem; os.mkdir (not
    # tempfile.mkdtemp, which makes it private) gives the usual permissions.
    tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp)
    try:
        shards, num_tokens = _write_shards(documents, text_tokenizer, tmp, log or (lambda _: None))
        metadata = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": "<i4",
            "shards": shards,
            "num_documents": len(documents),
            "num_tokens": num_tokens,
            "source": {"source": source, "paths": [os.path.abspath(p) for p in paths],
                       "text_field": text_field},
            "tokenizer": {**identity, "vocab_size": text_tokenizer.vocab_size,
                          "bos_id": text_tokenizer.bos_id, "eos_id": text_tokenizer.eos_id},
        }
        with open(os.path.join(tmp, METADATA_FILE), "w", encoding="utf-8") as f:
            json.dump(metadata, f, indent=2)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return metadata


def _check_out(out: str) -> None:
    if os.path.isdir(out):
        if os.listdir(out):
            raise DataError(f"--out: {out} exists and is not empty; nothing was written")
    elif os.path.exists(out):
        raise DataError(f"--out: {out} exists and is not a directory; nothing was written")


def _write_shards(documents: grain.MapDataset, tokenizer: Tokenizer, directory: str,
                  log: Callable[[str], None]) -> tuple[list[str], int]:
    """Write the documents' ids to ArrayRecord shards in ``directory``; returns (shard names, tokens)."""
    shards, writer, shard_tokens, num_tokens = [], None, 0, 0
    encoded = documents.map(tokenizer.encode_array).to_iter_dataset(_READ_OPTIONS)
    try:
        for ids in encoded:
            if writer is None:
                shards.append(f"tokens-{len(shards):05d}.array_record")
                writer = _Shard(os.path.join(directory, shards[-1]))
            writer.write(ids.astype("<i4", copy=False).tobytes())
            shard_tokens += len(ids)
            if shard_tokens >= _SHARD_TOKENS:
                writer.close()
                writer, num_tokens, shard_tokens = None, num_tokens + shard_tokens, 0
                log(f"tokenize: {shards[-1]} written ({num_tokens} tokens so far)")
    finally:
        if writer is not None:
            writer.close()
    return shards, num_tokens + shard_tokens


class _Shard:
    """An ArrayRecord writer that raises instead of only setting ``ok()`` to False."""

    def __init__(self, path: str):
        from array_record.python.array_record_module import ArrayRecordWriter

        self._path = path
        self._writer = ArrayRecordWriter(path, _WRITER_OPTIONS)
        if not self._writer.ok():
            raise DataError(f"--out: cannot write {path}")

    def write(self, record: bytes) -> None:
        self._writer.write(record)

    def close(self) -> None:
        ok = self._writer.ok()
        self._writer.close()
        if not ok:
            raise DataError(f"--out: writing {self._path} failed")


def _publish(tmp: str, out: str) -> None:
    """Rename the finished ``tmp`` to ``out``; an empty ``out`` directory is replaced."""
    for name in os.listdir(tmp):  # on disk before the rename makes them visible
        with open(os.path.join(tmp, name), "rb") as f:
            os.fsync(f.fileno())
    try:
        os.rename(tmp, out)
    except OSError as e:  # e.g. another process filled out meanwhile
        raise DataError(f"--out: cannot move the output to {out} ({one_line(e)}); "
                        "nothing was written") from None


