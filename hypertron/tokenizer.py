"""Tokenisers: text <-> token ids, chosen by the ``data.tokenizer`` string.

* ``"byte"``: written by hand because it is four lines of arithmetic: every
  UTF-8 byte ``b`` is token ``b + 3``, after three special tokens. It needs no
  vocabulary file, so every machine can train and test without a download.
* a path to a Hugging Face ``tokenizer.json``, or to a directory holding one
  (a model directory), read with the ``tokenizers`` library;
* a path to a SentencePiece ``.model`` (or a directory holding only a
  ``tokenizer.model``, as Llama 2 ships), read with ``sentencepiece``.

Nothing is ever downloaded: a name that is neither ``"byte"`` nor an existing
path is an error. ``encode`` never adds the tokenizer's own special tokens;
the pipeline adds ``bos`` / ``eos`` around each document itself, so that every
tokenizer frames documents the same way.

Special ids of a ``tokenizer.json`` are not in the file in a standard form, so
they are looked up in this order: ``bos_token`` / ``eos_token`` /
``pad_token`` of a sibling ``tokenizer_config.json`` (else
``special_tokens_map.json``), where a key that is present but null means "this
tokenizer has none"; for a key absent there, the first well-known token name
in the vocabulary (:data:`_BOS_NAMES`, ...). SentencePiece models carry their
own ids (-1 = none). A tokenizer may lack bos or eos (then ``bos_id`` or
``eos_id`` is None and documents are framed by the other alone) but not both.
Without a pad token, ``pad_id`` is eos (else bos): padding carries no loss, so
any id would do.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from hypertron.data.sources import DataError, one_line

_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_EXPECTED = "expected 'byte', a tokenizer.json, a directory holding one, or a SentencePiece .model"


class Tokenizer(Protocol):
    """What the pipeline needs from a tokenizer; ``bos_id`` or ``eos_id`` may be None, not both."""

    name: str
    bos_id: int | None
    eos_id: int | None
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def encode_array(self, text: str) -> np.ndarray: ...
    def decode(self, ids: Iterable[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..2 are pad, bos, eos; byte ``b`` is id ``b + 3``."""

    name = "byte"
    pad_id = 0
    bos_id = 1
    eos_id = 2
    vocab_size = 259  # 3 special ids + 256 byte values
    _BYTE_OFFSET = 3

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (UTF-8 bytes shifted by 3); no bos/eos are added.

        Returns a list of length ``len(text.encode("utf-8"))``.
        """
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode`, as an int32 array of shape [num_bytes].

        The pipeline uses this form: a 1 MB source file becomes one numpy
        operation instead of a million Python ints.
        """
        raw_bytes = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return raw_bytes.astype(np.int32) + self._BYTE_OFFSET

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of token ids ``ids`` (any 1-D sequence or array).

        Special ids (pad, bos, eos) and ids >= ``vocab_size`` are dropped;
        byte sequences that are not valid UTF-8 decode to U+FFFD.
        """
        ids_n = _as_ids(ids)
        byte_ids = ids_n[(ids_n >= self._BYTE_OFFSET) & (ids_n < self.vocab_size)]
        return (byte_ids - self._BYTE_OFFSET).astype(np.uint8).tobytes().decode(
            "utf-8", errors="replace"
        )


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (any model: BPE, Unigram, WordPiece) via ``tokenizers``."""

    def __init__(self, name: str, path: str):
        from tokenizers import Tokenizer as _HFTokenizer

        self.name, self.path = name, path
        try:
            self._tokenizer = _HFTokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception for a bad file
            raise DataError(f"data.tokenizer: cannot read {path} ({one_line(e)})") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        config = _special_token_config(os.path.dirname(path))
        self.bos_id = self._special_id(config, "bos_token", _BOS_NAMES)
        self.eos_id = self._special_id(config, "eos_token", _EOS_NAMES)
        pad_id = self._special_id(config, "pad_token", _PAD_NAMES)
        _check_separators(self)
        self.pad_id = _first_not_none(pad_id, self.eos_id, self.bos_id)

    def _special_id(self, config: dict, key: str, names: tuple[str, ...]) -> int | None:
        if key in config:  # present in the config, even as null: it is the authority
            token = config[key]
            if isinstance(token, dict):  # a serialised AddedToken
                token = token.get("content")
            if token is None:
                return None
            token_id = self._tokenizer.token_to_id(token)
            if token_id is None:
                raise DataError(f"data.tokenizer: {key} {token!r} of {self.path} is not in its vocabulary")
            return token_id
        return next((i for i in map(self._tokenizer.token_to_id, names) if i is not None), None)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without the tokenizer's own special tokens; a list."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode`, as an int32 array of shape [num_tokens]."""
        return np.asarray(self.encode(text), dtype=np.int32)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of ``ids``; special tokens and ids outside the vocabulary are dropped."""
        kept = _without_special(self, _as_ids(ids))
        return self._tokenizer.decode(kept.tolist(), skip_special_tokens=True)


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` (Llama 2, Gemma, T5 ...) via ``sentencepiece``."""

    def __init__(self, name: str, path: str):
        import sentencepiece

        self.name, self.path = name, path
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"data.tokenizer: cannot read {path} ({one_line(e)})") from None
        self.vocab_size = self._processor.get_piece_size()
        # SentencePiece says -1 for a special token the model was trained without.
        self.bos_id, self.eos_id, pad_id = (
            i if i >= 0 else None
            for i in (self._processor.bos_id(), self._processor.eos_id(), self._processor.pad_id())
        )
        _check_separators(self)
        self.pad_id = _first_not_none(pad_id, self.eos_id, self.bos_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without bos/eos (SentencePiece's default); a list."""
        return self._processor.encode(text, out_type=int)

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode`, as an int32 array of shape [num_tokens]."""
        return np.asarray(self.encode(text), dtype=np.int32)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of ``ids``; special tokens and ids outside the vocabulary are dropped."""
        return self._processor.decode(_without_special(self, _as_ids(ids)).tolist())


_BYTE = ByteTokenizer()


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer named by ``data.tokenizer``: ``"byte"`` or a path (see the module docstring).

    Loaded tokenizers are cached by absolute path (and the size and
    modification time of the file and its config files, so an edited file is
    read again). Raises :class:`DataError` naming ``data.tokenizer`` and the
    path for a missing, unrecognised or unreadable file.
    """
    if name == "byte":
        return _BYTE
    kind, path = tokenizer_file(name)
    files = [path]
    if kind == "hf":  # its special ids come from the config files beside it
        files += [os.path.join(os.path.dirname(path), f) for f in _CONFIG_FILES]
    versions = tuple((os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files if os.path.isfile(f))
    return _load(kind, name, path, versions)


def tokenizer_file(name: str) -> tuple[str, str]:
    """(kind, absolute path) of the file behind a tokenizer path: kind is "hf" or "sentencepiece"."""
    # Not realpath: in a Hugging Face cache, tokenizer.json links to a blob
    # directory, and its tokenizer_config.json is only beside the link.
    path = os.path.abspath(os.path.expanduser(name))
    if not os.path.exists(path):
        raise DataError(f"data.tokenizer: {name} does not exist ({_EXPECTED})")
    if os.path.isdir(path):
        for file_name, kind in (("tokenizer.json", "hf"), ("tokenizer.model", "sentencepiece")):
            if os.path.isfile(os.path.join(path, file_name)):
                return kind, os.path.join(path, file_name)
        raise DataError(f"data.tokenizer: {name} is a directory without tokenizer.json or tokenizer.model")
    if path.endswith(".json"):
        return "hf", path
    if path.endswith(".model"):
        return "sentencepiece", path
    raise DataError(f"data.tokenizer: {name} is not a .json or .model file ({_EXPECTED})")


def tokenizer_identity(name: str) -> dict:
    """What identifies a tokenizer's ids: ``{"name", "kind", "path", "sha256"}``.

    ``path`` is the absolute path of the file and ``sha256`` its hash (both
    None for byte). Two tokenizers with the same kind and hash give the same
    ids wherever their files lie; ``hypertron tokenize`` records this next to
    its output.
    """
    if name == "byte":
        return {"name": name, "kind": "byte", "path": None, "sha256": None}
    kind, path = tokenizer_file(name)
    return {"name": name, "kind": kind, "path": path, "sha256": _file_sha256(path)}


@functools.lru_cache(maxsize=16)
def _load(kind: str, name: str, path: str, versions: tuple) -> Tokenizer:
    del versions  # only part of the cache key
    return HFTokenizer(name, path) if kind == "hf" else SentencePieceTokenizer(name, path)


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _special_token_config(directory: str) -> dict:
    """bos/eos/pad token entries of the first tokenizer config file beside a tokenizer.json."""
    for file_name in _CONFIG_FILES:
        path = os.path.join(directory, file_name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise DataError(f"data.tokenizer: cannot read {path} ({one_line(e)})") from None
            if isinstance(config, dict):
                return {k: config[k] for k in ("bos_token", "eos_token", "pad_token") if k in config}
    return {}


def _check_separators(tokenizer: Tokenizer) -> None:
    if tokenizer.bos_id is None and tokenizer.eos_id is None:
        raise DataError(
            f"data.tokenizer: {tokenizer.name} has neither a bos nor an eos token to separate documents"
        )


def _first_not_none(*values: int | None) -> int:
    return next(v for v in values if v is not None)


def _as_ids(ids: Iterable[int] | np.ndarray) -> np.ndarray:
    """Any 1-D sequence of ids as an int64 array of shape [n]."""
    return np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64).reshape(-1)


def _without_special(tokenizer: Tokenizer, ids_n: np.ndarray) -> np.ndarray:
    """``ids_n`` without bos / eos / pad and ids outside ``[0, vocab_size)``, as the byte tokenizer does."""
    special = [i for i in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) if i is not None]
    keep = (ids_n >= 0) & (ids_n < tokenizer.vocab_size) & ~np.isin(ids_n, special)
    return ids_n[keep]
