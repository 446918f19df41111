"""Which tokens each engine step runs: decode rows and prefill chunks within a token budget.

One :class:`Scheduler` owns the requests (:class:`Request`), the decode slots and the KV-cache
page pool, on the host, with no JAX. Each :meth:`Scheduler.schedule` builds one
:class:`~hypertron.serve.types.StepPlan` of at most ``max_num_batched_tokens`` tokens:

1. a decode token for every running sequence that has its prompt in the cache (running
   streams never wait for a prompt), taking a page when it crosses into a new one. With no
   page free, the most recently admitted sequence is pre-empted: its slot and pages go back,
   and it waits at the front of the queue, to be recomputed from its prompt + what it
   generated (those tokens are not streamed again). Until some sequence ends, nothing new is
   admitted, so pre-emption cannot thrash;
2. the next chunk of each sequence whose prompt is partly in the cache (a long prompt is
   prefilled over several steps while the others decode);
3. new sequences from the queue while budget, a free slot, a prefill row
   (``max_prefill_rows``) and pages for the whole prompt (and its first decode write) are
   there; several short prompts share one step. A prompt is split only when it starts a step's
   prefill: one that does not fit whole in what is left of the budget waits for the next step.
   So prompts are prefilled whole whenever they fit the budget: fewer, longer rows, which the
   engine's ragged paged attention takes in full blocks of one row's queries.

   How many new prompts share a step (``step_overhead_tokens``; None: as many as fit). Where a
   step's time grows with its tokens (a CPU: prefill is compute-bound), prompts that share a
   step all wait for the whole of it: n prompts of L tokens in groups of g, with a step's fixed
   cost worth d tokens (its overhead and its decode rows), get their first token after about
   ``(n / g + 1) / 2 * (g L + d)`` on average, least at g near ``sqrt(n d / L)``; prompts one at
   a time when d is small against L, and all in one step when it is large (an accelerator, where
   a step of a few hundred tokens costs about what one token does). The group is that optimum
   over the prompts that could start now, measured by the server (:func:`group_size`).

Structured output: a request with a grammar (``Request.guide``, :mod:`hypertron.serve.structured`)
is scheduled as any other; its sampling rows are ``guided``. A guide's next allowed tokens depend
on the token sampled last, which with the engine one step ahead is still on its way when the next
step is planned and dispatched: so the step runs its forward pass for every row and samples the
unguided ones, and once the step before is collected (its tokens consumed by the guides),
:func:`sample_guided` hands the engine the guided rows' masks (:meth:`Scheduler.masks`) and it
samples them (:meth:`Engine.sample_guided`), before the next step is dispatched. A guide that can
take nothing more ends its request (``stop``).

Speculative decoding (``speculative: ngram``, :mod:`hypertron.serve.speculative`): a sequence
whose step has nothing in flight (its last token known) and whose tokens propose a draft gets a
decode row that feeds the draft after its last token (:attr:`Row.proposal`), within
what is left of the budget after prefill (drafts are what a full budget drops first),
``max_tokens``, ``max_seq_len`` and the free pages (no pre-emption for a draft). It counts each
token against the budget and takes their pages; :meth:`Scheduler.update` emits what the step kept,
cut at a stop, and moves the sequence back past the drafts it did not keep. The serving loop
collects a step with proposals before it plans the next (:attr:`StepPlan.proposes`: where its
rows stand is not known until then), and a sequence whose row is in flight sits the step out when
the tokens known so far propose a draft; so a sequence speculates without dispatching ahead, and
one that proposes nothing dispatches ahead as before. With ``speculative: draft`` the proposal is
the draft model's, made on the device in the step that produced the sequence's last token
(:attr:`StepResult.proposals`, kept as ``Request.proposed``): a running sequence then proposes
in every step it may, and never dispatches ahead.

Prefix caching (``enable_prefix_caching``): the pages are a :class:`~hypertron.serve.prefix_cache.
PagePool`. A sequence admitted shares the longest run of cached full pages of what it prefills
(its prompt, and what it generated before a pre-emption) that ends before its last token, so that
at least one token is prefilled and samples; the rest is prefilled as a chunk after them. Shared
pages are never written (a sequence writes only past them). A full page of a sequence, prompt or
generated, gets its key once the host knows its tokens and the step writing it is dispatched
(steps run in order, so a later step that shares it reads it written; never the same step).

:meth:`Scheduler.update` takes a step's result: each sequence's token (dropped if the
sequence ended meanwhile: with the engine running one step ahead, a sequence that hits EOS
in step n was already scheduled in step n + 1), its log-probabilities, the stops (EOS unless
``ignore_eos``, ``stop_token_ids``, ``max_tokens``, ``max_seq_len``), and returns
:class:`Output` records. A step's plan counts on every running sequence going on; only
``max_tokens`` and ``max_seq_len`` are known in advance, and a sequence is never scheduled
past them. Each step leaves a :class:`StepRecord` in :attr:`Scheduler.records`.

Written here rather than borrowed: vLLM's scheduler (the model for the token budget) is tied
to its own engine; this one needs only :mod:`hypertron.serve.types`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from hypertron.config import SchedulerConfig
from hypertron.config.serving import check_budget
from hypertron.serve.prefix_cache import PagePool, page_key
from hypertron.serve.sequences import (ABORT, ERROR, FINISHED, LENGTH, RUNNING, STOP, WAITING, Output, Request,
                                       StepRecord)
from hypertron.serve.speculative import Drafter, ModelDrafter
from hypertron.serve.types import Engine, Row, SamplingError, StepPlan, StepResult, TokenLogprobs

log = logging.getLogger(__name__)

def check_prompt(prompt, max_seq_len: int) -> None:
    """The one prompt-length rule of the serving loop: :class:`SamplingError` naming ``prompt``
    unless it is 1 .. ``max_seq_len - 1`` tokens (its first sampled token needs a place)."""
    if not 0 < len(prompt) < max_seq_len:
        raise SamplingError("prompt", f"'prompt' is {len(prompt)} tokens; expected 1 to {max_seq_len - 1}")


class Scheduler:
    """Requests, slots and pages; one :class:`~hypertron.serve.types.StepPlan` per step (see the
    module docstring). Not thread-safe: one thread calls it."""

    def __init__(self, engine: Engine, config: SchedulerConfig, *, step_overhead_tokens: float | None = None,
                 keep_records: int = 10_000):
        """Plans steps for ``engine`` (its slots, pages and limits) with ``config`` (held whole as
        :attr:`config`). ``step_overhead_tokens``: a step's fixed cost
        in tokens' worth, as the server measured it (None: new prompts share a step as they fit)."""
        check_budget(config.max_num_batched_tokens, engine.max_slots)
        if step_overhead_tokens is not None and not step_overhead_tokens >= 0:
            raise ValueError(f"step_overhead_tokens={step_overhead_tokens}: expected at least 0, or None")
        self.config = config
        self.max_slots, self.num_pages, self.page_size = engine.max_slots, engine.num_pages, engine.page_size
        self.max_seq_len, self.eos_ids = engine.max_seq_len, engine.eos_ids
        self.max_top_logprobs = engine.max_top_logprobs
        self.max_num_batched_tokens, self.max_prefill_rows = config.max_num_batched_tokens, config.max_prefill_rows
        self.step_overhead_tokens = step_overhead_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}  # by id, in admission order
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=keep_records)
        self._live: dict[int, Request] = {}
        self.pool = PagePool(self.num_pages, enabled=config.enable_prefix_caching)
        self._free_slots = list(range(self.max_slots - 1, -1, -1))
        self._hold = False  # after a pre-emption, until a sequence ends
        self._steps = itertools.count()
        self._order = itertools.count(1)
        self._out: list[Output] = []
        self.preemptions = 0
        self.mask_seconds = 0.0  # spent on guided rows' masks (hypertron.serve.structured)
        k = config.num_speculative_tokens
        if config.speculative == "draft" and not getattr(engine, "draft_k", 0):
            raise ValueError("speculative='draft' needs an engine with a draft model (PagedEngine's draft)")
        self.drafter = {"off": None, "draft": ModelDrafter(k)}.get(
            config.speculative, Drafter(k, config.prompt_lookup_min, config.prompt_lookup_max))

    # -- requests in and out ------------------------------------------------------------

    def check_prompt(self, prompt) -> None:
        """:func:`check_prompt` for this scheduler's ``max_seq_len``. Reads settings only, so the
        orchestrator calls it from the submitting thread."""
        check_prompt(prompt, self.max_seq_len)

    def add(self, seq: Request) -> None:
        """Queue a sequence (its prompt as :meth:`check_prompt` takes, its seed set)."""
        self.check_prompt(seq.prompt)
        if seq.sampling.seed is None:
            raise ValueError("the sampling seed must be set before scheduling")
        self._live[seq.id] = seq
        self.waiting.append(seq)

    def abort(self, seq: Request) -> None:
        """End ``seq`` now, wherever it is, without an output (its consumer went away or stopped)."""
        if seq.status != FINISHED and seq.id in self._live:
            self._finish(seq, ABORT, emit=False)

    def finish_all(self, reason: str, error: str | None = None) -> None:
        """End every sequence (the server is stopping, or a step failed)."""
        for seq in list(self._live.values()):
            self._finish(seq, reason, error)

    def take_outputs(self) -> list[Output]:
        """The outputs since the last call."""
        out, self._out = self._out, []
        return out

    @property
    def has_work(self) -> bool:
        return bool(self._live)

    def stats(self) -> dict[str, int]:
        """Gauges (``pages_free`` counts cached free pages; ``pages_cached``: pages holding a key)
        and the prefix cache's counters (tokens looked up at admissions, and found)."""
        return {"slots_in_use": len(self.running), "slots_total": self.max_slots,
                "pages_free": self.pool.num_free, "pages_total": self.num_pages, "waiting": len(self.waiting),
                "pages_cached": self.pool.num_cached, "prefix_queries": self.pool.queries,
                "prefix_hits": self.pool.hits}

    def reset_prefix_cache(self) -> int:
        """Drop the cached pages no sequence holds; returns how many."""
        return self.pool.reset()

    # -- one step -----------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The next step's plan (slots, pages and positions taken for it), or None: nothing to run."""
        budget = self.max_num_batched_tokens
        decodes: list[Row] = []
        prefills: list[Row] = []
        preempted: list[int] = []
        for seq in list(self.running.values()):
            if seq.status != RUNNING or seq.computed < len(seq.fill) or not self._goes_on(seq) or self._sits_out(seq):
                continue
            while seq.status == RUNNING and not self._page_for(seq, seq.computed):
                if len(self.running) == 1:  # alone and still no page: the cache is full for it
                    if not seq.rows_in_flight:  # (once the tokens of steps in flight are in)
                        self._finish(seq, LENGTH)
                    break
                victim = max(self.running.values(), key=lambda s: s.admitted)
                self._preempt(victim)
                preempted.append(victim.id)
            if seq.status != RUNNING or seq.computed // self.page_size >= len(seq.pages):
                continue
            decodes.append(Row(seq.id, seq.slot, seq.computed, (), tuple(seq.pages), seq.sampling,
                               adapter=seq.adapter, guided=seq.guide is not None))
            seq.computed += 1
            budget -= 1
        for seq in list(self.running.values()):  # prompts partly in the cache: their next chunk
            if budget == 0 or len(prefills) == self.max_prefill_rows:
                break
            if seq.computed < len(seq.fill):
                prefills.append(self._chunk(seq, budget))
                budget -= prefills[-1].num_tokens
        if not preempted and not (self._hold and self.running):
            rows = min(self.max_prefill_rows, self._group(len(decodes), prefills))
            while budget and self._free_slots and len(prefills) < rows and self.waiting:
                if prefills and self._prefill_length(self.waiting[0]) > budget:
                    break  # it would be split: it starts the next step whole (or as that step's first chunk)
                admitted = self._admit(self.waiting[0], busy=bool(self.running))
                if admitted is None:
                    continue  # it could never fit: ended, try the next
                if not admitted:
                    break
                prefills.append(self._chunk(self.waiting.popleft(), budget, first=True))
                budget -= prefills[-1].num_tokens
        if self.drafter is not None:
            decodes = self._propose(decodes, budget)
        if isinstance(self.drafter, ModelDrafter):
            decodes, prefills = self._lookahead(decodes), self._lookahead(prefills)
        if not decodes and not prefills:
            return None
        rows = decodes + prefills
        for row in rows:
            seq = self._live[row.request]
            seq.rows_in_flight += 1
            seq.tokens_in_flight += row.sample
            self._key_pages(seq)  # after every admission: a page is never shared in the step writing it
        plan = StepPlan.of(next(self._steps), tuple(decodes), tuple(prefills))
        self.records.append(StepRecord(plan.step, tuple(r.request for r in decodes),
                                       tuple((r.request, r.start, r.num_tokens) for r in prefills),
                                       tuple(preempted), plan.num_tokens))
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> None:
        """Take what ``plan``'s step produced (:meth:`take_outputs` then has the outputs)."""
        for i, row in enumerate(plan.rows):
            seq = self._live.get(row.request)
            if seq is None:  # it ended while this step ran: what it produced is dropped
                continue
            seq.rows_in_flight -= 1
            if row.prompt_targets is not None and result.prompt is not None:
                self._add_prompt_logprobs(seq, row, result.prompt[i - len(plan.decodes)])
            if not row.sample:
                continue
            seq.tokens_in_flight -= 1
            emitted = result.count(i)
            if row.draft:
                self._verified(seq, row, emitted)
            for j in range(emitted):
                n = seq.sampling.logprobs
                self._emit(seq, result.token(i, j), None if n is None else result.logprobs_of(i, j, n))
                if seq.status == FINISHED:  # what it emitted after its stop is dropped
                    break
            if result.proposals is not None:  # the draft model's, after its last token
                seq.proposed = (len(seq.prompt) + len(seq.generated), result.proposals[i].tolist())
            if seq.status == RUNNING:
                self._key_pages(seq)

    def fail(self, plan: StepPlan, error: str) -> None:
        """A step failed for these rows: end their sequences with ``"error"`` (``error`` is what the
        client sees, with the request's id appended) and give back their slots and pages."""
        for row in plan.rows:
            for page in row.pages[row.start // self.page_size:self._pages_for(row.end)]:
                self.pool.forget(page)  # what the row writes may not be there
            seq = self._live.get(row.request)
            if seq is not None:
                self._finish(seq, ERROR, f"{error} (request {seq.id})")

    # -- helpers ------------------------------------------------------------------------

    def _sits_out(self, seq: Request) -> bool:
        """Whether a speculating ``seq`` skips this step: a verify row of it is in flight (where it
        will stand is not known yet), or a row is and its tokens known so far would propose a draft
        (the next step, with that row's token in, can verify one). A sequence that sits out a step
        is dispatched after its last one is collected, as without dispatching ahead."""
        if self.drafter is None or seq.guide is not None or not seq.rows_in_flight:
            return False
        known = seq.prompt + seq.generated  # the row in flight adds one
        return seq.verifying or self.drafter.will_propose(known, self._room(seq, len(known) + 1), seq)

    def _propose(self, decodes: list[Row], budget: int) -> list[Row]:
        """``decodes``, those whose sequence has nothing in flight (its last token known) and whose
        tokens propose a draft with it as their :attr:`Row.proposal`, within what is left of the
        step's budget (proposals get it last), ``max_tokens``, ``max_seq_len`` and the free pages
        (never a pre-emption for a proposal)."""
        out = []
        for row in decodes:
            seq = self._live[row.request]
            known = seq.prompt + seq.generated
            limit = min(budget, self._room(seq, len(known)))
            draft = [] if seq.rows_in_flight or seq.guide is not None else self.drafter.propose(known, limit, seq)
            for i in range(len(draft)):
                if not self._page_for(seq, row.start + 1 + i):
                    draft = draft[:i]
                    break
            if draft:
                assert row.start == len(known) - 1, (row, len(known))
                budget -= len(draft)
                seq.computed += len(draft)
                seq.verifying = True
                row = dataclasses.replace(row, pages=tuple(seq.pages), proposal=tuple(draft))
            out.append(row)
        return out

    def _lookahead(self, rows: list[Row]) -> list[Row]:
        """``rows``, each sampling row that is not guided with the pages the draft model writes its
        proposal's keys into (its next ``k`` positions past the row's, as many as the next row may
        verify: :meth:`_room`), while more pages are empty than sequences run: a draft's pages
        never pre-empt nor evict a cached prefix; without them its keys go to the null page, and
        the draft past them is worse, not wrong."""
        out = []
        for row in rows:
            seq = self._live[row.request]
            if row.sample and not row.guided:
                for position in range(row.end, row.end + min(self.drafter.k, self._room(seq, row.end + 1))):
                    if position // self.page_size >= len(seq.pages) and (
                            self.pool.num_empty <= len(self.running) or not self._page_for(seq, position)):
                        break
                row = dataclasses.replace(row, pages=tuple(seq.pages))
            out.append(row)
        return out

    def _room(self, seq: Request, length: int) -> int:
        """The most tokens ``seq``, once ``length`` long, may propose: its next row emits one more,
        within ``max_tokens`` and ``max_seq_len``."""
        return min(seq.sampling.max_tokens - (length - len(seq.prompt)), self.max_seq_len - length) - 1

    def _verified(self, seq: Request, row: Row, emitted: int) -> None:
        """A row of ``seq`` with a proposal emitted ``emitted`` tokens: its sequence stands after them (the
        drafts it did not keep are written past that, and written over later) and is counted."""
        seq.verifying = False
        if seq.status == RUNNING:
            seq.computed -= row.draft - (emitted - 1)
        self.drafter.verified(row.draft, emitted)

    def _group(self, decodes: int, prefills: list[Row]) -> int:
        """The prompts this step's prefill should hold (those in it already and new ones), to
        minimise the mean time to a first token (see the module docstring)."""
        if self.step_overhead_tokens is None or not self.waiting:
            return self.max_prefill_rows
        cap = min(len(self.waiting), len(self._free_slots), self.max_prefill_rows - len(prefills))
        if cap <= 0:
            return self.max_prefill_rows  # nothing can start: the admission loop stops by itself
        lengths = [len(r.tokens) for r in prefills]
        lengths += [self._prefill_length(s) for s in itertools.islice(self.waiting, cap)]
        return group_size(len(lengths), sum(lengths) / len(lengths), self.step_overhead_tokens + decodes)

    def _goes_on(self, seq: Request) -> bool:
        """Whether another token may be sampled: not at max_tokens or max_seq_len yet."""
        return seq.outputs < seq.sampling.max_tokens and len(seq.prompt) + seq.outputs < self.max_seq_len

    def _prefill_length(self, seq: Request) -> int:
        """The tokens ``seq`` would prefill if admitted now: its prompt and what it generated before
        a pre-emption, less what it would find cached."""
        n = len(seq.prompt) + len(seq.generated)
        return n - len(self._cached_prefix(seq, n)) * self.page_size

    def _cached_prefix(self, seq: Request, n: int) -> list[int]:
        """The cached pages ``seq`` can share of its first ``n`` tokens: full pages, ending before
        the last token (it is prefilled and samples); none when its prompt's log-probabilities are wanted."""
        if not self._looks_up(seq):
            return []
        return self.pool.cached_prefix(self._key(seq, i) for i in range((n - 1) // self.page_size))

    def _looks_up(self, seq: Request) -> bool:
        """Whether ``seq`` may share cached pages: not when its prompt's log-probabilities are
        computed (every prompt position's logits are)."""
        return self.pool.enabled and not (seq.want_prompt_logprobs and not seq.generated)

    def _key(self, seq: Request, i: int) -> bytes:
        """The key of ``seq``'s page ``i`` (its tokens known): computed once, from page 0 on."""
        ps, n = self.page_size, len(seq.prompt)
        while len(seq.keys) <= i:
            a, b = len(seq.keys) * ps, (len(seq.keys) + 1) * ps
            tokens = seq.prompt[a:b] + seq.generated[max(a - n, 0):max(b - n, 0)]
            seq.keys.append(page_key(seq.keys[-1] if seq.keys else None, tokens, seq.cache_salt, seq.adapter_key))
        return seq.keys[i]

    def _key_pages(self, seq: Request) -> None:
        """Key ``seq``'s full pages whose tokens are known and whose writes are dispatched."""
        if not self.pool.enabled:
            return
        full = min(seq.computed, len(seq.prompt) + len(seq.generated), len(seq.pages) * self.page_size)
        for i in range(seq.keyed, full // self.page_size):
            self.pool.register(seq.pages[i], self._key(seq, i))
        seq.keyed = max(seq.keyed, full // self.page_size)

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _page_for(self, seq: Request, position: int) -> bool:
        """Take the page ``position`` is written into, if ``seq`` has none yet; False if none is free."""
        if position // self.page_size < len(seq.pages):
            return True
        page = self.pool.take()
        if page is None:
            return False
        seq.pages.append(page)
        return True

    def _admit(self, seq: Request, busy: bool) -> bool | None:
        """Give ``seq`` (first in the queue) a slot and the pages of its prompt: True; False to
        wait; None when it can never fit (it is ended)."""
        if seq.rows_in_flight:  # pre-empted while a step of it ran: take its token first
            return False
        fill = seq.prompt + seq.generated
        shared = self._cached_prefix(seq, len(fill))
        free = self.pool.num_free - sum(self.pool.refs[p] == 0 for p in shared)  # cached free pages count
        if free < self._pages_for(len(fill) + 1) - len(shared):
            if busy:
                return False  # running sequences will end and give pages back
            self._finish(seq, LENGTH)  # it does not fit even into an empty cache
            return None
        self.pool.share(shared)
        cached = len(shared) * self.page_size
        if self._looks_up(seq):
            self.pool.queries, self.pool.hits = self.pool.queries + len(fill), self.pool.hits + cached
        if seq.cached_tokens is None:
            seq.cached_tokens = cached
        seq.fill, seq.computed, seq.keyed, seq.status = fill, cached, len(shared), RUNNING
        seq.pages = shared + [self.pool.take() for _ in range(self._pages_for(len(fill)) - len(shared))]
        seq.slot, seq.admitted = self._free_slots.pop(), next(self._order)
        seq.prompt_logprobs = [] if seq.want_prompt_logprobs and not seq.generated else None
        self.running[seq.id] = seq
        return True

    def _chunk(self, seq: Request, budget: int, first: bool = False) -> Row:
        """``seq``'s next chunk within ``budget``; the ``first`` after its admission carries the
        tokens it found cached (``Row.prefix``)."""
        start = seq.computed
        n = min(len(seq.fill) - start, budget)
        seq.computed += n
        targets = None
        if seq.prompt_logprobs is not None:
            targets = tuple(seq.fill[p + 1] if p + 1 < len(seq.fill) else -1 for p in range(start, start + n))
        sample = seq.computed == len(seq.fill)
        return Row(seq.id, seq.slot, start, tuple(seq.fill[start:start + n]), tuple(seq.pages), seq.sampling,
                   sample=sample, prompt_targets=targets, prefix=tuple(seq.fill[:start]) if first else (),
                   adapter=seq.adapter, guided=sample and seq.guide is not None)

    def masks(self, plan: StepPlan) -> list:
        """Each row's allowed samples for :meth:`Engine.sample_guided`: a guided row's grammar's
        mask, None for the others (and for a sequence that ended meanwhile). Call once every step
        before ``plan``'s is collected (so each guide has its sequence's tokens but the one this
        step samples); timed into :attr:`mask_seconds`."""
        start = time.perf_counter()
        seqs = [self._live.get(row.request) if row.guided else None for row in plan.rows]
        seqs = [s if s is not None and s.guide is not None else None for s in seqs]
        guided = [s for s in seqs if s is not None]
        out = [None] * len(seqs)
        try:  # all at once (the guides' own batch: llguidance's executor, over its threads)
            batch = dict(zip(map(id, guided), guided[0].guide.masks_of([s.guide for s in guided]))) if guided else {}
        except Exception:  # then one at a time, so that only the guide that fails ends its request
            log.warning("step %d: the guided rows' masks failed at once; computing them one by one", plan.step)
            batch = {}
        for i, seq in enumerate(seqs):
            if seq is None:
                continue
            if id(seq) in batch:
                out[i] = batch[id(seq)]
                continue
            out[i], failed = self._guarded(seq, seq.guide.mask)
            if failed:
                self._finish(seq, ERROR, f"the grammar failed: {failed} (request {seq.id})")
        self.mask_seconds += time.perf_counter() - start
        return out

    @staticmethod
    def _guarded(seq: Request, call) -> tuple[Any, str]:
        """``(what call returned, "")``, or ``(None, its exception as text)``: a call of ``seq``'s
        guide that raises ends that one request, never the serving loop (logged with its traceback)."""
        try:
            return call(), ""
        except Exception as e:
            log.exception("request %d: its grammar failed", seq.id)
            return None, f"{type(e).__name__}: {e}"

    def _add_prompt_logprobs(self, seq: Request, row: Row, prompt) -> None:
        if seq.prompt_logprobs is None or prompt is None:
            return
        chosen, ids, lps = prompt
        n = seq.sampling.logprobs or 0
        for j, target in enumerate(row.prompt_targets):
            if target >= 0:
                seq.prompt_logprobs.append(TokenLogprobs(float(chosen[j]), tuple(int(t) for t in ids[j][:n]),
                                                         tuple(float(v) for v in lps[j][:n])))

    def _emit(self, seq: Request, token: int, logprobs: TokenLogprobs | None) -> None:
        s = seq.sampling
        prompt_lps = None
        if seq.prompt_logprobs is not None and not seq.generated:
            prompt_lps, seq.prompt_logprobs = seq.prompt_logprobs, None
            self._out.append(Output(seq, prompt_logprobs=prompt_lps))
        if seq.guide is not None:
            ok, refused = self._guarded(seq, lambda: seq.guide.consume(token))
            refused = refused or seq.guide.error or ("" if ok else "it is not allowed")
            if refused:  # the mask allowed it, so the grammar's own error (a limit met), or a bug
                self._finish(seq, ERROR, f"the grammar failed at token {token}: {refused} (request {seq.id})")
                return
            if token in self.eos_ids:  # where the grammar accepts, ignore_eos or not: the request ends here
                self._finish(seq, STOP)
                return
        if (token in self.eos_ids and not s.ignore_eos) or token in s.stop_token_ids:
            self._finish(seq, STOP)
            return
        seq.generated.append(token)
        self._out.append(Output(seq, token, logprobs if s.logprobs is not None else None))
        if seq.guide is not None and seq.guide.done:
            self._finish(seq, STOP)
        elif len(seq.generated) >= s.max_tokens or len(seq.prompt) + len(seq.generated) >= self.max_seq_len:
            self._finish(seq, LENGTH)

    def _release(self, seq: Request) -> None:
        """Give back ``seq``'s slot and pages (the engine may still be running a step that writes
        them; steps run in order, so the next owner's writes come after)."""
        self.pool.release(seq.pages)
        self._free_slots.append(seq.slot)
        seq.pages, seq.slot, seq.keyed = [], None, 0
        del self.running[seq.id]

    def _preempt(self, seq: Request) -> None:
        self.preemptions += 1
        self._release(seq)
        seq.status, seq.fill, seq.computed = WAITING, [], 0
        self.waiting.appendleft(seq)
        self._hold = True

    def _finish(self, seq: Request, reason: str, error: str | None = None, emit: bool = True) -> None:
        if seq.status == RUNNING:
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = FINISHED, reason
        self._live.pop(seq.id, None)
        self._hold = False
        if emit:
            self._out.append(Output(seq, finish_reason=reason, error=error))


def group_size(n: int, length: float, fixed: float) -> int:
    """How many of ``n`` prompts of ``length`` tokens to prefill per step, for the least mean time
    to their first tokens, when a step costs ``fixed + tokens`` (in tokens' worth): the g in
    1 .. n whose groups (g prompts each, the rest in the last) give the least sum of the prompts'
    finishing times (ties: the larger g)."""
    if n <= 1 or math.isinf(fixed):
        return max(n, 1)

    def total(g: int) -> float:  # group j < k of g prompts ends at j (fixed + g length); the last at k fixed + n length
        k = -(-n // g)
        return g * (fixed + g * length) * (k - 1) * k / 2 + (n - (k - 1) * g) * (k * fixed + n * length)

    return min(range(1, n + 1), key=lambda g: (total(g), -g))


def sample_guided(engine: Engine, scheduler: Scheduler, plan: StepPlan, handle) -> None:
    """Sample ``plan``'s guided rows, if it has any (see the module docstring): once the step
    before it is collected, before it is and before the next is dispatched."""
    if any(r.guided for r in plan.rows):
        engine.sample_guided(handle, scheduler.masks(plan))


def run_until_done(engine: Engine, scheduler: Scheduler, on_output: Callable[[Output], None],
                   *, ahead: bool = False) -> int:
    """Step ``engine`` through ``scheduler``'s plans until no sequence is left; each output goes
    to ``on_output`` (which may :meth:`Scheduler.abort` its sequence). ``ahead``: dispatch step
    n + 1 before collecting step n, as the server does (but after a step with proposals,
    :attr:`StepPlan.proposes`). Returns the steps run."""
    pending, steps = None, 0
    while scheduler.has_work or pending:
        plan = scheduler.schedule() if scheduler.has_work else None
        if plan is None and pending is None:
            raise RuntimeError(f"the scheduler has sequences but nothing to run: {scheduler.stats()}")
        current = (plan, engine.dispatch(plan)) if plan is not None else None
        if pending is not None:
            scheduler.update(pending[0], engine.collect(pending[1]))
        if current is not None:
            sample_guided(engine, scheduler, *current)
            if not ahead or plan.proposes:
                scheduler.update(plan, engine.collect(current[1]))
                current = None
        pending = current
        for out in scheduler.take_outputs():
            on_output(out)
        steps += plan is not None
    return steps
