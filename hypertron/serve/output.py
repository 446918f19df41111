"""The consumer's end of a request: text and tokens out, stop strings, latency metrics.

Detokenisation and stop strings happen here, on the asyncio side, not on the engine's thread:
text is released only once it decodes cleanly (a UTF-8 character split over byte tokens waits
for its last byte) and once it cannot be the start of a stop string; the stop string itself is
not returned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence

from hypertron.serve.detokenize import detokenizer
from hypertron.serve.metrics import ServeMetrics
from hypertron.serve.scheduler import ABORT, STOP, Output, Request
from hypertron.serve.types import TokenLogprobs


@dataclasses.dataclass(frozen=True)
class Chunk:
    """What a :class:`Generation` yields: new text and the tokens behind it.

    ``token_ids``, ``logprobs`` (None entries unless logprobs were asked for) and
    ``offsets`` (where each token's text starts in the completion text) have one entry per
    token; ``finish_reason`` is set on the last chunk only (``error`` with it when it is
    ``"error"`` or ``"abort"``).
    """

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    offsets: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None


class Generation:
    """The consumer's end of one request: ``async for chunk in generation`` yields :class:`Chunk`.

    Runs on the asyncio side: takes the scheduler's :class:`~hypertron.serve.scheduler.Output`
    records from ``queue``, detokenises, applies stop strings, records latency metrics.
    ``prompt_logprobs`` is set before the first chunk when they were asked for;
    ``completion_tokens`` counts the tokens returned so far; ``cached_tokens`` the prompt tokens
    the prefix cache held at its admission (0 before it). :meth:`cancel` (e.g. when the
    client goes away) frees the request's slot before the engine's next step.
    """

    def __init__(self, seq: Request, queue: asyncio.Queue, tokenizer, metrics: ServeMetrics,
                 cancel: Callable[[], None], stop: Sequence[str]):
        self._queue, self._metrics, self._cancel = queue, metrics, cancel
        self._stop = tuple(s for s in stop if s)
        self._detok = detokenizer(tokenizer, seq.prompt)
        self._held_text = ""  # decoded but not released (may start a stop string)
        self._held: list[tuple[int, TokenLogprobs | None, int]] = []  # (id, logprobs, offset)
        self._released = 0  # characters of completion text released
        self._t_submit = time.monotonic()
        self._t_first: float | None = None
        self._t_last = self._t_submit
        self._seq = seq
        self.prompt_tokens = list(seq.prompt)
        self.sampling = seq.sampling
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    @property
    def cached_tokens(self) -> int:
        return self._seq.cached_tokens or 0  # set on the loop thread before its first output

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Chunk:
        while self.finish_reason is None:
            out = await self._queue.get()
            start = time.perf_counter()
            chunk = self._on_event(out)
            self._metrics.detokenize.inc(time.perf_counter() - start)
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    def cancel(self) -> None:
        """Stop generating; the loop frees the slot. Safe to call more than once, or after the end."""
        if self.finish_reason is None:
            self._finish(ABORT)
        self._cancel()

    def _on_event(self, out: Output) -> Chunk | None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.token is not None:
            return self._on_token(out.token, out.logprobs)
        if out.finish_reason is None:
            return None
        reason, error = out.finish_reason, out.error
        chunk = self._release(self._held_text + self._detok.flush(), final=True)
        if chunk.finish_reason is not None:  # a stop string in the last piece
            return chunk
        self._finish(reason)
        return dataclasses.replace(chunk, finish_reason=reason, error=error)

    def _on_token(self, token_id: int, logprobs: TokenLogprobs | None) -> Chunk | None:
        now = time.monotonic()
        if self._t_first is None:
            self._t_first = now
            self._metrics.ttft.observe(now - self._t_submit)
        self._t_last = now
        self._held.append((token_id, logprobs, self._released + len(self._held_text)))
        return self._release(self._held_text + self._detok.add(token_id), final=False)

    def _release(self, text: str, final: bool) -> Chunk | None:
        """Release ``text`` (held + new) up to a stop string, or up to what could start one."""
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=None)
        if cut is not None:
            chunk = self._take(text[:cut], everything=False)
            self._finish(STOP)
            self._cancel()
            return dataclasses.replace(chunk, finish_reason=STOP)
        keep = 0 if final else _longest_stop_prefix(text, self._stop)
        self._held_text = text[len(text) - keep:]
        out = text[:len(text) - keep]
        if not out and not final:
            return None
        return self._take(out, everything=final)

    def _take(self, text: str, everything: bool) -> Chunk:
        """A chunk of ``text`` with the held tokens whose text starts inside it (all, if ``everything``)."""
        end = self._released + len(text)
        taken = [t for t in self._held if everything or t[2] < end]
        self._held = self._held[len(taken):]
        self._released = end
        self.completion_tokens += len(taken)
        return Chunk(text, tuple(t[0] for t in taken), tuple(t[1] for t in taken), tuple(t[2] for t in taken))

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        m, now = self._metrics, time.monotonic()
        m.requests.labels(finish_reason=reason).inc()
        m.latency.observe(now - self._t_submit)
        if self._t_first is not None and self.completion_tokens > 1:
            m.tpot.observe((self._t_last - self._t_first) / (self.completion_tokens - 1))


def _longest_stop_prefix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the beginning of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
