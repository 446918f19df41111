"""The pre-tokenised corpus format that ``hypertron tokenize`` writes and ``data.source=tokens`` reads.

A corpus is a directory holding

* ``tokens-00000.array_record``, ``tokens-00001.array_record``, ...: one
  record per document, in the source's document order. A record is the
  document's ids as little-endian int32, ``np.frombuffer(record, "<i4")``,
  without bos/eos (the pipeline adds those as it does for text).
* ``hypertron_tokens.json`` (:data:`METADATA_FILE`): format name and
  version, the shard names, document and token counts, the source it was
  made from, and the tokenizer's identity (the ``data.tokenizer`` string, its
  kind and the sha256 of its file).

The format lives in its own module because both sides use it: the writer
(:mod:`hypertron.data.pretokenize`) and the reader among the sources
(:mod:`hypertron.data.sources`). The reader refuses a ``data.tokenizer`` whose
kind or file hash differs from the recorded one; the path may differ, so a
corpus copied to another machine with its tokenizer still matches.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hypertron.config.loading import read_manifest
from hypertron.data.files import array_record_source, describe_paths
from hypertron.errors import DataError
from hypertron.tokenizer import tokenizer_identity

METADATA_FILE = "hypertron_tokens.json"
FORMAT = "hypertron-tokens"
VERSION = 1


def read_metadata(path: str) -> dict:
    """The metadata of a ``hypertron tokenize`` output directory; :class:`DataError` if it is not one."""
    metadata_path = os.path.join(path, METADATA_FILE)
    return read_manifest(
        Path(metadata_path), DataError, (FORMAT, VERSION),
        missing=f"data.paths: {path} is not a hypertron tokenize output (no {METADATA_FILE})",
        unreadable=lambda reason: f"data.paths: cannot read {metadata_path} ({reason})",
        wrong_format=f"data.paths: {metadata_path} is not {FORMAT} metadata",
        wrong_version=lambda found: f"data.paths: {path} has format version {found}; "
                                    f"this hypertron reads version {VERSION}",
    )


def token_documents(paths: Sequence[str], tokenizer: str | None) -> Sequence[np.ndarray]:
    """The documents of ``hypertron tokenize`` outputs, in path order: int32 arrays of shape [num_tokens].

    With ``tokenizer`` (the ``data.tokenizer`` string), every output must have
    been made with that tokenizer; without it, the outputs must at least agree
    with each other. Raises :class:`DataError` otherwise, or for missing shards.
    """
    files, num_documents, first = [], 0, None
    for path in paths:
        metadata = read_metadata(path)
        recorded = metadata["tokenizer"]
        if tokenizer is not None:
            _check_tokenizer(path, recorded, tokenizer_identity(tokenizer), tokenizer)
        elif first is not None:
            _check_tokenizer(path, recorded, first, first["name"])
        first = first or recorded
        for shard in metadata["shards"]:
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise DataError(f"data.paths: {path} is incomplete: {shard} is missing")
            files.append(shard_path)
        num_documents += metadata["num_documents"]
    records = array_record_source(files) if files else []
    if len(records) != num_documents:
        raise DataError(f"data.paths: {describe_paths(paths)} hold {len(records)} records, "
                        f"but the metadata counts {num_documents} documents")
    return _TokenDocuments(records)


class _TokenDocuments(Sequence):
    """ArrayRecord records of little-endian int32 ids, as arrays of shape [num_tokens]."""

    def __init__(self, records: Sequence[bytes]):
        self._records = records

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> np.ndarray:
        return np.frombuffer(self._records[index], dtype="<i4")


def _check_tokenizer(path: str, recorded: dict, current: dict, name: str) -> None:
    if (recorded.get("kind"), recorded.get("sha256")) != (current["kind"], current["sha256"]):
        raise DataError(
            f"data.tokenizer: {path} was tokenised with {recorded.get('name')} "
            f"({_fingerprint(recorded)}), not {name} ({_fingerprint(current)})"
        )


def _fingerprint(identity: dict) -> str:
    sha = identity.get("sha256")
    return identity.get("kind", "?") + (f", sha256 {sha[:12]}" if sha else "")
