"""Structured output: a request's grammar, and each guided sequence's allowed next tokens.

A chat request's ``response_format`` (OpenAI's: ``text``, ``json_object``, or ``json_schema``
with its ``schema``), or on either endpoint the extension ``structured_outputs`` (vLLM's name:
exactly one of ``json``, ``regex``, ``grammar`` (Lark), ``choice``, ``json_object``), becomes one
llguidance grammar (:func:`grammar_for`). JSON is compact (llguidance's ``whitespace_flexible``
off: no whitespace between tokens), so a bounded schema's output ends. :class:`Grammars` (one per
server) holds the tokenizer as llguidance sees it (each id's bytes, from
:meth:`hypertron.tokenizer.Tokenizer.token_bytes`, so the byte, ``tokenizer.json`` and
SentencePiece tokenizers all work the same way), compiles a grammar once per text (a compiled
matcher kept, :data:`MAX_CACHED_GRAMMARS` of them, and copied for each request) and refuses a bad
one with llguidance's message (:class:`StructuredError`, the API's 400). Compiling can take a
while for a large schema (llguidance drops the GIL): the server does it off its event loop,
before the request is queued.

Each guided sequence has a :class:`Guide`: before a step samples it, :meth:`Guide.fill` writes
its allowed next tokens as a bitmask (int32 words, bit ``i % 32`` of word ``i // 32`` for id
``i``; ids past the tokenizer's are never allowed), which the engine applies to the step's logits
before temperature, top-k and top-p (:func:`hypertron.serve.device_step.sample_masked`: apart from
the forward pass, so that the mask can wait for the token before; see
:mod:`hypertron.serve.scheduler`); log-probabilities stay the model's, as vLLM's are. The sampled
token is then :meth:`Guide.consume` d. The end-of-sequence token is allowed only where the grammar
accepts, and a grammar that can take nothing more (:attr:`Guide.done`) ends the request
(``stop``). Host only, no JAX: the scheduler calls a guide through its methods alone.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
from typing import Any

import numpy as np

from hypertron.serve.types import SamplingError

MAX_CACHED_GRAMMARS = 256
# llguidance's JSON options: compact output (no whitespace between tokens).
JSON_OPTIONS = {"whitespace_flexible": False}
STRUCTURED_KINDS = ("json", "regex", "grammar", "choice", "json_object")
MAX_ERROR_CHARS = 500
# Masks through llguidance's thread pool only for this many guided rows or more, on a host of more
# than this many cores: on this project's 2-core VM the pool was no faster than one by one (a 12-integer
# JSON array, a 2,048-id BPE: 0.11 against 0.06 ms at 4 rows, 0.47 against 0.49 at 64), and beside a
# serving loop under load a step's masks took 1.6 ms at the median against 0.2 one by one
# (docs/benchmarks.md). Unmeasured on a many-core host, where the pool is meant to pay.
EXECUTOR_MIN_ROWS = 8
EXECUTOR_MIN_CPUS = 4


class StructuredError(SamplingError):
    """A grammar that cannot be used; ``field`` is the request's field (the 400's ``param``)."""


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A request's grammar as llguidance takes it, and the request's field it came from."""

    text: str
    field: str


def grammar_for(response_format: dict | None, structured_outputs: dict | None) -> Grammar | None:
    """The grammar of a request's ``response_format`` (as OpenAI spells it) or ``structured_outputs``
    (vLLM's extension), None for free text; :class:`StructuredError` for a request that asks for
    both, none of the kinds, or an ill-formed one. llguidance is imported only for a grammar: a
    server without it serves free text."""
    if response_format is not None and structured_outputs is not None:
        raise StructuredError("structured_outputs", "'response_format' and 'structured_outputs' cannot both be given")
    if structured_outputs is not None:
        given = [k for k in STRUCTURED_KINDS if structured_outputs.get(k) is not None
                 and not (k == "json_object" and structured_outputs[k] is False)]
        if not given:
            return None
        if len(given) > 1:
            raise StructuredError("structured_outputs", "'structured_outputs' takes one of "
                                  f"{', '.join(STRUCTURED_KINDS)}; got {', '.join(given)}")
        from llguidance import LLMatcher

        kind, value = given[0], structured_outputs[given[0]]
        field = "structured_outputs"
        if kind == "regex":
            return Grammar(LLMatcher.grammar_from_regex(value), field)
        if kind == "grammar":
            return Grammar(LLMatcher.grammar_from_lark(value), field)
        if kind == "choice":
            if not value:
                raise StructuredError(field, "'structured_outputs.choice' is empty")
            return Grammar(LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value)), field)
        return _json(field, {"type": "object"} if kind == "json_object" else value)
    if response_format is None or response_format.get("type") == "text":
        return None
    field = "response_format"
    if response_format.get("type") == "json_object":
        return _json(field, {"type": "object"})
    spec = response_format.get("json_schema") or {}
    if spec.get("schema") is None:
        raise StructuredError(field, "'response_format' of type 'json_schema' needs 'json_schema.schema'")
    return _json(field, spec["schema"])


