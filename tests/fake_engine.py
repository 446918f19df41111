"""A deterministic stand-in for the serving engine (no JAX), for the orchestrator and server tests.

It implements :class:`hypertron.serve.types.Engine` over the byte tokenizer's ids, strictly:
it refuses calls from a second thread, inserts into a busy slot, a :meth:`FakeEngine.generate`
without the pages :meth:`FakeEngine.reserve_step` should have taken, and frees of idle slots.

Its tokens encode the request: the next token is a lowercase letter chosen by a CRC of
(seed, every token before it), so a sequence's continuation depends on its whole prompt and
nothing else, and :func:`reference` gives what any request must receive, pre-empted or not.
``~d`` in a sequence (d a digit) makes it emit EOS d tokens later. Log-probabilities come
from a fixed table (a log-softmax over the vocabulary per previous token).
"""

from __future__ import annotations

import threading
import time
import zlib

import numpy as np

from hypertron.serve.types import Prefix, SamplingParams, StepOutput, TokenLogprobs

VOCAB, EOS, OFFSET = 259, 2, 3  # the byte tokenizer: byte b is id b + 3
LETTERS = np.arange(ord("a"), ord("z") + 1) + OFFSET
_TILDE = ord("~") + OFFSET
_DIGITS = {ord(str(d)) + OFFSET: d for d in range(10)}

_prev = np.arange(VOCAB)[:, None]
_logits = 3.0 * np.sin(0.37 * np.arange(VOCAB)[None, :] * (_prev % 13 + 1) + _prev)
LOGPROBS = _logits - np.log(np.exp(_logits).sum(axis=1, keepdims=True))  # [prev, next]
TOP = np.argsort(-LOGPROBS, axis=1, kind="stable")  # [prev, rank]


def next_token(tokens: list[int], sampling: SamplingParams) -> int:
    """The token after ``tokens``: EOS when a ``~d`` is d tokens back, else a letter from a CRC."""
    for i in range(max(0, len(tokens) - 12), len(tokens) - 1):
        if tokens[i] == _TILDE and tokens[i + 1] in _DIGITS and len(tokens) - (i + 2) == _DIGITS[tokens[i + 1]]:
            return EOS
    seed = 0 if sampling.temperature == 0 else sampling.seed
    crc = zlib.crc32(np.asarray(tokens, np.int32).tobytes(), seed & 0xFFFFFFFF)
    return int(LETTERS[crc % len(LETTERS)])


def token_logprobs(prev: int, token: int, n: int) -> TokenLogprobs:
    """Log-probability of ``token`` after ``prev`` and the top ``n`` from the fixed table."""
    top = TOP[prev, :n]
    return TokenLogprobs(float(LOGPROBS[prev, token]), tuple(int(i) for i in top),
                         tuple(float(v) for v in LOGPROBS[prev, top]))


def reference(prompt: list[int], sampling: SamplingParams, max_seq_len: int) -> tuple[list[int], str]:
    """(tokens, finish reason) any request must get, computed one token at a time without batching."""
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens, sampling)
        if (t == EOS and not sampling.ignore_eos) or t in sampling.stop_token_ids:
            return out, "stop"
        out.append(t)
        tokens.append(t)
        if len(out) >= sampling.max_tokens or len(tokens) >= max_seq_len:
            return out, "length"


class _Seq:
    def __init__(self, prefix: Prefix, pages: int):
        self.tokens, self.last, self.sampling, self.pages = list(prefix.tokens), prefix.first_token, prefix.sampling, pages


