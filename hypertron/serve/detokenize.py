"""Token ids to text, a piece at a time, for streaming."""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """Text of a growing token sequence, piece by piece, without breaking characters.

    Each :meth:`add` decodes a short window ``ids[prefix:]`` and returns what it adds to
    ``ids[prefix:read]``, but only when that does not end in U+FFFD (an unfinished UTF-8
    sequence, or a SentencePiece piece whose leading space depends on its neighbour);
    otherwise the token waits for the next one. ``context`` (e.g. the prompt's last
    tokens) gives the first pieces their left neighbour and is never returned.
    """

    def __init__(self, tokenizer, context: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._ids = list(context[-4:])
        self._prefix, self._read = 0, len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is unfinished)."""
        self._ids.append(int(token_id))
        done = self._tokenizer.decode(self._ids[self._prefix:self._read])
        full = self._tokenizer.decode(self._ids[self._prefix:])
        if len(full) > len(done) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return full[len(done):]
        return ""

    def flush(self) -> str:
        """Whatever is held back (at the end of the sequence), even if it does not decode cleanly."""
        done = self._tokenizer.decode(self._ids[self._prefix:self._read])
        full = self._tokenizer.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return full[len(done):]
