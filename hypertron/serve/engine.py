"""The serving engine: one jitted step runs a scheduler's plan over the paged KV cache.

A step (:func:`hypertron.serve.device_step.step`) takes the tokens of many sequences in one flat row: first one decode token
per running sequence, then the prefill chunks (a whole short prompt, several of them, or a
chunk of a long one), and runs the model once over all of them, so the weights are read once
per step whatever its mix; every row attends in one call of the ragged paged attention
(:class:`hypertron.models.PagedCache`).
Each token's keys and values go straight into its sequence's pages. Logits are computed only
where a token is sampled (the decode rows and the last chunk of a prompt), unless prompt
log-probabilities were asked for; each row samples with its own temperature, top-k, top-p and
seed, and log-probabilities (of the model's distribution, before temperature, top-k and top-p,
as OpenAI's and vLLM's are; with the top ``max_top_logprobs``) are computed only in steps where
some request asked for them: a second compiled variant, not one per request.

Each slot's sequence lives on the device (:attr:`PagedEngine.state`, one more entry than slots:
the extra one takes the writes of padding and of rows that sample nothing): ``seq_lens`` (the
positions written), the page table ``table [max_slots + 1, pages_per_seq]`` (null past its
pages), ``last_tokens`` (what it sampled last: a decode row's input) and ``history
[max_slots + 1, max_seq_len]`` (its tokens, ``history[s, :seq_lens[s] + 1]`` once its last row
sampled). The host sends only what changed: before a step, the table entries that differ from
what the device holds (:func:`~hypertron.serve.device_step.write_deltas`: a slot's new pages; a slot's whole row when another
sequence took it) and the tokens of a prefix found cached at admission (``Row.prefix``); the
step itself writes its prefill tokens and its samples into ``history`` and its lengths into
``seq_lens``, and gathers each row's table on the device. So a step uploads per row a handful of
numbers and per new token or page one, not rows x pages. A decode row's input never leaves the
device, so the host can dispatch step n + 1 before step n's tokens reach it
(:meth:`PagedEngine.dispatch` returns at once; :meth:`PagedEngine.collect` waits), and steps
run in the order they were dispatched: the cache and the state are donated to each step and
threaded through.

Shapes are padded so that compiles stay few: decode rows and prefill tokens by :func:`bucket`
(powers of two up to 8, then under 25 % padding; prefill tokens at least 16); prefill rows to a
power of two. A step reads each row's whole page-table row (the attention stops at each row's
length), so lengths add no shapes.

A :class:`Shape` is one compiled step. Compiling one takes about a second on a CPU and a load meets
dozens, so a server does not wait for them (``compile="background"``): a plan whose own shape
is not compiled yet runs padded to the cheapest compiled shape that holds it (the same tokens:
padding rows and tokens are masked out); its own shape compiles on a background thread at once if
that costs over ``MAX_PADDED_COST`` (4) times as much (:meth:`PagedEngine.cost`, which counts the
attention's slower blocks of a shape compiled for shorter rows), else once it has run padded 8
times at over 1.25 times its cost; with no compiled shape that holds it, the step waits for its
own. What compiles is its own shape with, if
it has prefill rows, as many decode rows as cost under 1.25 times as much
(:meth:`PagedEngine.widened`), so one compile holds a prompt's chunk beside as many decode rows. A server compiles
:meth:`PagedEngine.largest_shape` in the background at its start, so that only a plan of a
log-probability variant not met yet waits, and then the shapes its last run compiled
(:class:`~hypertron.serve.shapes.ShapeMemory`, loaded from JAX's persistent compilation cache).
Without it (``hypertron generate``, most tests), a shape is compiled the first time a plan needs it.
Engines of one process share their compiled steps: one whose model, settings and step shape match
another's uses that one's executable (:data:`SHARED_EXECUTABLES`).

Sampling is repeatable: the key of the token at position ``p`` is ``fold_in(key(seed), p)``,
whatever else is in the step. A guided row (structured output) is sampled apart, once its grammar's
mask is known (:meth:`PagedEngine.sample_guided`): the step keeps the logits of a plan with guided
rows on the device for it.

The pages, slots and requests themselves are the scheduler's (:mod:`hypertron.serve.scheduler`);
this module only runs plans.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import math
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config import EngineConfig, ModelConfig, SchedulerConfig
from hypertron.config.serving import MAX_PADDED_COST
from hypertron.models import resolve_dtype, unstack_layers
from hypertron.models.flops import dense_flops_per_token
from hypertron.models.kv_pages import NULL_PAGE
from hypertron.padding import bucket, next_pow2
from hypertron.serve.device_step import init_state, mask_words, sample_masked, step, write_deltas
from hypertron.serve.placement import engine_mesh, new_pages, place_weights, place_whole
from hypertron.serve.shapes import Shape, prefill_bucket, step_flops
from hypertron.serve.step_batch import StepBatch
from hypertron.serve.types import DraftModel, StepCost, StepPlan, StepResult

log = logging.getLogger(__name__)

# With background compiles, a plan whose shape is not compiled yet runs padded to the cheapest compiled
# shape that holds it; it waits for its own only when none does. Its own is compiled in the background
# at once if the padded one costs over MAX_PADDED_COST (hypertron.config.schema) times its own
# (PagedEngine.cost), and not at all if under CLOSE_ENOUGH_COST times (as much padding as a bucket
# allows): on a CPU a compile takes a core for a second, and the shapes a load meets keep coming, so
# near enough is left alone. A step padded even 10x costs less than waiting for a compile (on this
# project's CPU a 16-row decode step of the HTTP bench's model takes 17 ms, a compile about a second;
# on an H100 llama-1b's step some ms, its compile 7 s), and a load meets new shapes long after its
# warm-up (docs/benchmarks.md: the prefix-caching runs of 2026-11-26).
CLOSE_ENOUGH_COST = 1.25
# ... and in between only once it has run padded this many times: a shape a load meets rarely is
# not worth a core for a second.
COMPILE_AFTER_PADDED = 8
# A step's fixed cost, once measured, counts in PagedEngine.cost up to this many tokens' worth (on an
# accelerator a step of a few hundred tokens may cost about what one of one token does).
MAX_OVERHEAD_TOKENS = 1e6
# Table entries and history tokens written before a step (write_deltas): at least this many, padded to a
# power of two, so that few sizes compile.
MIN_PAGE_WRITES = 16
MIN_TOKEN_WRITES = 64
# A step with proposals (speculative decoding) feeds each decode row `verify + 1` queries and samples after
# each, verify a power of two at least this: one variant for every proposal of up to 4 tokens (a row's
# padding queries cost less than another compiled shape).
MIN_VERIFY = 4
# Compiled steps are shared by every engine of a process with the same model shapes, settings and
# step shape (the most recent this many): a second engine on the same model (a bench's sweep, a
# test's reference engine) does not compile its steps again.
SHARED_EXECUTABLES = 512


@dataclasses.dataclass
class _Pending:
    """A dispatched step: its plan, the shape it ran as, where its prefill rows' tokens start,
    its outputs (device arrays, on their way to the host), and what the host spent on it
    (``assemble``: building its arrays; ``wait``: in :meth:`PagedEngine.collect`, for its outputs;
    seconds, for the server's step breakdown)."""

    plan: StepPlan
    shape: Shape
    prefill_offsets: list[int]
    out: dict
    times: dict[str, float] = dataclasses.field(default_factory=dict)
    logits: object = None  # a guided step's logits until sample_guided takes them
    guided: dict | None = None  # sample_guided's outputs
    sampler: object = None  # the guided shape's compiled sample_masked

    @property
    def rows(self) -> list[int]:
        """Where each of the plan's rows sits in the step: decode rows first, prefill rows after
        the shape's ``num_decode``."""
        nd, plan = self.shape.num_decode, self.plan
        return list(range(len(plan.decodes))) + [nd + j for j in range(len(plan.prefills))]


@dataclasses.dataclass(frozen=True)
class _Guided:
    """A guided shape's compiled step, and its sampler (:func:`~hypertron.serve.device_step.
    sample_masked` for its rows) compiled with it."""

    step: object
    sample: object

    def __call__(self, *args):
        return self.step(*args)


def _spec(x):
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, np.ndarray) else x


