"""Tokenisers: text <-> token ids.

The byte tokenizer is written by hand because it is four lines of arithmetic:
every UTF-8 byte ``b`` is token ``b + 3``, after three special tokens. It
needs no vocabulary file, so every machine can train and test without a
download. Subword tokenisers (HF ``tokenizers``, ``sentencepiece``) will sit
behind the same ``encode`` / ``decode`` interface and :func:`get_tokenizer`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from hypertron.data.sources import DataError


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..2 are pad, bos, eos; byte ``b`` is id ``b + 3``."""

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
        ids_n = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        byte_ids = ids_n[(ids_n >= self._BYTE_OFFSET) & (ids_n < self.vocab_size)]
        return (byte_ids - self._BYTE_OFFSET).astype(np.uint8).tobytes().decode(
            "utf-8", errors="replace"
        )


_TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> ByteTokenizer:
    """The tokenizer called ``name`` (``"byte"``); an unknown name raises :class:`DataError`."""
    if name not in _TOKENIZERS:
        known = ", ".join(sorted(_TOKENIZERS))
        raise DataError(f"data.tokenizer: unknown tokenizer {name!r} (known: {known})")
    return _TOKENIZERS[name]()
