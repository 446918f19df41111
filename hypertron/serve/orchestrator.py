"""Continuous batching: requests in, streamed tokens out, over an engine's fixed decode slots.

One background thread owns the engine (which is not thread-safe) and runs a plain loop:

1. drop cancelled requests (client gone, stop string seen), freeing their slots at once;
2. admit waiting requests into free slots (once :meth:`Engine.can_prefill` finds pages for
   the prompt, :meth:`Engine.prefill`, then :meth:`Engine.insert`), at most
   ``max_prefills_per_step`` while others decode,
   so that a burst of arrivals does not starve the running sequences;
3. :meth:`Engine.reserve_step`; while it names slots left without a KV page, pre-empt the
   most recently admitted request: free its slot and put it back at the front of the
   queue, to be recomputed later from its prompt + the tokens generated so far (those are
   not streamed again; only the remaining ``max_tokens`` are generated);
4. :meth:`Engine.generate`, then hand each active request its token through a per-request
   ``asyncio.Queue`` (``loop.call_soon_threadsafe``, one call per event loop per step).

Token-level stops happen on the loop: EOS (unless ``ignore_eos``), ``stop_token_ids``
(neither token is returned), ``max_tokens`` and the sequence reaching the engine's
``max_seq_len`` (``"length"``). Detokenisation and stop strings happen in the consumer,
:class:`Generation`, on the asyncio side: text is released only once it decodes cleanly
(a UTF-8 character split over byte tokens waits for its last byte) and once it cannot be
the start of a stop string; the stop string itself is not returned.

The thread sleeps on a condition variable when there is nothing to do. Written here
rather than borrowed: JetStream's orchestrator and vLLM's scheduler are tied to their
own engines; this one needs only the small contract in :mod:`hypertron.serve.types`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hypertron.serve.types import Engine, Prefix, SamplingParams, TokenLogprobs

log = logging.getLogger(__name__)

STOP, LENGTH, ABORT, ERROR = "stop", "length", "abort", "error"  # finish reasons


class QueueFull(Exception):
    """The waiting queue holds ``max_queue`` requests already; the client should retry later."""


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


class ServeMetrics:
    """The server's Prometheus metrics, in a registry of its own (several servers per process)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r, p = self.registry, "hypertron_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "submit to first token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.tpot = Histogram(p + "time_per_output_token_seconds", "per request, after the first token",
                              registry=r, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.latency = Histogram(p + "request_latency_seconds", "submit to finish", registry=r,
                                 buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.requests = Counter(p + "requests", "finished requests", ["finish_reason"], registry=r)
        self.preemptions = Counter(p + "preemptions", "requests pre-empted for KV pages", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self.slots_in_use = Gauge(p + "slots_in_use", "decode slots holding a sequence", registry=r)
        self.slots_total = Gauge(p + "slots_total", "decode slots", registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "requests waiting for a slot", registry=r)
        self.pages_free = Gauge(p + "kv_pages_free", "free KV-cache pages", registry=r)
        self.pages_total = Gauge(p + "kv_pages_total", "KV-cache pages", registry=r)


@dataclasses.dataclass(eq=False)
class _Request:
    """A request as the loop thread sees it."""

    prompt: list[int]
    sampling: SamplingParams
    want_prompt_logprobs: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    generated: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    admitted: int = 0  # admission order, for choosing whom to pre-empt
    cancelled: bool = False
    done: bool = False


class Generation:
    """The consumer's end of one request: ``async for chunk in generation`` yields :class:`Chunk`.

    Runs on the asyncio side: detokenises, applies stop strings, records latency metrics.
    ``prompt_logprobs`` is set before the first chunk when they were asked for;
    ``completion_tokens`` counts the tokens returned so far. :meth:`cancel` (e.g. when the
    client goes away) frees the request's slot before the engine's next step.
    """

    def __init__(self, orchestrator: Orchestrator, request: _Request, stop: Sequence[str]):
        self._orch, self._req, self._stop = orchestrator, request, tuple(s for s in stop if s)
        self._detok = IncrementalDetokenizer(orchestrator.tokenizer, request.prompt)
        self._held_text = ""  # decoded but not released (may start a stop string)
        self._held: list[tuple[int, TokenLogprobs | None, int]] = []  # (id, logprobs, offset)
        self._released = 0  # characters of completion text released
        self._t_submit = time.monotonic()
        self._t_first: float | None = None
        self._t_last = self._t_submit
        self.prompt_tokens = list(request.prompt)
        self.sampling = request.sampling
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Chunk:
        while self.finish_reason is None:
            chunk = self._on_event(await self._req.queue.get())
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    def cancel(self) -> None:
        """Stop generating; the loop frees the slot. Safe to call more than once, or after the end."""
        if self.finish_reason is None:
            self._finish(ABORT)
        self._orch._cancel(self._req)

    def _on_event(self, event: tuple) -> Chunk | None:
        kind = event[0]
        if kind == "prompt":
            self.prompt_logprobs = event[1]
            return None
        if kind == "token":
            return self._on_token(event[1], event[2])
        reason, error = event[1], event[2]  # "finish"
        chunk = self._release(self._held_text + self._detok.flush(), final=True)
        if chunk.finish_reason is not None:  # a stop string in the last piece
            return chunk
        self._finish(reason)
        return dataclasses.replace(chunk, finish_reason=reason, error=error)

    def _on_token(self, token_id: int, logprobs: TokenLogprobs | None) -> Chunk | None:
        now = time.monotonic()
        if self._t_first is None:
            self._t_first = now
            self._orch.metrics.ttft.observe(now - self._t_submit)
        self._t_last = now
        self._held.append((token_id, logprobs, self._released + len(self._held_text)))
        return self._release(self._held_text + self._detok.add(token_id), final=False)

    def _release(self, text: str, final: bool) -> Chunk | None:
        """Release ``text`` (held + new) up to a stop string, or up to what could start one."""
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=None)
        if cut is not None:
            chunk = self._take(text[:cut], everything=False)
            self._finish(STOP)
            self._orch._cancel(self._req)
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
        m, now = self._orch.metrics, time.monotonic()
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


class Orchestrator:
    """Continuous batching over ``engine`` on one background thread (see the module docstring).

    ``submit`` (from a running asyncio loop) returns a :class:`Generation`; ``start`` /
    ``stop`` run and end the thread (``stop`` aborts what is left). ``max_queue`` bounds the
    requests waiting for a slot: past it :meth:`submit` raises :class:`QueueFull`.
    """

    def __init__(self, engine: Engine, tokenizer, *, max_queue: int = 256, max_prefills_per_step: int = 2,
                 registry: CollectorRegistry | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_queue, self.max_prefills_per_step = max_queue, max_prefills_per_step
        self.max_seq_len, self.max_top_logprobs = engine.max_seq_len, engine.max_top_logprobs
        self.metrics = ServeMetrics(registry)
        self._cv = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._cancelled: list[_Request] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Owned by the loop thread:
        self._active: dict[int, _Request] = {}
        self._free_slots = list(range(engine.max_slots - 1, -1, -1))
        self._pending: tuple[_Request, Prefix] | None = None  # prefilled, waiting for pages
        self._hold_admission = False  # after a pre-emption, until a sequence ends
        self._order = itertools.count(1)
        self._outbox: list[tuple[_Request, tuple]] = []

    # -- the asyncio side ---------------------------------------------------------------

    def submit(self, prompt: Sequence[int], sampling: SamplingParams, *, stop: Sequence[str] = (),
               want_prompt_logprobs: bool = False) -> Generation:
        """Queue a request; call from the event loop that will consume it.

        ``prompt`` is 1 .. ``max_seq_len - 1`` token ids; ``sampling.seed`` None draws one.
        Raises :class:`QueueFull` when ``max_queue`` requests are waiting, ValueError for a
        prompt or logprobs count the engine cannot take, RuntimeError when not running.
        """
        if not 0 < len(prompt) < self.max_seq_len:
            raise ValueError(f"prompt of {len(prompt)} tokens: expected 1 to {self.max_seq_len - 1}")
        if sampling.logprobs is not None and not 0 <= sampling.logprobs <= self.max_top_logprobs:
            raise ValueError(f"logprobs={sampling.logprobs}: expected 0 to {self.max_top_logprobs}")
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(31))
        req = _Request(list(map(int, prompt)), sampling, want_prompt_logprobs,
                       asyncio.get_running_loop(), asyncio.Queue())
        with self._cv:
            if not self.running:
                raise RuntimeError("the orchestrator is not running")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (max_queue)")
            self._waiting.append(req)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cv.notify()
        return Generation(self, req, stop)

    def _cancel(self, req: _Request) -> None:
        with self._cv:
            if not req.cancelled and not req.done:
                req.cancelled = True
                self._cancelled.append(req)
                self._cv.notify()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def start(self) -> Orchestrator:
        """Start the loop thread (once)."""
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hypertron-orchestrator", daemon=True)
                self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop thread after its current step; every unfinished request ends with ``"abort"``."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the loop thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._cancelled or self._waiting or self._active or self._pending):
                        self._update_gauges()
                        self._cv.wait()
                    if self._stopping:
                        break
                self._drop_cancelled()
                self._admit()
                self._step()
                self._flush()
                self._update_gauges()
        except Exception:  # a bug here must not leave clients waiting forever
            log.exception("orchestrator loop failed")
        finally:
            with self._cv:
                self._stopping = True
                left = list(self._waiting) + list(self._active.values())
                left += [self._pending[0]] if self._pending else []
                self._waiting.clear()
            for req in left:
                self._send(req, ("finish", ABORT, "the server stopped"))
                req.done = True
            self._flush()

    def _drop_cancelled(self) -> None:
        with self._cv:
            cancelled, self._cancelled = self._cancelled, []
        for req in cancelled:
            self._drop(req)

    def _drop(self, req: _Request) -> None:
        """Forget a cancelled request wherever it is: queue, pending prefix or slot."""
        with self._cv:
            if req in self._waiting:
                self._waiting.remove(req)
        if self._pending and self._pending[0] is req:
            self.engine.release(self._pending[1])
            self._pending = None
        if req.slot is not None:
            self._release_slot(req)
        req.done = True

    def _admit(self) -> None:
        if self._hold_admission and self._active:
            return
        budget = self.max_prefills_per_step if self._active else self.engine.max_slots
        while self._free_slots:
            if self._pending is None:
                if budget == 0:
                    return
                with self._cv:
                    if not self._waiting:
                        return
                    req = self._waiting[0]
                    fits = self.engine.can_prefill(len(req.prompt) + len(req.generated))
                    if fits or not self._active:
                        self._waiting.popleft()
                if not fits:
                    if self._active:
                        return  # wait for running sequences to end and give back pages
                    self._finish(req, LENGTH)  # it does not fit even into an empty cache
                    continue
                budget -= 1
                if self._prefill(req) is None:
                    continue
            req, prefix = self._pending
            if not self.engine.can_insert(prefix):
                return  # no slot (cannot happen inside this loop; kept for other engines)
            self._pending = None
            slot = self._free_slots.pop()
            try:
                self.engine.insert(prefix, slot)
            except Exception as e:
                log.exception("insert failed")
                self._free_slots.append(slot)
                self.engine.release(prefix)
                self._finish(req, ERROR, f"insert failed: {e}")
                continue
            req.slot, req.admitted = slot, next(self._order)
            self._active[slot] = req

    def _prefill(self, req: _Request) -> Prefix | None:
        """Prefill ``req`` (its prompt + what it generated before a pre-emption) and stream the
        first token; sets ``self._pending`` unless the request ended there."""
        resumed = bool(req.generated)
        remaining = req.sampling.max_tokens - len(req.generated)
        sampling = dataclasses.replace(req.sampling, max_tokens=remaining)
        want = req.want_prompt_logprobs and not resumed
        try:
            prefix = self.engine.prefill(req.prompt + req.generated, sampling, want)
        except Exception as e:
            log.exception("prefill failed")
            self._finish(req, ERROR, f"prefill failed: {e}")
            return None
        if not resumed:
            self.metrics.prompt_tokens.inc(len(req.prompt))
        n = sampling.logprobs or 0
        if want:
            self._send(req, ("prompt", [_top(lp, n) for lp in prefix.prompt_logprobs or []]))
        ended = self._emit(req, prefix.first_token, _top(prefix.first_logprobs, n))
        self._flush()  # the first token goes out now, not after the other prefills of this step
        if ended:
            self.engine.release(prefix)
            return None
        self._pending = (req, prefix)
        return prefix

    def _step(self) -> None:
        self._drop_cancelled()  # those that went away while we admitted
        if not self._active:
            return
        while short := self.engine.reserve_step():
            if len(self._active) == 1:  # alone and still no page: the cache is full for it
                self._finish(next(iter(self._active.values())), LENGTH)
                continue
            victim = max(self._active.values(), key=lambda r: r.admitted)
            log.debug("pre-empting slot %d (slots without pages: %s)", victim.slot, short)
            self._release_slot(victim)
            self._hold_admission = True
            self.metrics.preemptions.inc()
            with self._cv:
                self._waiting.appendleft(victim)
        if not self._active:
            return
        try:
            out = self.engine.generate()
        except Exception as e:
            log.exception("decode step failed")
            for req in list(self._active.values()):
                self._finish(req, ERROR, f"decode step failed: {e}")
            return
        for slot, req in list(self._active.items()):
            n = req.sampling.logprobs
            lp = None if n is None else TokenLogprobs(
                float(out.logprobs[slot]), tuple(int(i) for i in out.top_ids[slot][:n]),
                tuple(float(v) for v in out.top_logprobs[slot][:n]))
            self._emit(req, int(out.tokens[slot]), lp)

    def _emit(self, req: _Request, token: int, logprobs: TokenLogprobs | None) -> bool:
        """Hand ``token`` to the request's consumer; finish the request if it ends here. True if ended."""
        s = req.sampling
        if (token in self.engine.eos_ids and not s.ignore_eos) or token in s.stop_token_ids:
            self._finish(req, STOP)
            return True
        req.generated.append(token)
        self.metrics.generation_tokens.inc()
        self._send(req, ("token", token, logprobs if s.logprobs is not None else None))
        if len(req.generated) >= s.max_tokens or len(req.prompt) + len(req.generated) >= self.max_seq_len:
            self._finish(req, LENGTH)
            return True
        return False

    def _finish(self, req: _Request, reason: str, error: str | None = None) -> None:
        if req.slot is not None:
            self._release_slot(req)
        req.done = True
        self._send(req, ("finish", reason, error))

    def _release_slot(self, req: _Request) -> None:
        self.engine.free(req.slot)
        del self._active[req.slot]
        self._free_slots.append(req.slot)
        req.slot = None
        self._hold_admission = False

    def _send(self, req: _Request, event: tuple) -> None:
        if not req.cancelled:
            self._outbox.append((req, event))

    def _flush(self) -> None:
        """Deliver this step's events: one thread-safe call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Request, tuple]]] = {}
        for req, event in self._outbox:
            by_loop.setdefault(req.loop, []).append((req, event))
        self._outbox = []
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, [(req.queue, event) for req, event in pairs])
            except RuntimeError:  # that event loop is closed: nobody consumes its requests
                for req, _ in pairs:
                    self._cancel(req)

    def _update_gauges(self) -> None:
        stats = self.engine.stats()
        m = self.metrics
        m.slots_in_use.set(stats["slots_in_use"])
        m.slots_total.set(stats["slots_total"])
        m.pages_free.set(stats["pages_free"])
        m.pages_total.set(stats["pages_total"])
        m.queue_depth.set(len(self._waiting))


def _top(lp: TokenLogprobs, n: int) -> TokenLogprobs:
    """``lp`` with its top-``n`` alternatives only (an engine may return more)."""
    return dataclasses.replace(lp, top_ids=lp.top_ids[:n], top_logprobs=lp.top_logprobs[:n])


def _deliver(items: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)
