"""Continuous batching: requests in, streamed tokens out, one engine step at a time.

One background thread owns the engine and the scheduler (neither is thread-safe) and runs a
plain loop:

1. take new requests, cancellations (client gone, stop string seen) and prefix-cache resets
   (``POST /reset_prefix_cache``) from the asyncio side;
2. :meth:`Scheduler.schedule` the next step (decode rows and prefill chunks within the token
   budget: :mod:`hypertron.serve.scheduler`) and :meth:`Engine.dispatch` it;
3. only then :meth:`Engine.collect` the *previous* step and hand its outputs to the scheduler, so
   the device runs step n + 1 while the host reads step n's tokens, detokenises and streams
   (``ahead=False``: collect each step right after dispatching it; ``ahead_max_tokens``: only
   steps of at most that many tokens are left running, for a CPU, where a large step takes the
   cores the host needs); then, if step n + 1 has guided rows (structured output), hand the
   engine their grammars' masks, which needed step n's tokens, and it samples them
   (:func:`~hypertron.serve.scheduler.sample_guided`) while its forward pass runs;
4. deliver the scheduler's outputs to each request's ``asyncio.Queue``
   (``loop.call_soon_threadsafe``, one call per event loop per step), or to another target
   (:meth:`Orchestrator.add`: an engine process's socket, :mod:`hypertron.serve.engine_process`).

The consumer's side, :class:`~hypertron.serve.output.Generation`, detokenises and applies stop
strings. The thread sleeps on a condition variable when there is nothing to do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import secrets
import threading
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, generate_latest

from hypertron.serve.metrics import STEP_PHASES, ServeMetrics
from hypertron.serve.output import Chunk, Generation
from hypertron.config import SchedulerConfig
from hypertron.config.serving import CPU_AHEAD_MAX_TOKENS
from hypertron.serve.scheduler import (
    ABORT,
    ERROR,
    LENGTH,
    STOP,
    Output,
    Request,
    Scheduler,
    sample_guided,
)
from hypertron.serve.types import Engine, LoraError, SamplingParams, check_token_ids

log = logging.getLogger(__name__)
# What a request whose step failed is told (500): the server's log has the traceback, keyed on the
# request's id (Scheduler.fail appends it); an exception's text may hold internals, so it stays there.
STEP_FAILED = "the request failed in an engine step; the server log has the details"
CLOSE_WAIT_S = 1.0  # stop: how long to wait for the engine's background compiler

__all__ = ["ABORT", "ERROR", "LENGTH", "STOP", "Chunk", "Generation", "Orchestrator", "QueueFull", "Submission"]


def resolve_dispatch_ahead(setting: str, accelerator: bool) -> tuple[bool, int | None]:
    """``dispatch_ahead`` as ``(ahead, ahead_max_tokens)``: ``auto`` is on for an engine on an
    accelerator, and on a CPU for steps of at most :data:`~hypertron.config.schema.CPU_AHEAD_MAX_TOKENS` tokens."""
    if setting != "auto":
        return setting == "on", None
    return True, (None if accelerator else CPU_AHEAD_MAX_TOKENS)


class QueueFull(Exception):
    """The waiting queue holds ``max_queue`` requests already; the client should retry later."""


@dataclasses.dataclass(eq=False)
class Submission:
    """A request taken by :meth:`Orchestrator.add`: its outputs go to ``target`` with ``tag``."""

    seq: Request
    target: object  # an OutputTarget: deliver(pairs) on the loop thread, pairs: [(tag, Output)]
    tag: object


@dataclasses.dataclass(frozen=True)
class LoopTarget:
    """Outputs for requests submitted from one event loop: each to its request's queue (the tag),
    one thread-safe call per step."""

    loop: asyncio.AbstractEventLoop

    def deliver(self, pairs: list[tuple[asyncio.Queue, Output]]) -> None:
        self.loop.call_soon_threadsafe(_deliver, pairs)  # RuntimeError: that loop is closed


class Orchestrator:
    """Continuous batching over ``engine`` on one background thread (see the module docstring).

    ``submit`` (from a running asyncio loop) returns a :class:`Generation`; ``start`` / ``stop``
    run and end the thread (``stop`` aborts what is left). ``config``
    (:class:`~hypertron.config.SchedulerConfig`) is held whole and handed to the scheduler; its
    ``max_queue`` bounds the requests waiting for a slot (past it :meth:`submit` raises
    :class:`QueueFull`), its ``dispatch_ahead`` is :func:`resolve_dispatch_ahead` for this engine.
    ``step_overhead_tokens``: the scheduler's (a step's fixed cost, as measured).
    """

    def __init__(self, engine: Engine, tokenizer, config: SchedulerConfig = SchedulerConfig(), *,
                 step_overhead_tokens: float | None = None, registry: CollectorRegistry | None = None):
        self.engine, self.tokenizer, self.config, self.max_queue = engine, tokenizer, config, config.max_queue
        self.ahead, self.ahead_max_tokens = resolve_dispatch_ahead(config.dispatch_ahead, engine.accelerator)
        self.max_seq_len, self.max_top_logprobs = engine.max_seq_len, engine.max_top_logprobs
        self.vocab_size = engine.vocab_size
        self.scheduler = Scheduler(engine, config, step_overhead_tokens=step_overhead_tokens)
        self.kv_pool_tokens = engine.num_pages * engine.page_size  # a prompt must be shorter (see Scheduler._admit)
        self.lora = getattr(engine, "lora", None)  # its LoRA slots (hypertron.serve.lora_slots), if any
        self.metrics = ServeMetrics(registry)
        self._cv = threading.Condition()
        self._incoming: list[Submission] = []
        self._cancelled: list[Submission] = []
        self._resets: list[concurrent.futures.Future] = []
        self._waiting = 0  # requests not admitted yet (incoming + the scheduler's queue), for max_queue
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._requests: dict[int, Submission] = {}  # owned by the loop thread
        self._outbox: list[tuple[Submission, Output]] = []
        self._counted: dict[str, int] = {}  # the scheduler's counts already in the metrics, by name
        self._guided_seen = False  # a step with guided rows has run (see _guide)
        self._compiles: dict[str, int] = {}
        self._compiles_lock = threading.Lock()  # count_compiles runs on the loop thread and in GET /metrics

    # -- the asyncio side ---------------------------------------------------------------

    def submit(self, prompt: Sequence[int], sampling: SamplingParams, *, stop: Sequence[str] = (),
               want_prompt_logprobs: bool = False, cache_salt: str | None = None,
               adapter: str | None = None, guide=None) -> Generation:
        """Queue a request; call from the event loop that will consume it.

        ``prompt`` is 1 .. ``max_seq_len - 1`` token ids; ``sampling.seed`` None draws one;
        ``cache_salt``: it shares cached pages only with requests of the same salt. ``adapter``: the
        LoRA adapter loaded under that name in the engine's :attr:`lora` slots (None: the base model;
        a :class:`~hypertron.serve.lora_slots.LoraError` 404 for one not loaded), held until the request ends.
        ``guide``: its grammar's state (:class:`~hypertron.serve.structured.Guide`, this request's
        own), which each of its samples keeps to.
        Raises :class:`QueueFull` when ``max_queue`` requests are waiting, ValueError for a
        prompt or sampling value the engine cannot take (:meth:`SamplingParams.check`), RuntimeError when not running.
        """
        queue: asyncio.Queue = asyncio.Queue()
        req = self.add(prompt, sampling, LoopTarget(asyncio.get_running_loop()), queue,
                       want_prompt_logprobs=want_prompt_logprobs, cache_salt=cache_salt, adapter=adapter, guide=guide)
        return Generation(req.seq, queue, self.tokenizer, self.metrics, lambda: self.cancel(req), stop)

    def add(self, prompt: Sequence[int], sampling: SamplingParams, target, tag, *,
            want_prompt_logprobs: bool = False, cache_salt: str | None = None, adapter: str | None = None,
            guide=None) -> Submission:
        """:meth:`submit` from any thread, its outputs handed to ``target.deliver([(tag, Output),
        ...])`` on the loop thread, once per step for all of that step's requests with that target
        (a RuntimeError there aborts them). The same checks and errors as :meth:`submit`."""
        self.scheduler.check_prompt(prompt)
        check_token_ids(prompt, self.vocab_size, "prompt")  # SamplingError, as the server's own checks
        sampling.check(vocab_size=self.vocab_size, max_top_logprobs=self.max_top_logprobs)
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(31))
        lora = None
        if adapter is not None:
            if self.lora is None:
                raise LoraError(f"model {adapter!r} does not exist (this server serves no LoRA adapters)", status=404,
                                param="model")
            lora = self.lora.acquire(adapter)
        seq = Request(next(self._ids), list(map(int, prompt)), sampling, want_prompt_logprobs, cache_salt,
                      adapter=-1 if lora is None else lora.slot, adapter_key=None if lora is None else lora.key,
                      guide=guide)
        req = Submission(seq, target, tag)
        with self._cv:
            if not self.running or self._waiting >= self.max_queue:
                if lora is not None:
                    self.lora.release(lora.slot)
                if not self.running:
                    raise RuntimeError("the orchestrator is not running")
                raise QueueFull(f"{self._waiting} requests are waiting already (max_queue)")
            self._incoming.append(req)
            self._waiting += 1
            self.metrics.queue_depth.set(self._waiting)
            self._cv.notify()
        return req

    @property
    def waiting(self) -> int:
        """Requests not admitted yet (what ``max_queue`` bounds)."""
        with self._cv:
            return self._waiting

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        """Drop the cached pages no sequence holds, on the loop thread before its next step: a
        future of how many. RuntimeError when not running."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if not self.running:
                raise RuntimeError("the orchestrator is not running")
            self._resets.append(future)
            self._cv.notify()
        return future

    def cancel(self, req: Submission) -> None:
        """End ``req`` (from :meth:`add`) before the next step; any thread, any number of times."""
        with self._cv:
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
        close = getattr(self.engine, "close", None)  # the engine's background compiler, if any
        if close is not None:
            # Told to stop, not waited for past a moment: a compile in hand (a server's largest shape,
            # seconds on a loaded CPU) finishes on its daemon thread, and stopping does not wait for it.
            close(CLOSE_WAIT_S)

    # -- the loop thread ----------------------------------------------------------------

    def _run(self) -> None:
        sched, pending = self.scheduler, None
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._incoming or self._cancelled or self._resets or sched.has_work
                               or pending):
                        self._update_gauges()
                        self._cv.wait()
                    if self._stopping:
                        break
                    clock = _Clock()  # a turn starts when there is something to do
                    incoming, self._incoming = self._incoming, []
                    cancelled, self._cancelled = self._cancelled, []
                    resets, self._resets = self._resets, []
                for future in resets:
                    future.set_result(sched.reset_prefix_cache())
                for req in incoming:
                    self._requests[req.seq.id] = req
                    sched.add(req.seq)
                    self.metrics.prompt_tokens.inc(len(req.seq.prompt))
                for req in cancelled:
                    sched.abort(req.seq)
                    self._forget(req.seq.id)
                clock.lap("intake")
                plan = sched.schedule() if sched.has_work else None
                clock.lap("schedule")
                current = self._dispatch(plan) if plan is not None else None
                clock.split("launch", "assemble", _times(current[1]).get("assemble", 0.0) if current else 0.0)
                if pending is not None:  # step n, collected once step n + 1 is dispatched
                    self._collect(pending, clock)
                    pending = None
                if current is None and plan is not None:  # its dispatch raised; step n is in first
                    self._isolate(plan)
                    clock.lap("launch")
                elif current is not None and self._guide(current):
                    if self._ahead(plan):
                        pending = current
                    else:
                        self._collect(current, clock)
                self._route(sched.take_outputs())
                self._flush()
                self._update_gauges()
                clock.lap("deliver")
                clock.observe(self.metrics)
        except Exception:  # a bug here must not leave clients waiting forever
            log.exception("orchestrator loop failed")
        finally:
            with self._cv:
                self._stopping = True
                for req in self._incoming:
                    self._requests[req.seq.id] = req
                    sched.add(req.seq)
                self._incoming = []
                resets, self._resets = self._resets, []
            sched.finish_all(ABORT, "the server stopped")
            for future in resets:
                future.set_exception(RuntimeError("the orchestrator stopped"))
            self._route(sched.take_outputs())
            self._flush()

    def _ahead(self, plan) -> bool:
        """Whether to leave ``plan``'s step running while the next is dispatched."""
        return self.ahead and not plan.proposes and (self.ahead_max_tokens is None
                                                     or plan.num_tokens <= self.ahead_max_tokens)

    def _dispatch(self, plan):
        """``(plan, handle)``, or None when the dispatch raised (logged; :meth:`_isolate` then)."""
        try:
            return plan, self.engine.dispatch(plan)
        except Exception:
            log.exception("step %d failed to dispatch (requests %s); running its rows apart", plan.step,
                          [r.request for r in plan.rows])
            return None

    def _guide(self, current) -> bool:
        """Sample the guided rows of a step just dispatched, once the step before is collected
        (:func:`~hypertron.serve.scheduler.sample_guided`); False if that failed (its requests fail:
        the step ran on the device)."""
        plan, handle = current
        spent = self.scheduler.mask_seconds
        try:
            sample_guided(self.engine, self.scheduler, plan, handle)
        except Exception:
            log.exception("step %d: sampling its guided rows failed (requests %s)", plan.step,
                          [r.request for r in plan.rows])
            self.scheduler.fail(plan, STEP_FAILED)
            return False
        if self.scheduler.mask_seconds > spent:
            self.metrics.structured_mask.observe(self.scheduler.mask_seconds - spent)
            if not self._guided_seen and getattr(self.engine, "background_compile", False):
                # The first guided step waited for its variant's compile, as a first step asking for
                # log-probabilities does; the largest shape's guided variant now compiles in the
                # background, so that later guided steps run padded to it rather than wait.
                self.engine.precompile(dataclasses.replace(self.engine.largest_shape(self.config), guided=True))
            self._guided_seen = True
        return True

    def _collect(self, pending, clock: _Clock | None = None) -> None:
        """Hand a dispatched step's result to the scheduler. A step that fails here failed on the
        device, which it may have changed in part (its rows' next tokens, their pages): it is not
        run again, its requests fail. ``clock``: the turn's, which it laps (wait, unpack, update)."""
        plan, handle = pending
        try:
            result = self.engine.collect(handle)
        except Exception:
            log.exception("step %d failed (requests %s)", plan.step, [r.request for r in plan.rows])
            self.scheduler.fail(plan, STEP_FAILED)
            return
        finally:
            if clock is not None:  # an engine that does not time its wait: all of collect is waiting
                clock.split("unpack", "wait", _times(handle).get("wait", math.inf))
        self.scheduler.update(plan, result)
        if clock is not None:
            clock.lap("update")

    def _isolate(self, plan) -> None:
        """``plan``'s dispatch raised before the device saw it (an engine writes a step's arrays on
        the host first), so its rows can run again as they were: in halves, each dispatched and
        collected alone, a half that raises split again, down to the single rows that raise alone,
        whose requests fail (the others get the tokens the whole step would have given them). At
        most ``2 * rows - 1`` sub-steps, all in this loop turn, after step n - 1 is collected."""
        parts = [plan.rows]
        while parts:
            rows = parts.pop()
            sub = plan.only(rows)
            try:
                handle = self.engine.dispatch(sub)
            except Exception:
                if len(rows) == 1:
                    log.exception("step %d: request %d's row fails the step; it is refused", plan.step,
                                  rows[0].request)
                    self.scheduler.fail(sub, STEP_FAILED)
                else:
                    parts += [rows[len(rows) // 2:], rows[:len(rows) // 2]]
                continue
            if self._guide((sub, handle)):
                self._collect((sub, handle))

    def _route(self, outputs: list[Output]) -> None:
        m = self.metrics
        for out in outputs:
            req = self._requests.get(out.seq.id)
            if req is None:
                continue
            if out.token is not None:
                m.generation_tokens.inc()
            if out.finish_reason is not None:
                self._forget(out.seq.id)
            self._outbox.append((req, out))

    def _flush(self) -> None:
        """Deliver this step's outputs: one call per target (for asyncio, per event loop)."""
        by_target: dict[object, list[tuple[object, Output]]] = {}
        for req, out in self._outbox:
            by_target.setdefault(req.target, []).append((req.tag, out))
        self._outbox = []
        for target, pairs in by_target.items():
            try:
                target.deliver(pairs)
            except RuntimeError:  # that event loop is closed: nobody consumes its requests
                for _, out in pairs:
                    self.scheduler.abort(out.seq)
                    self._forget(out.seq.id)

    def _forget(self, request: int) -> None:
        """A request has ended: drop it, and give back its LoRA adapter's slot."""
        req = self._requests.pop(request, None)
        if req is not None and req.seq.adapter >= 0:
            self.lora.release(req.seq.adapter)

    def _update_gauges(self) -> None:
        stats, m = self.scheduler.stats(), self.metrics
        with self._cv:
            self._waiting = len(self._incoming) + stats["waiting"]
        m.slots_in_use.set(stats["slots_in_use"])
        m.slots_total.set(stats["slots_total"])
        m.pages_free.set(stats["pages_free"])
        m.pages_total.set(stats["pages_total"])
        m.pages_cached.set(stats["pages_cached"])
        m.queue_depth.set(self._waiting)
        counts = {"preemptions": (m.preemptions, self.scheduler.preemptions),
                  "prefix_queries": (m.prefix_queries, stats["prefix_queries"]),
                  "prefix_hits": (m.prefix_hits, stats["prefix_hits"])}
        if (d := self.scheduler.drafter) is not None:
            counts.update(spec_drafts=(m.spec_drafts, d.drafts), spec_draft_tokens=(m.spec_draft_tokens, d.draft_tokens),
                          spec_accepted=(m.spec_accepted, d.accepted))
            counts.update({f"spec_pos_{i}": (m.spec_accepted_per_pos.labels(str(i)), n)
                           for i, n in enumerate(d.accepted_per_pos)})
        for name, (counter, n) in counts.items():  # the scheduler's counts, since it started
            counter.inc(n - self._counted.get(name, 0))
            self._counted[name] = n
        self.count_compiles()

    def exposition(self) -> bytes:
        """``GET /metrics``' Prometheus text: the metrics, the engine's compiles counted first."""
        self.count_compiles()
        return generate_latest(self.metrics.registry)

    def count_compiles(self) -> None:
        """The engine's compiles since it started, and those queued, into the metrics: each loop turn
        and ``GET /metrics`` call it (a background compile may end while the loop waits for work)."""
        with self._compiles_lock:
            for mode, n in getattr(self.engine, "compiles", {}).items():
                self.metrics.compiles.labels(mode).inc(n - self._compiles.get(mode, 0))
                self._compiles[mode] = n
            self.metrics.compiles_queued.set(getattr(self.engine, "queued_compiles", 0))


def _times(handle) -> dict[str, float]:
    """What an engine timed of a step (its handle's ``times``: ``assemble`` in dispatch, ``wait``
    in collect, seconds); an engine may time nothing."""
    return getattr(handle, "times", None) or {}


class _Clock:
    """One loop turn's time by phase (:data:`~hypertron.serve.metrics.STEP_PHASES`): each lap
    charges the time since the last one to a phase, so the phases add up to the turn."""

    def __init__(self):
        self.parts = dict.fromkeys(STEP_PHASES, 0.0)
        self.start = self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.parts[phase] += now - self.last
        self.last = now

    def split(self, phase: str, part: str, part_seconds: float) -> None:
        """:meth:`lap` with ``part_seconds`` of it (at most all) charged to ``part`` instead."""
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        inner = min(max(part_seconds, 0.0), elapsed)
        self.parts[part] += inner
        self.parts[phase] += elapsed - inner

    def observe(self, metrics: ServeMetrics) -> None:
        metrics.step.observe(self.last - self.start)
        for phase, seconds in self.parts.items():
            metrics.step_phases[phase].observe(seconds)


def _deliver(items: list[tuple[asyncio.Queue, Output]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)