def _json(field: str, schema: Any) -> Grammar:
    from llguidance import LLMatcher

    if schema is True:  # the schema every JSON value holds
        schema = {}
    if schema is False:
        raise StructuredError(field, f"'{field}': the schema false allows no value")
    if not isinstance(schema, dict | str):
        raise StructuredError(field, f"'{field}': a JSON schema is an object, not {type(schema).__name__}")
    try:
        return Grammar(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), field)
    except ValueError as e:
        raise StructuredError(field, f"'{field}': {_one_line(str(e))}") from None


def _one_line(message: str) -> str:
    """llguidance's message on one line, without the backtrace of a limit met inside it (a panic)."""
    message = message.split("<backtrace>")[0]
    return " ".join(line.strip() for line in message.splitlines() if line.strip())[:MAX_ERROR_CHARS]


class _TokenizerView:
    """A tokenizer as llguidance's ``TokenizerWrapper`` reads it: each id's bytes, the special ids
    (those with none), EOS and BOS, and encoding."""

    def __init__(self, tokenizer):
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i, b in enumerate(self.tokens) if not b]
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        self._encode = tokenizer.encode

    def __call__(self, text: str | bytes) -> list[int]:
        return self._encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)


class Grammars:
    """One server's grammars: the tokenizer as llguidance sees it (made at the first guided
    request), and each grammar compiled once (see the module docstring). Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.words = tokenizer, -(-vocab_size // 32)
        self._ll = None
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def _lltokenizer(self):
        import llguidance

        with self._lock:
            if self._ll is None:
                eos = sorted(self.tokenizer.eos_ids) or None
                self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenizerView(self.tokenizer)),
                                                  eos_token=eos)
            return self._ll

    def guide(self, grammar: Grammar) -> Guide:
        """A new :class:`Guide` of ``grammar`` (compiled now unless it was before); a grammar that
        does not compile, or is past llguidance's limits, raises :class:`StructuredError`."""
        import llguidance

        with self._lock:
            matcher = self._compiled.get(grammar.text)
            if matcher is not None:
                self._compiled.move_to_end(grammar.text)
        if matcher is None:
            matcher = llguidance.LLMatcher(self._lltokenizer(), grammar.text, log_level=0)
            if matcher.is_error():
                raise StructuredError(grammar.field, f"'{grammar.field}': {_one_line(matcher.get_error())}")
            with self._lock:
                self._compiled[grammar.text] = matcher
                while len(self._compiled) > MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        return Guide(matcher.deep_copy(), self.words, -(-self._lltokenizer().vocab_size // 32), grammar)


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor():
    """llguidance's thread pool for masks, made at the first guided step (its default threads)."""
    global _EXECUTOR
    import llguidance

    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


class Guide:
    """One guided sequence's grammar state (see the module docstring)."""

    def __init__(self, matcher, words: int, own_words: int, grammar: Grammar | None = None):
        self.matcher, self.words, self._own = matcher, words, own_words
        self.grammar = grammar  # what it keeps to (an engine in a process of its own compiles it there)

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row`` (int32, ``words`` long)."""
        row[self._own:] = 0
        target = row[:self._own]
        self.matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def mask(self) -> np.ndarray:
        """The allowed next tokens as a new bitmask."""
        row = np.zeros(self.words, np.int32)
        self.fill(row)
        return row

    @staticmethod
    def masks_of(guides: list[Guide]) -> np.ndarray:
        """Each guide's :meth:`mask` (``[len(guides), words]``; guides of one :class:`Grammars`): in
        one call of llguidance's executor over its threads (a step's guided rows at once) on a host
        of more than :data:`EXECUTOR_MIN_CPUS` cores for at least :data:`EXECUTOR_MIN_ROWS` rows,
        else one by one."""
        out = np.zeros((len(guides), guides[0].words), np.int32)
        if len(guides) < EXECUTOR_MIN_ROWS or (os.cpu_count() or 1) <= EXECUTOR_MIN_CPUS:
            for g, row in zip(guides, out):
                g.fill(row)
            return out
        own = guides[0]._own
        theirs = np.zeros((len(guides), own), np.int32)
        _executor().unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(guides)], theirs.ctypes.data,
                                            own * 4, len(guides))
        out[:, :own] = theirs
        return out

    def consume(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it (the guide is then broken)."""
        return bool(self.matcher.consume_token(int(token)))

    @property
    def done(self) -> bool:
        """Whether the grammar can take nothing more (the request ends); not after an error
        (:attr:`error`), which llguidance also counts as stopped."""
        return bool(self.matcher.is_stopped()) and not self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""