_shared: collections.OrderedDict[tuple, object] = collections.OrderedDict()  # SHARED_EXECUTABLES, oldest first
_shared_lock = threading.Lock()


def clear_shared_executables() -> None:
    """Forget the compiled steps engines share, so that the next engine compiles its own: for a
    bench that times compiles (``bench/gpu_measure.py``'s serving-layers rows)."""
    with _shared_lock:
        _shared.clear()


class PagedEngine:
    """Runs :class:`~hypertron.serve.types.StepPlan` s over a page pool; implements
    :class:`hypertron.serve.types.Engine`.

    ``config`` (:class:`~hypertron.config.EngineConfig`, checked when made) is held whole as
    :attr:`config`. Its ``num_pages`` is the pool, page 0 included (it is the null page, never
    handed out); None: enough for every slot at ``max_seq_len``. :attr:`state` holds each slot's
    length, page table, last token and token history on the device (see the module docstring);
    each row's ``pages`` are compared with what its slot holds, and only the difference is sent.
    With ``compile="background"``, a plan whose shape is not compiled yet runs padded to a compiled one that holds it at little
    more cost, if any, while its own compiles on a background thread (see the module docstring). :attr:`compiles` counts the
    compiles (``sync``: a step waited for it; ``background``) and the steps that ran padded to a
    larger compiled shape (``padded``); :attr:`compile_seconds` is the time they took (a step
    another engine of this process had compiled counts nothing). The layers run unrolled from per-layer weights
    (:func:`hypertron.models.unstack_layers`; :attr:`params` holds them so): faster steps, longer
    compiles for deep models; ``scan_layers=True`` scans the stacked weights instead (as MaxText's
    option of that name does; training scans them).
    """

    def __init__(self, params, cfg: ModelConfig, config: EngineConfig, *, eos_ids: frozenset[int] = frozenset(),
                 scan_layers: bool = False, lora=None, draft: DraftModel | None = None):
        self.mesh = engine_mesh(cfg, config, draft and draft.cfg)  # None: one device (serve.placement)
        params = place_weights(self.mesh, cfg, params)
        self.params = params if scan_layers else unstack_layers(params)
        self.lora, self._attached = lora, (-1, None)  # LoRA adapters (serve.lora_slots.LoraSlots), and their weights
        self.cfg, self.config = cfg, config
        max_slots, page_size, max_top_logprobs = config.max_slots, config.page_size, config.max_top_logprobs
        self.max_slots, self.page_size, self.max_top_logprobs = max_slots, page_size, max_top_logprobs
        self.max_seq_len, self.eos_ids = cfg.max_seq_len, frozenset(eos_ids)
        self.accelerator = jax.default_backend() != "cpu"
        self.vocab_size = cfg.vocab_size
        self.pages_per_seq = math.ceil(cfg.max_seq_len / page_size)
        total = config.pool_pages(cfg.max_seq_len)
        self.num_pages = total - 1
        kv = config.kv_cache_dtype
        self.kv_dtype = resolve_dtype(cfg.dtype) if kv == "auto" else jnp.dtype(kv)
        self.cache = new_pages(self.mesh, cfg, total, page_size, self.kv_dtype)
        # A draft model (speculative decoding): its weights and its own pool of as many pages, the same ids
        self.draft_cfg, self.draft_k = (None, 0) if draft is None else (draft.cfg, draft.k)
        self.draft_params = None if draft is None else unstack_layers(place_weights(self.mesh, draft.cfg, draft.params))
        self.draft_cache = None if draft is None else new_pages(self.mesh, draft.cfg, total, page_size, self.kv_dtype)
        self.state = place_whole(self.mesh, init_state(max_slots, self.pages_per_seq, cfg.max_seq_len))
        self._tables: list[tuple[int, ...]] = [()] * max_slots  # the pages state["table"] holds per slot
        # What a step is compiled for: the arguments' shapes (the cache is donated to each step, so
        # a background compile must not look at the live arrays).
        self._specs = jax.tree.map(_spec, (self.step_params(), self.cache, self.state, self.draft_params,
                                           self.draft_cache))
        leaves, treedef = jax.tree.flatten(self._specs)  # and below: what a compiled step depends on, but its shape
        self._key = (tuple(leaves), treedef, cfg, max_top_logprobs, self.draft_cfg, self.draft_k)
        self.background_compile = config.compile == "background"
        self.compiles = {"sync": 0, "background": 0, "padded": 0}
        self.compile_seconds = 0.0
        self.step_overhead_flops = 0.0  # a step's fixed cost in FLOPs' worth (measure_step_cost sets it)
        self.on_compiled = None  # called with each shape compiled, after its compile, on the compiling thread
        self._compiled: dict[Shape, object] = {}
        self._lock = threading.Lock()
        self._todo: queue.Queue[Shape | None] = queue.Queue()
        self._queued: set[Shape] = set()
        self._padded: collections.Counter[Shape] = collections.Counter()
        self._compiler: threading.Thread | None = None

    def step_params(self):
        """What a step takes as its weights: :attr:`params`, with the LoRA slots' attached."""
        if self.lora is None:
            return self.params
        if self._attached[0] != self.lora.version:
            self._attached = (self.lora.version, self.lora.attach(self.params))
        return self._attached[1]

    # -- shapes and compiles --------------------------------------------------------------

    def shape(self, plan: StepPlan) -> Shape:
        """The bucketed shape of ``plan`` (what it runs as once that is compiled)."""
        dec, pre = plan.decodes, plan.prefills
        drafts = max((r.draft for r in dec), default=0)
        return Shape(num_decode=min(bucket(len(dec)), self.max_slots) if dec else 0,
                     prefill_rows=next_pow2(len(pre)) if pre else 0,
                     prefill_tokens=prefill_bucket(sum(len(r.tokens) for r in pre)) if pre else 0,
                     logprobs=plan.logprobs, prompt_logprobs=plan.prompt_logprobs,
                     lora=any(r.adapter >= 0 for r in plan.rows), guided=any(r.guided for r in plan.rows),
                     verify=max(next_pow2(drafts), MIN_VERIFY) if drafts else 0)

    def context(self, plan: StepPlan) -> int:
        """The keys :meth:`cost` counts each query of ``plan`` against: its longest row's."""
        return max(r.end for r in plan.rows)

    def cost(self, shape: Shape, keys: int = 0, queries_per_row: float | None = None) -> float:
        """:func:`~hypertron.serve.shapes.step_flops` of ``shape``, with the step's fixed cost
        once :meth:`measure_step_cost` has measured it. Without that, a decode of 1 row padded to 2
        looks twice as costly, where a step's fixed cost makes it barely more (on this project's
        CPU: 2 to 3 ms a step against 0.07 ms a token). A draft model's passes count too: the
        step's tokens, then ``draft_k`` decode steps of every row."""
        flops = step_flops(self.cfg, shape, keys, queries_per_row, self.step_overhead_flops)
        if self.draft_cfg is not None:
            rows = Shape(shape.num_decode + shape.prefill_rows, 0, 0)
            flops += step_flops(self.draft_cfg, shape, keys, queries_per_row) + self.draft_k * step_flops(
                self.draft_cfg, rows, keys)
        return flops

    @property
    def program_digest(self) -> str:
        """A digest of what a compiled step depends on but its shape: the model, the arguments'
        shapes and placement, JAX's version and backend (the name :class:`~hypertron.serve.shapes.ShapeMemory` keeps
        this engine's shapes under)."""
        key = repr((self._key, jax.__version__, jax.default_backend()))
        return hashlib.sha256(key.encode()).hexdigest()[:24]

    @property
    def queued_compiles(self) -> int:
        """Shapes queued for the background compiler or being compiled."""
        with self._lock:
            return len(self._queued)

    @property
    def compiled_shapes(self) -> list[Shape]:
        with self._lock:
            return list(self._compiled)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the background compiler: the shapes queued are dropped, the compile in hand is
        waited for at most ``timeout`` seconds (it finishes on its daemon thread)."""
        if self._compiler is not None:
            while True:
                try:
                    dropped = self._todo.get_nowait()
                except queue.Empty:
                    break
                with self._lock:
                    self._queued.discard(dropped)
            self._todo.put(None)
            self._compiler.join(timeout)
            self._compiler = None

    def measure_step_cost(self, tokens: int, repeats: int = 30) -> StepCost:
        """What a step costs here, measured: a step of one decode row and a prefill of ``tokens``
        tokens in one row (compiled now if not), in turn ``repeats`` times on padding alone (its writes
        go to the null page), the fastest of each kept (one step's time here varies by 2x and more
        from run to run). Call it before serving: the steps take the cache. From then on :meth:`cost` counts the fixed part
        (at most :data:`MAX_OVERHEAD_TOKENS` tokens' worth). On a CPU a prefill timed within 5 % of
        the decode says the machine was busy, not that tokens are free (counted so, every step would run padded to the largest compiled shape for good):
        ``per_token`` is then NaN and no fixed part is counted."""
        tokens = prefill_bucket(tokens)
        shapes = (Shape(num_decode=1, prefill_rows=0, prefill_tokens=0),
                  Shape(num_decode=0, prefill_rows=1, prefill_tokens=tokens))
        runs = []
        for shape in shapes:
            with self._lock:
                fn = self._compiled.get(shape)
            if fn is None:
                fn = self._compile(shape)
                self.compiles["sync"] += 1
            runs.append((fn, self._empty_batch(shape).array))
        times = [math.inf] * len(runs)
        for r in range(repeats + 1):  # the first round warms up
            for i, (fn, batch) in enumerate(runs):
                t = time.perf_counter()
                jax.device_get(self._call(fn, batch))
                if r:
                    times[i] = min(times[i], time.perf_counter() - t)
        per_token = max(times[1] - times[0], 0.0) / (tokens - 1)
        cost = StepCost(max(times[0] - per_token, 0.0), per_token)
        if self.accelerator or times[1] > 1.05 * times[0]:  # on a CPU a prefill costs a decode many times over
            self.step_overhead_flops = min(cost.overhead_tokens, MAX_OVERHEAD_TOKENS) * dense_flops_per_token(self.cfg)
        else:  # on a CPU compute grows with the tokens: a step of many no dearer than one was timed on a busy
            # machine (or, before write_tokens kept a one-token write a scatter, on a large pool: 2026-11-26)
            cost = StepCost(cost.fixed, math.nan)
        return cost

    def _executable(self, exact: Shape, keys: int = 0) -> tuple[Shape, object]:
        """The compiled step a plan of shape ``exact`` (its queries against ``keys`` keys, for
        :meth:`cost`) runs as: its own; with ``compile="background"``, else the cheapest compiled
        one that holds it (a shape :meth:`widened` from its own queued as the module docstring
        says); else its own (widened, with ``compile="background"``), compiled now."""
        with self._lock:
            fn = self._compiled.get(exact)
            holders = [s for s in self._compiled if s.holds(exact)] if fn is None and self.background_compile else []
        if fn is not None:
            return exact, fn
        cost = functools.partial(self.cost, keys=keys, queries_per_row=exact.queries_per_row)
        if holders:
            shape = min(holders, key=cost)
            ratio = cost(shape) / cost(exact)
            if ratio > CLOSE_ENOUGH_COST:
                self._padded[exact] += 1
                if ratio > MAX_PADDED_COST or self._padded[exact] >= COMPILE_AFTER_PADDED:
                    self._enqueue(self.widened(exact, keys))
            self.compiles["padded"] += 1
            with self._lock:
                return shape, self._compiled[shape]
        self.compiles["sync"] += 1
        own = self.widened(exact, keys) if self.background_compile else exact
        log.info("compiling %s now (%d compiled, none holds it)", own, len(self._compiled))
        return own, self._compile(own)

    def widened(self, exact: Shape, keys: int = 0) -> Shape:
        """``exact`` with prefill rows, with the most decode rows (a bucket, at most ``max_slots``)
        that cost within ``CLOSE_ENOUGH_COST`` of it, so that one compile holds the plans that
        differ from it in their decode rows alone (a load's steps mix a prompt's chunk with however
        many rows decode; as the rows grow longer the chunk's attention grows faster than the
        decode rows', so the fit holds). A decode-only shape is left as it is."""
        if not exact.prefill_rows:
            return exact
        cost = functools.partial(self.cost, keys=keys, queries_per_row=exact.queries_per_row)
        sizes = sorted({min(bucket(n), self.max_slots) for n in range(exact.num_decode, self.max_slots + 1)})
        fit = [s for s in (dataclasses.replace(exact, num_decode=n) for n in sizes)
               if cost(s) <= CLOSE_ENOUGH_COST * cost(exact)]
        return max(fit, key=lambda s: s.num_decode, default=exact)

    def largest_shape(self, config: SchedulerConfig) -> Shape:
        """The shape that holds every plan of this engine under a scheduler of ``config`` (its
        ``max_prefill_rows`` and ``max_num_batched_tokens``; with speculation, each decode row's
        proposal), without the log-probability variants: compiled at a server's start
        (:meth:`precompile`), no later plan waits for a compile but one of a variant not met yet."""
        verify = max(next_pow2(config.num_speculative_tokens), MIN_VERIFY) if config.speculative != "off" else 0
        return Shape(num_decode=self.max_slots, prefill_rows=next_pow2(config.max_prefill_rows),
                     prefill_tokens=prefill_bucket(config.max_num_batched_tokens),
                     lora=self.lora is not None, verify=verify)

    def precompile(self, shape: Shape) -> None:
        """Compile ``shape``: on the background thread with ``compile="background"``, else now."""
        if self.background_compile:
            self._enqueue(shape)
        elif shape not in self.compiled_shapes:
            self._compile(shape)
            self.compiles["sync"] += 1

    def _compile(self, shape: Shape):
        key = (*self._key, shape)
        with _shared_lock:
            fn = _shared.get(key)
            if fn is not None:
                _shared.move_to_end(key)
        if fn is None:
            start = time.perf_counter()
            params, cache, state, draft_params, draft_cache = self._specs
            skip_greedy = jax.default_backend() != "gpu"
            fn = step.lower(params, cache, state, self._empty_batch(shape).array, draft_params, draft_cache, cfg=self.cfg,
                            top_n=self.max_top_logprobs, num_decode=shape.num_decode,
                            prefill_rows=shape.prefill_rows, prefill_tokens=shape.prefill_tokens,
                            want_logprobs=shape.logprobs, prompt_logprobs=shape.prompt_logprobs, mesh=self.mesh,
                            skip_greedy=skip_greedy, lora=shape.lora, guided=shape.guided,
                            verify=shape.verify, draft_cfg=self.draft_cfg, draft_k=self.draft_k).compile()
            if shape.guided:  # its sampler, compiled with it (never on the serving thread when this is not)
                logits = fn.out_info[2]["logits"]
                logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=fn.output_shardings[2]["logits"])
                words = mask_words(self.cfg)
                batch = StepBatch(logits.shape[0], 0, False, nowhere=self.max_slots, mask_words=words).array
                fn = _Guided(fn, sample_masked.lower(state, logits, batch, words=words, top_n=self.max_top_logprobs,
                                                     want_logprobs=shape.logprobs,
                                                     skip_greedy=skip_greedy).compile())
            with self._lock:
                self.compile_seconds += time.perf_counter() - start
            with _shared_lock:
                _shared[key] = fn
                while len(_shared) > SHARED_EXECUTABLES:
                    _shared.popitem(last=False)
        with self._lock:
            fn = self._compiled.setdefault(shape, fn)
        if self.on_compiled is not None:
            self.on_compiled(shape)
        return fn

    def _enqueue(self, shape: Shape) -> None:
        with self._lock:
            if shape in self._queued or shape in self._compiled:
                return
            self._queued.add(shape)
            if self._compiler is None:
                self._compiler = threading.Thread(target=self._compile_loop, name="hypertron-compile", daemon=True)
                self._compiler.start()
        self._todo.put(shape)

    def _compile_loop(self) -> None:
        while (shape := self._todo.get()) is not None:
            try:
                t = time.perf_counter()
                self._compile(shape)
                self.compiles["background"] += 1
                log.debug("compiled %s in the background in %.2f s", shape, time.perf_counter() - t)
            except Exception:  # the step then compiles synchronously when next met, and raises there
                log.exception("background compile of %s failed", shape)
            with self._lock:
                self._queued.discard(shape)

    # -- steps ------------------------------------------------------------------------------

    def dispatch(self, plan: StepPlan) -> _Pending:
        shape, fn = self._executable(self.shape(plan), self.context(plan))
        start = time.perf_counter()
        batch, offsets = self._batch(plan, shape)
        pages, tokens, tables = self._deltas(plan)
        assembled = time.perf_counter() - start
        if len(pages) or len(tokens):
            self.state = write_deltas(self.state, pages, tokens)
        for slot, table in tables.items():  # what the device now holds
            self._tables[slot] = table
        out = self._call(fn, batch.array)
        logits = out.pop("logits", None)  # guided rows': sampled by sample_guided, on the device
        if not any(r.guided for r in plan.rows):  # a plan without any run padded to a guided shape
            logits = None
        for x in jax.tree.leaves(out):
            x.copy_to_host_async()
        return _Pending(plan, shape, offsets, out, {"assemble": assembled}, logits,
                        sampler=fn.sample if logits is not None else None)

    def _call(self, fn, batch: np.ndarray) -> dict:
        """The compiled step ``fn``'s outputs on ``batch``, the pools and the state threaded through."""
        cache, self.state, out = fn(self.step_params(), self.cache, self.state, batch, self.draft_params,
                                    self.draft_cache)
        self.cache, self.draft_cache = (cache, None) if self.draft_cfg is None else cache
        return out

    def sample_guided(self, pending: _Pending, masks: list) -> None:
        """Sample ``pending``'s guided rows with ``masks`` (one per plan row; see
        :meth:`hypertron.serve.types.Engine.sample_guided`): a second compiled function
        (:func:`~hypertron.serve.device_step.sample_masked`) over the step's logits, queued after
        it and before any later step, which reads these rows' tokens on the device."""
        plan, words = pending.plan, mask_words(self.cfg)
        batch = StepBatch(pending.logits.shape[0], 0, False, nowhere=self.max_slots, mask_words=words)
        b = batch.fields
        for j, row, mask in zip(pending.rows, plan.rows, masks):
            if row.guided:
                self._row(b, j, row, 0)
                if mask is not None:
                    b["mask"][j] = mask
        self.state, out = pending.sampler(self.state, pending.logits, batch.array)
        for x in jax.tree.leaves(out):
            x.copy_to_host_async()
        pending.logits, pending.guided = None, out

    def collect(self, pending: _Pending) -> StepResult:
        if pending.logits is not None:
            raise RuntimeError(f"step {pending.plan.step} has guided rows not sampled yet (sample_guided)")
        start = time.perf_counter()
        out = jax.device_get(pending.out)
        plan, rows = pending.plan, pending.rows
        if pending.guided is not None:  # the guided rows' samples (and log-probabilities) are sample_guided's
            taken = [j for j, r in zip(rows, plan.rows) if r.guided]
            at = (taken, 0) if "emitted" in out else taken  # with verify rows, a guided row's token is its first
            for k, v in jax.device_get(pending.guided).items():
                out[k] = np.array(out[k])
                out[k][at] = v[taken]
        pending.times["wait"] = time.perf_counter() - start
        pick = lambda x: None if x is None or not plan.logprobs else x[rows]  # noqa: E731
        prompt = None
        if "prompt" in out and plan.prompt_logprobs:
            chosen, ids, lps = out["prompt"]
            prompt = [None if row.prompt_targets is None else
                      (chosen[o:o + len(row.tokens)], ids[o:o + len(row.tokens)], lps[o:o + len(row.tokens)])
                      for row, o in zip(plan.prefills, pending.prefill_offsets)]
        return StepResult(out["tokens"][rows], pick(out.get("logprobs")), pick(out.get("top_ids")),
                          pick(out.get("top_logprobs")), prompt, out["emitted"][rows] if "emitted" in out else None,
                          out["proposal"][rows] if "proposal" in out else None)

    def run(self, plan: StepPlan) -> StepResult:
        """:meth:`dispatch` then :meth:`collect`: one step, synchronously (not for a plan with guided
        rows: theirs is :meth:`dispatch`, :meth:`sample_guided`, :meth:`collect`)."""
        return self.collect(self.dispatch(plan))

    def _empty_batch(self, shape: Shape) -> StepBatch:
        """The inputs of a step of ``shape`` (see :func:`step`), all padding."""
        return StepBatch(shape.num_decode + shape.prefill_rows, shape.prefill_tokens, shape.prompt_logprobs,
                         nowhere=self.max_slots, proposal=shape.verify)

    def _batch(self, plan: StepPlan, shape: Shape) -> tuple[StepBatch, list[int]]:
        """The inputs of ``plan`` padded to ``shape`` (which holds it), and where each prefill
        row's tokens start."""
        packed, nd, per = self._empty_batch(shape), shape.num_decode, shape.verify + 1
        b, offsets = packed.fields, []
        for i, row in enumerate(plan.decodes):  # a decode row's queries: the last of its `per` places
            self._row(b, i, row, i * per + per - 1 - row.draft, not row.guided)
            if row.proposal:
                b["proposal"][i, :row.draft] = row.proposal
        off = 0
        for j, row in enumerate(plan.prefills):
            n, sl = len(row.tokens), slice(off, off + len(row.tokens))
            b["pre_tokens"][sl], b["pre_row"][sl], b["pre_valid"][sl] = row.tokens, j, 1
            b["pre_pos"][sl] = np.arange(row.start, row.end)
            if row.prompt_targets is not None:
                b["targets"][sl] = row.prompt_targets
            self._row(b, nd + j, row, nd * per + off + n - 1, not row.guided)
            offsets.append(off)
            off += n
        return packed, offsets

    def _row(self, b: dict, i: int, row, out_idx: int, sampled_here: bool = True) -> None:
        b["slot"][i], b["lengths"][i], b["out_idx"][i] = row.slot, row.end, out_idx
        if row.sample and sampled_here:
            b["out_slot"][i] = row.slot
        s = row.sampling
        b["temperature"][i], b["top_k"][i], b["top_p"][i] = s.temperature, s.top_k, s.top_p
        b["seed"][i] = np.uint32((s.seed or 0) & 0xFFFFFFFF)
        b["adapter"][i], b["draft"][i] = row.adapter + 1, row.draft

    def _deltas(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray, dict[int, tuple[int, ...]]]:
        """What ``plan`` changes in the device's state before it runs: ``pages [K, 3]`` (slot,
        column, page id: the table entries that differ from what the slot holds; its new pages, or
        the whole row when the slot's pages are not a prefix of the row's: another sequence took
        it), ``tokens [T, 3]`` (slot, position, token: each row's ``prefix``), both padded (see
        :func:`write_deltas`), and each row's slot's table after them."""
        pages, tokens, tables = [], [], {}
        for row in plan.rows:
            held, new = tables.get(row.slot, self._tables[row.slot]), tuple(row.pages[:self.pages_per_seq])
            if new[:len(held)] == held:  # the same sequence: its new pages
                pages += [(row.slot, c, p) for c, p in enumerate(new[len(held):], len(held))]
            else:
                pages += [(row.slot, c, p) for c, p in enumerate(new) if c >= len(held) or held[c] != p]
                pages += [(row.slot, c, NULL_PAGE) for c in range(len(new), len(held))]
            tables[row.slot] = new
            first = row.start - len(row.prefix)
            tokens += [(row.slot, first + k, t) for k, t in enumerate(row.prefix)]
        return self._writes(pages, MIN_PAGE_WRITES), self._writes(tokens, MIN_TOKEN_WRITES), tables

    def _writes(self, writes: list[tuple[int, int, int]], least: int) -> np.ndarray:
        """``writes`` as an int32 ``[n, 3]`` array, ``n`` a power of two at least ``least`` (0 for
        none: few compiles of :func:`write_deltas`), padded with writes into slot ``max_slots``."""
        out = np.zeros((max(next_pow2(len(writes)), least) if writes else 0, 3), np.int32)
        out[:, 0] = self.max_slots  # column or position 0, the null page or token 0
        if writes:
            out[:len(writes)] = writes
        return out
