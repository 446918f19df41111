"""Token ids to text, a piece at a time, for streaming.

:func:`detokenizer` picks the way: a Hugging Face tokenizer (``tokenizer.json``) streams through
``tokenizers``' own incremental ``DecodeStream``; the others (bytes, SentencePiece) through
:class:`IncrementalDetokenizer`. Both hold a token back while its text is not whole (a UTF-8
character split over byte tokens) and take the prompt's last tokens as left context, so that
the first piece gets the spacing it has after them.
"""

from __future__ import annotations

from collections.abc import Sequence

CONTEXT_TOKENS = 4  # of the prompt, as left context


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
        self._ids = list(context[-CONTEXT_TOKENS:])
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


class StreamDetokenizer:
    """:class:`IncrementalDetokenizer`'s interface over ``tokenizers.decoders.DecodeStream``, for a
    :class:`hypertron.tokenizer.HFTokenizer`. Special tokens and ids past the vocabulary add no
    text (as :meth:`HFTokenizer.decode` drops them) and are not fed to the stream."""

    def __init__(self, tokenizer, context: Sequence[int] = ()):
        from tokenizers.decoders import DecodeStream

        self._tokenizer, self._hf = tokenizer, tokenizer._tokenizer
        kept = [int(i) for i in context[-CONTEXT_TOKENS:] if self._keeps(int(i))]
        while kept and "\ufffd" in tokenizer.decode(kept):  # DecodeStream would stream that piece again
            kept = kept[1:]
        try:
            self._stream = DecodeStream(ids=kept, skip_special_tokens=True)
        except TypeError:  # tokenizers before 0.22: no prefill argument; step through the context
            self._stream = DecodeStream(skip_special_tokens=True)
            for token_id in kept:
                self._stream.step(self._hf, token_id)
        self._held: list[int] = []  # fed since the last text

    def _keeps(self, token_id: int) -> bool:
        return 0 <= token_id < self._tokenizer.vocab_size and token_id not in self._tokenizer._specials

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        if not self._keeps(token_id):
            return ""
        text = self._stream.step(self._hf, token_id)
        if text is None:
            self._held.append(token_id)
            return ""
        self._held = []
        return text

    def flush(self) -> str:
        """Whatever is held back (at the end of the sequence), even if it does not decode cleanly."""
        held, self._held = self._held, []
        return self._tokenizer.decode(held) if held else ""


def detokenizer(tokenizer, context: Sequence[int] = ()):
    """A streaming detokenizer for ``tokenizer``, with ``context`` (the prompt) as left context."""
    from hypertron.tokenizer import HFTokenizer

    if isinstance(tokenizer, HFTokenizer):
        return StreamDetokenizer(tokenizer, context)
    return IncrementalDetokenizer(tokenizer, context)