class FakeEngine:
    """``max_slots`` decode slots over ``num_pages`` KV pages of ``page_size`` tokens."""

    def __init__(self, *, max_slots: int = 4, max_seq_len: int = 256, page_size: int = 4, num_pages: int = 256,
                 max_top_logprobs: int = 5, step_delay: float = 0.0):
        self.max_slots, self.max_seq_len, self.max_top_logprobs = max_slots, max_seq_len, max_top_logprobs
        self.eos_ids, self.page_size, self.num_pages = frozenset({EOS}), page_size, num_pages
        self.step_delay = step_delay
        self.slots: list[_Seq | None] = [None] * max_slots
        self.pages_free = num_pages
        self.steps = self.prefills = self.calls = 0
        self._thread: int | None = None

    def _check(self) -> None:
        self.calls += 1
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        assert self._thread == me, "the engine was called from two threads"

    def _pages(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def can_prefill(self, num_tokens: int) -> bool:
        self._check()
        return self.pages_free >= self._pages(num_tokens)

    def prefill(self, tokens: list[int], sampling: SamplingParams, want_prompt_logprobs: bool = False) -> Prefix:
        self._check()
        assert 0 < len(tokens) < self.max_seq_len and sampling.seed is not None
        pages = self._pages(len(tokens))
        assert self.pages_free >= pages, "prefill without can_prefill"
        self.pages_free -= pages  # taken now, as the real engine writes the prompt's KV into them
        self.prefills += 1
        n = self.max_top_logprobs  # all of them, as the real engine does: the orchestrator keeps the first N
        first = next_token(tokens, sampling)
        prompt_lp = [token_logprobs(tokens[i], tokens[i + 1], n) for i in range(len(tokens) - 1)]
        return Prefix(list(tokens), sampling, first, token_logprobs(tokens[-1], first, n),
                      prompt_lp if want_prompt_logprobs else None, kv={"pages": pages})

    def can_insert(self, prefix: Prefix) -> bool:
        self._check()
        return None in self.slots

    def insert(self, prefix: Prefix, slot: int) -> None:
        self._check()
        assert self.slots[slot] is None, f"insert into busy slot {slot}"
        assert prefix.kv["pages"], "insert of a released prefix"
        self.slots[slot] = _Seq(prefix, prefix.kv["pages"])
        prefix.kv["pages"] = 0

    def release(self, prefix: Prefix) -> None:
        self._check()
        self.pages_free += prefix.kv["pages"]
        prefix.kv["pages"] = 0

    def reserve_step(self) -> list[int]:
        self._check()
        short = []
        for slot, seq in enumerate(self.slots):
            if seq is not None and self._pages(len(seq.tokens) + 1) > seq.pages:
                if self.pages_free == 0:
                    short.append(slot)
                else:
                    self.pages_free -= 1
                    seq.pages += 1
        return short

    def generate(self) -> StepOutput:
        self._check()
        if self.step_delay:
            time.sleep(self.step_delay)
        self.steps += 1
        k = self.max_top_logprobs
        out = StepOutput(np.zeros(self.max_slots, np.int32), np.zeros(self.max_slots, np.float32),
                         np.zeros((self.max_slots, k), np.int32), np.zeros((self.max_slots, k), np.float32))
        for slot, seq in enumerate(self.slots):
            if seq is None:
                continue
            assert self._pages(len(seq.tokens) + 1) <= seq.pages, f"slot {slot}: no page reserved"
            assert len(seq.tokens) < self.max_seq_len, f"slot {slot}: past max_seq_len"
            seq.tokens.append(seq.last)
            seq.last = next_token(seq.tokens, seq.sampling)
            lp = token_logprobs(seq.tokens[-1], seq.last, k)
            out.tokens[slot], out.logprobs[slot] = seq.last, lp.logprob
            out.top_ids[slot], out.top_logprobs[slot] = lp.top_ids, lp.top_logprobs
        return out

    def free(self, slot: int) -> None:
        self._check()
        seq = self.slots[slot]
        assert seq is not None, f"free of idle slot {slot}"
        self.pages_free += seq.pages
        self.slots[slot] = None

    def stats(self) -> dict[str, int]:
        self.calls += 1
        used = sum(s is not None for s in self.slots)
        return {"slots_in_use": used, "slots_total": self.max_slots,
                "pages_free": self.pages_free, "pages_total": self.num_pages}
