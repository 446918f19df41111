"""Tokenisers: text <-> token ids, for training data and for serving alike.

This module is on the ground floor (it imports only :mod:`hypertron.errors`):
the data pipeline, ``hypertron tokenize`` and the server all use it, and none of
them reaches into a tokenizer's private attributes: :class:`Tokenizer` is what
they get. A tokenizer is named by a string (``data.tokenizer`` in a run):

* ``"byte"``: written by hand because it is four lines of arithmetic: every
  UTF-8 byte ``b`` is token ``b + 3``, after three special tokens. It needs no
  vocabulary file, so every machine can train and test without a download.
* a path to a Hugging Face ``tokenizer.json``, or to a directory holding one
  (a model directory), read with the ``tokenizers`` library;
* a path to a SentencePiece ``.model`` (or a directory holding only a
  ``tokenizer.model``, as Llama 2 ships, or a ``spiece.model``, as T5 ships), read with
  ``sentencepiece``;
* a directory holding a CLIP ``vocab.json`` + ``merges.txt`` and no ``tokenizer.json`` (how
  diffusers folders ship CLIP's tokenizer; its ``tokenizer_config.json`` says ``CLIPTokenizer``):
  the BPE ``CLIPTokenizer`` builds, made here with ``tokenizers`` (:func:`clip_bpe`).

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

``eos_ids`` is every id that ends a generation: ``eos_id`` and, when a
``generation_config.json`` sits beside the tokenizer file (as in Hugging Face
model directories), its ``eos_token_id`` (one id or a list: Llama 3 instruct
models end turns with ``<|eot_id|>``). ``chat_template`` is the
``chat_template`` of the ``tokenizer_config.json`` beside the file, if any; :func:`render_chat`
(from :mod:`hypertron.chat_template`) renders messages with it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from hypertron.chat_template import RenderedChat, compile_chat_template, render_chat  # noqa: F401 (their name)
from hypertron.errors import DataError, one_line

_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# A directory's tokenizer file, in order of preference (T5 ships its SentencePiece model as spiece.model).
_DIRECTORY_FILES = (("tokenizer.json", "hf"), ("tokenizer.model", "sentencepiece"), ("spiece.model", "sentencepiece"))
_CLIP_FILES = ("vocab.json", "merges.txt")
_EXPECTED = "expected 'byte', a tokenizer.json, a directory holding one, or a SentencePiece .model"


class Tokenizer(Protocol):
    """What the pipeline and the server need from a tokenizer; ``bos_id`` or ``eos_id`` may be
    None, not both."""

    name: str  # the string it was named by ("byte" or a path)
    path: str | None  # the file behind it (None for byte)
    bos_id: int | None
    eos_id: int | None  # the document separator of training data
    eos_ids: frozenset[int]  # every id that ends a generation (eos_id among them)
    pad_id: int
    vocab_size: int
    chat_template: str | None  # Jinja source, or None: the server's default

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, without special tokens."""

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode`, as an int32 array of shape [num_tokens]."""

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """:meth:`encode`'s ids and each one's [start, end) characters in ``text`` (a token that is
        part of a character spans that whole character)."""

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of ``ids``; special ids and ids outside the vocabulary are dropped."""

    def token_text(self, token_id: int) -> str:
        """How one id is written: a special token's own text (``<s>``), else the id decoded alone."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id adds to decoded text (b"" for a special id): exact even for an id that is
        only part of a UTF-8 character (byte tokens, byte-level BPE, SentencePiece byte fallback)."""


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


def check_vocab(tokenizer: Tokenizer, vocab_size: int, key: str = "model.vocab_size") -> None:
    """A model with ``vocab_size`` ids can use ``tokenizer``'s ids; else a :class:`DataError`
    ``KEY=N: the tokenizer T needs at least M`` (``key`` names where the model's size was set)."""
    if vocab_size < tokenizer.vocab_size:
        raise DataError(f"{key}={vocab_size}: the tokenizer {tokenizer.name} needs at least {tokenizer.vocab_size}")


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..2 are pad, bos, eos; byte ``b`` is id ``b + 3``."""

    name = "byte"
    path = None
    pad_id = 0
    bos_id = 1
    eos_id = 2
    eos_ids = frozenset({2})
    vocab_size = 259  # 3 special ids + 256 byte values
    chat_template = None
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

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids, and for each byte the character it belongs to."""
        chars = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text]).tolist()
        return self.encode(text), [(c, c + 1) for c in chars]

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

    def token_bytes(self, token_id: int) -> bytes:
        """The byte of id ``token_id`` (b"" for pad, bos, eos and ids outside the vocabulary)."""
        return bytes([token_id - self._BYTE_OFFSET]) if self._BYTE_OFFSET <= token_id < self.vocab_size else b""

    def token_text(self, token_id: int) -> str:
        """The id's byte as text (U+FFFD for a byte that is not a whole character; "" for specials)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (any model: BPE, Unigram, WordPiece) via ``tokenizers``, or
    the ``tokenizers.Tokenizer`` ``built`` from the files at ``path`` (a CLIP ``vocab.json``)."""

    def __init__(self, name: str, path: str, built=None):
        from tokenizers import Tokenizer as _HFTokenizer

        self.name, self.path = name, path
        try:
            self._tokenizer = built or _HFTokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception for a bad file
            raise DataError(f"data.tokenizer: cannot read {path} ({one_line(e)})") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        config = _special_token_config(os.path.dirname(path))
        self.bos_id = self._special_id(config, "bos_token", _BOS_NAMES)
        self.eos_id = self._special_id(config, "eos_token", _EOS_NAMES)
        pad_id = self._special_id(config, "pad_token", _PAD_NAMES)
        _check_separators(self)
        self.pad_id = _first_not_none(pad_id, self.eos_id, self.bos_id)
        self.eos_ids = _eos_ids(self.eos_id, os.path.dirname(path), self.vocab_size)
        # Added tokens marked special are dropped by decoding, as bos / eos / pad are.
        added = self._tokenizer.get_added_tokens_decoder()
        self._specials = {i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None} | \
            {i for i, token in added.items() if token.special}
        decoder = self._tokenizer.decoder
        self._byte_level = decoder is not None and _has_byte_level_decoder(json.loads(decoder.__getstate__()))

    @functools.cached_property
    def chat_template(self) -> str | None:
        return chat_template_beside(self.path)

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
        """Token ids of ``text`` without the tokenizer's own special tokens; a list. Through
        ``encode_batch``, which costs what ``encode`` does and lets go of the GIL while it works
        (``encode`` holds it: 1.1 ms for 1,000 tokens), so a server's thread tokenizing a long
        prompt leaves its event loop running."""
        return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and ``tokenizers``' character offsets."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode`, as an int32 array of shape [num_tokens]."""
        return np.asarray(self.encode(text), dtype=np.int32)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of ``ids``; special tokens and ids outside the vocabulary are dropped."""
        kept = _without_special(self, _as_ids(ids))
        return self._tokenizer.decode(kept.tolist(), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        if token_id in self._specials:
            return self._tokenizer.id_to_token(token_id) or ""
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """Byte-level BPE pieces (GPT-2, Llama 3) map back to their bytes through the byte <-> unicode
        table; byte-fallback pieces (``<0xE2>``) are their byte; other pieces are what they add decoded
        after a letter (``a``): a Metaspace piece ``▁world`` (Llama 2, Mistral) adds `` world``, which
        decoded alone would lose its space, and a WordPiece ``##s`` adds ``s``."""
        piece = self._tokenizer.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        if piece is None or token_id in self._specials:
            return b""
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        anchor = self._tokenizer.token_to_id("a")
        if anchor is not None:
            head, both = self.decode([anchor]), self.decode([anchor, token_id])
            if head and both.startswith(head):
                return both[len(head):].encode("utf-8")
        return self.decode([token_id]).encode("utf-8")


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
        self.eos_ids = _eos_ids(self.eos_id, os.path.dirname(path), self.vocab_size)
        self._specials = {i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None}

    @functools.cached_property
    def chat_template(self) -> str | None:
        return chat_template_beside(self.path)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without bos/eos (SentencePiece's default); a list."""
        return self._processor.encode(text, out_type=int)

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each piece's characters (SentencePiece gives its [begin, end) bytes in ``text``)."""
        try:
            pieces = self._processor.encode(text, out_type="proto").pieces
        except (ValueError, RuntimeError, TypeError):  # before sentencepiece 0.2.3: immutable_proto
            pieces = self._processor.encode(text, out_type="immutable_proto").pieces
        char_of_byte = np.repeat(np.arange(len(text) + 1), [len(c.encode("utf-8")) for c in text] + [1]).tolist()
        # The bytes of a character split over byte-fallback pieces are all on its last piece: the others
        # have begin == end, and are given the character they start.
        return [p.id for p in pieces], [(char_of_byte[p.begin], min(char_of_byte[max(p.end, p.begin + 1) - 1] + 1,
                                                                    len(text))) for p in pieces]

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode`, as an int32 array of shape [num_tokens]."""
        return np.asarray(self.encode(text), dtype=np.int32)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of ``ids``; special tokens and ids outside the vocabulary are dropped."""
        return self._processor.decode(_without_special(self, _as_ids(ids)).tolist())

    def token_text(self, token_id: int) -> str:
        if token_id in self._specials:
            return self._processor.id_to_piece(token_id)
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """A byte piece (``<0xE2>``) is its byte; another piece its text with "▁" as a space
        (so a word's leading space is kept, which decoding one id alone would drop)."""
        if not 0 <= token_id < self.vocab_size or token_id in self._specials or \
                self._processor.is_control(token_id) or self._processor.is_unknown(token_id):
            return b""
        piece = self._processor.id_to_piece(token_id)
        if self._processor.is_byte(token_id):
            return bytes([int(_BYTE_PIECE.fullmatch(piece).group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")


_BYTE = ByteTokenizer()


# CLIP's pieces: words (a run of letters), single digits, runs of other non-space characters and
# English contractions; its special tokens stay whole. As in CLIP's own tokenizer.
_CLIP_SPLIT = (r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|"
               r"[^\s\p{L}\p{N}]+")
_CLIP_SPECIALS = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                  "pad_token": "<|endoftext|>"}  # CLIPTokenizer's defaults


def clip_bpe(directory: str):
    """The ``tokenizers.Tokenizer`` that transformers' ``CLIPTokenizer`` builds from ``vocab.json`` +
    ``merges.txt`` in ``directory``: NFC, whitespace runs to one space and lower case; CLIP's split;
    byte-level pieces; BPE whose word-final pieces end in ``</w>``. The folder's bos, eos, unk and pad
    tokens (``tokenizer_config.json``, else ``special_tokens_map.json``, else CLIP's) are special
    tokens matched whole, as ``CLIPTokenizer`` does (so SD 2.x's pad token ``!`` is always its own id)."""
    from tokenizers import Regex, Tokenizer as _HFTokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab_path, merges_path = (os.path.join(directory, f) for f in _CLIP_FILES)
    config = {**_CLIP_SPECIALS, **_special_token_config(directory)}
    specials = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items()}
    try:
        with open(vocab_path, encoding="utf-8") as f:
            vocab = json.load(f)
        with open(merges_path, encoding="utf-8") as f:
            merges = [tuple(line.split()) for line in f.read().splitlines()
                      if line.strip() and not line.startswith("#version")]
        bpe = BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="</w>",
                  fuse_unk=False, unk_token=specials["unk_token"])
    except Exception as e:  # OSError, ValueError, or the bare Exception tokenizers raises for bad files
        raise DataError(f"data.tokenizer: cannot build a CLIP tokenizer from {vocab_path} and "
                        f"{merges_path} ({one_line(e)})") from None
    tokenizer = _HFTokenizer(bpe)
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tokenizer.decoder = decoders.Sequence(
        [decoders.ByteLevel(), decoders.Replace("</w>", " "), decoders.Strip(" ", 0, 1)])
    tokenizer.add_special_tokens([t for t in dict.fromkeys(specials.values()) if t is not None])
    return tokenizer


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
    # The files beside it say its special ids (HF), end-of-turn ids and chat template (both kinds).
    files = tokenizer_files(kind, path) + [os.path.join(os.path.dirname(path), f)
                                     for f in (*_CONFIG_FILES, "generation_config.json")]
    versions = tuple((f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files if os.path.isfile(f))
    return _load(kind, name, path, versions)


def tokenizer_file(name: str) -> tuple[str, str]:
    """(kind, absolute path) of the file behind a tokenizer path: kind is "hf" (a ``tokenizer.json``),
    "sentencepiece" (a ``.model``) or "clip" (a CLIP ``vocab.json``, its ``merges.txt`` beside it)."""
    # Not realpath: in a Hugging Face cache, tokenizer.json links to a blob
    # directory, and its tokenizer_config.json is only beside the link.
    path = os.path.abspath(os.path.expanduser(name))
    if not os.path.exists(path):
        raise DataError(f"data.tokenizer: {name} does not exist ({_EXPECTED})")
    if os.path.isdir(path):
        for file_name, kind in _DIRECTORY_FILES:
            if os.path.isfile(os.path.join(path, file_name)):
                return kind, os.path.join(path, file_name)
        if all(os.path.isfile(os.path.join(path, f)) for f in _CLIP_FILES):
            _check_clip_class(path)
            return "clip", os.path.join(path, _CLIP_FILES[0])
        raise DataError(f"data.tokenizer: {name} is a directory without tokenizer.json, tokenizer.model, "
                        "spiece.model or a CLIP vocab.json + merges.txt")
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
    return {"name": name, "kind": kind, "path": path, "sha256": _file_sha256(tokenizer_files(kind, path))}


@functools.lru_cache(maxsize=16)
def _load(kind: str, name: str, path: str, versions: tuple) -> Tokenizer:
    del versions  # only part of the cache key
    if kind == "clip":
        return HFTokenizer(name, path, clip_bpe(os.path.dirname(path)))
    return HFTokenizer(name, path) if kind == "hf" else SentencePieceTokenizer(name, path)


def tokenizer_files(kind: str, path: str) -> list[str]:
    """The files whose bytes make the ids of the tokenizer :func:`tokenizer_file` found (``kind``,
    ``path``): that file, or CLIP's vocab.json and merges.txt."""
    return [os.path.join(os.path.dirname(path), f) for f in _CLIP_FILES] if kind == "clip" else [path]


def _file_sha256(paths: list[str]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _special_token_config(directory: str) -> dict:
    """bos/eos/pad/unk token entries of the first tokenizer config file in ``directory``."""
    for file_name in _CONFIG_FILES:
        path = os.path.join(directory, file_name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise DataError(f"data.tokenizer: cannot read {path} ({one_line(e)})") from None
            if isinstance(config, dict):
                return {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in config}
    return {}


def _check_clip_class(directory: str) -> None:
    """A ``vocab.json`` + ``merges.txt`` folder is read only as CLIP's BPE (GPT-2's, with the same
    files, splits and merges otherwise): its ``tokenizer_config.json`` must say so."""
    path = os.path.join(directory, "tokenizer_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            tokenizer_class = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        tokenizer_class = None
    if tokenizer_class not in ("CLIPTokenizer", "CLIPTokenizerFast"):
        raise DataError(f"data.tokenizer: {directory} has a vocab.json + merges.txt but no tokenizer.json, and "
                        f"its tokenizer_config.json does not name CLIPTokenizer (only CLIP's BPE is built from "
                        f"these files)")


def chat_template_beside(path: str | None) -> str | None:
    """``chat_template`` of the ``tokenizer_config.json`` beside the tokenizer file ``path`` (None if
    there is none). A list of named templates gives ``default``, else the first."""
    config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json") if path else None
    if not config_path or not os.path.isfile(config_path):
        return None
    try:
        with open(config_path, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError) as e:
        raise DataError(f"cannot read the chat_template of {config_path}: {one_line(e)}") from None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _eos_ids(eos_id: int | None, directory: str, vocab_size: int) -> frozenset[int]:
    """``eos_id`` and the ``eos_token_id`` (an id or a list) of a ``generation_config.json`` in
    ``directory``; ids outside the vocabulary are left out."""
    ids = set() if eos_id is None else {eos_id}
    path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                extra = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as e:
            raise DataError(f"cannot read {path}: {one_line(e)}") from None
        extra = [extra] if isinstance(extra, int) else extra if isinstance(extra, list) else []
        ids |= {i for i in extra if isinstance(i, int) and 0 <= i < vocab_size}
    return frozenset(ids)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters (byte-level BPE pieces
    are written in these)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}


def _has_byte_level_decoder(decoder: dict | None) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level_decoder(d) for d in decoder.get("decoders") or [])


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
