"""A deterministic stand-in for the serving engine (no JAX), for the orchestrator and server tests.

It implements :class:`hypertron.serve.types.Engine` over the byte tokenizer's ids, strictly:
it refuses calls from a second thread, a row without the pages for what it writes, a page one row
of a step writes in another row of it, a row whose pages do not hold its prefix (a position before
its start never written, or, for a sequence the slot holds, not what the slot wrote or read
there), a sequence's first row after cached pages without their tokens (``Row.prefix``, which
the real engine writes into the slot's token history), and rows past ``max_seq_len``. Each page
records the tokens written into it, and a row's prefix is read back from its pages, so a page
shared by prefix caching is what its tokens come from.

A verify row (speculative decoding) keeps its drafted tokens while each is the token this engine
would give there, then gives the next one.

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

from hypertron.serve.types import SamplingParams, StepPlan, StepResult, TokenLogprobs

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


class FakeEngine:
    """``max_slots`` decode slots over ``num_pages`` KV pages of ``page_size`` tokens; each step
    takes ``step_delay`` seconds (in :meth:`collect`, as a device would)."""

    def __init__(self, *, max_slots: int = 4, max_seq_len: int = 256, page_size: int = 4, num_pages: int = 256,
                 max_top_logprobs: int = 5, step_delay: float = 0.0):
        self.accelerator = True  # dispatch_ahead=auto: every step ahead, as on an accelerator
        self.max_slots, self.max_seq_len, self.max_top_logprobs = max_slots, max_seq_len, max_top_logprobs
        self.eos_ids, self.page_size, self.num_pages = frozenset({EOS}), page_size, num_pages
        self.step_delay = step_delay
        self.vocab_size = VOCAB
        self.tokens: list[list[int] | None] = [None] * max_slots  # what each slot's sequence holds
        self.owner: list[int | None] = [None] * max_slots  # the request each slot last ran
        self.pages: dict[int, list[int | None]] = {}  # the token written at each position of a page
        self.last = [0] * max_slots  # each slot's last sampled token ("on the device")
        self.steps = self.prefills = self.calls = 0
        self._thread: int | None = None
        self._unsampled: set[int] = set()  # steps whose guided rows wait for sample_guided

    def _check(self) -> None:
        self.calls += 1
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        assert self._thread == me, "the engine was called from two threads"

    def dispatch(self, plan: StepPlan):
        self._check()
        assert not self._unsampled, f"step {plan.step} dispatched before the guided rows of the one before sampled"
        k = self.max_top_logprobs
        n = len(plan.rows)
        width = max(r.draft for r in plan.rows) + 1  # verify rows: each row's new tokens
        result = StepResult(np.zeros((n, width) if width > 1 else (n,), np.int32),
                            emitted=np.ones(n, np.int32) if width > 1 else None)
        if plan.logprobs:
            result.logprobs, result.top_ids = np.zeros(result.tokens.shape, np.float32), np.zeros((*result.tokens.shape, k), np.int32)
            result.top_logprobs = np.zeros((*result.tokens.shape, k), np.float32)
        if plan.prompt_logprobs:
            result.prompt = [None] * len(plan.prefills)
        self._check_pages(plan)
        assert len({row.slot for row in plan.rows}) == n, f"step {plan.step}: a slot in two rows"
        for i, row in enumerate(plan.rows):
            assert row.end <= self.max_seq_len, f"slot {row.slot}: past max_seq_len"
            assert -(-row.end // self.page_size) <= len(row.pages), f"slot {row.slot}: no page for {row.end - 1}"
            seq = self._prefix(row)
            assert row.sampling.seed is not None
            seq.extend(row.tokens or [self.last[row.slot], *row.proposal])
            for pos in range(row.start, row.end):
                self.pages.setdefault(row.pages[pos // self.page_size], [None] * self.page_size)[
                    pos % self.page_size] = seq[pos]
            if row.prompt_targets is not None:
                lps = [token_logprobs(seq[row.start + j], t, k) for j, t in enumerate(row.prompt_targets)]
                result.prompt[i - len(plan.decodes)] = (np.array([lp.logprob for lp in lps]),
                                                        np.array([lp.top_ids for lp in lps]),
                                                        np.array([lp.top_logprobs for lp in lps]))
            if not row.sample:
                continue
            drafts = seq[len(seq) - row.draft:]
            del seq[len(seq) - row.draft:]  # a verify row: its drafts are kept while they are what it samples
            for j in range(row.draft + 1):
                self.last[row.slot] = token = next_token(seq, row.sampling)
                at = (i, j) if result.emitted is not None else i
                result.tokens[at] = token
                result.inputs = {**getattr(result, "inputs", {}), i: seq[-1]}  # for sample_guided's log-probabilities
                if plan.logprobs:
                    lp = token_logprobs(seq[-1], token, k)
                    result.logprobs[at], result.top_ids[at], result.top_logprobs[at] = (lp.logprob, lp.top_ids,
                                                                                        lp.top_logprobs)
                if j == row.draft or drafts[j] != token:
                    break
                seq.append(token)
            if result.emitted is not None:
                result.emitted[i] = j + 1
        self.steps += 1
        result.plan = plan  # for sample_guided
        if any(r.guided for r in plan.rows):
            self._unsampled.add(id(result))
        return result

    def sample_guided(self, result: StepResult, masks: list) -> None:
        """A guided row's token: the first id its mask allows at or after the one this engine drew
        (else the first it allows), so that a grammar holds here as on the real engine."""
        self._check()
        assert id(result) in self._unsampled, f"step {result.plan.step}: no guided rows to sample, or sampled twice"
        self._unsampled.discard(id(result))
        for i, (row, mask) in enumerate(zip(result.plan.rows, masks)):
            if row.guided and mask is not None:
                allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:self.vocab_size])
                assert len(allowed), f"step {result.plan.step}: a guided row's mask allows nothing"
                at = (i, 0) if result.emitted is not None else i  # beside verify rows: its first token
                later = allowed[allowed >= result.tokens[at]]
                result.tokens[at] = self.last[row.slot] = token = int(later[0] if len(later) else allowed[0])
                if result.logprobs is not None:
                    lp = token_logprobs(result.inputs[i], token, self.max_top_logprobs)
                    result.logprobs[at], result.top_ids[at], result.top_logprobs[at] = (lp.logprob, lp.top_ids,
                                                                                        lp.top_logprobs)

    def _check_pages(self, plan: StepPlan) -> None:
        """Every page in the pool; a page a row writes in no other row of the step."""
        ps, seen = self.page_size, {}
        for row in plan.rows:
            assert all(0 < p <= self.num_pages for p in row.pages), f"step {plan.step}: a page outside the pool"
            for p in row.pages[:-(-row.end // ps)]:
                seen.setdefault(p, set()).add(row.request)
        for row in plan.rows:
            for p in row.pages[row.start // ps:-(-row.end // ps)]:
                assert seen[p] == {row.request}, f"step {plan.step}: page {p} written by {row.request}, read by {seen[p]}"

    def _prefix(self, row) -> list[int]:
        """The tokens before ``row``'s start, read from its pages (the slot's sequence from now on)."""
        ps = self.page_size
        prefix = [self.pages.get(row.pages[pos // ps], [None] * ps)[pos % ps] for pos in range(row.start)]
        assert None not in prefix, f"slot {row.slot}: its pages do not hold positions before {row.start}"
        held = self.tokens[row.slot]
        if self.owner[row.slot] == row.request and held is not None:  # the slot's sequence goes on (or is recomputed)
            assert prefix == held[:row.start] and row.start <= len(held), \
                f"slot {row.slot}: its pages do not hold what it wrote before {row.start}"
            assert row.tokens or row.start == len(held), f"slot {row.slot}: decodes at {row.start}, holds {len(held)}"
        elif not row.tokens:
            raise AssertionError(f"slot {row.slot}: a decode row of request {row.request}, which it does not hold")
        assert list(row.prefix) == prefix[row.start - len(row.prefix):], f"slot {row.slot}: a prefix not its pages'"
        if row.tokens and (row.start == 0 or self.owner[row.slot] != row.request or row.start != len(held)):
            self.prefills += 1  # a sequence's prefill begins (after what its pages share)
            assert len(row.prefix) == row.start, f"slot {row.slot}: {row.start} cached tokens, {len(row.prefix)} sent"
        self.owner[row.slot], self.tokens[row.slot] = row.request, prefix
        return prefix

    def collect(self, result: StepResult) -> StepResult:
        self._check()
        assert id(result) not in self._unsampled, f"step {result.plan.step} collected before its guided rows sampled"
        if self.step_delay:
            time.sleep(self.step_delay)
        return result

