"""What the scheduler, the engine and the output side exchange (no JAX here).

The scheduler (:mod:`hypertron.serve.scheduler`) owns requests, decode slots and the KV-cache
page pool, and decides each step: a :class:`StepPlan` of decode rows and prefill chunks within a
token budget. The engine (:mod:`hypertron.serve.engine`) owns the device: it runs a plan
(:meth:`Engine.dispatch`, which returns at once) and hands back its :class:`StepResult`
(:meth:`Engine.collect`, which waits). This module is the contract between them, so that either
can be tested against a fake of the other (``tests/fake_engine.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from hypertron.errors import UserError

if TYPE_CHECKING:
    from hypertron.config import ModelConfig

INT32_MAX = 2**31 - 1  # what the engine's int32 arrays hold (max_tokens, top_k, token ids, positions)
SEED_LIMIT = 2**32  # a seed keys the sampler as a uint32: 0 <= seed < SEED_LIMIT


class SamplingError(UserError):
    """A request value the engine cannot hold; ``field`` names it (a :class:`SamplingParams` field,
    or ``"prompt"``), so the server answers 400 with the API's name for it and the CLI its flag."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def named(self, name: str) -> str:
        """The message with the field called ``name`` (the API's key, the CLI's flag): one message
        whatever the surface."""
        return str(self).replace(f"'{self.field}'", name, 1)


FLOAT32_MAX = float(np.finfo(np.float32).max)  # what holds a temperature on the device


def check_token_ids(ids: Iterable[int], vocab_size: int, field: str) -> None:
    """Raise :class:`SamplingError` naming ``field`` unless every id is in ``[0, vocab_size)``."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise SamplingError(field, f"'{field}' has token id {bad}; token ids must be in [0, {vocab_size})")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, applied on the device. ``temperature == 0`` is greedy.

    It checks its own values when made (:class:`SamplingError` naming the field: the server's 400
    and ``hypertron generate``'s ``error:`` line are that message); ``top_k`` -1 is off, as 0, and
    is held as 0. What depends on the model (the vocabulary, ``max_top_logprobs``) is checked by
    :meth:`check`."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None  # None: a seed drawn by the server; the same seed gives the same tokens
    logprobs: int | None = None  # top-N log-probabilities per generated token (None = none)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not 1 <= self.max_tokens <= INT32_MAX:
            _refuse("max_tokens", self.max_tokens, f"1 to {INT32_MAX}")
        if not 0 <= self.temperature <= FLOAT32_MAX:  # NaN fails both
            _refuse("temperature", self.temperature, f"a number from 0 to {FLOAT32_MAX:.4g} (a float32)")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            _refuse("top_p", self.top_p, "a number in (0, 1]")
        if not -1 <= self.top_k <= INT32_MAX:
            _refuse("top_k", self.top_k, TOP_K_RANGE)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            _refuse("seed", self.seed, f"0 to {SEED_LIMIT - 1}")
        if self.logprobs is not None and self.logprobs < 0:
            _refuse("logprobs", self.logprobs, "at least 0")

    def check(self, *, vocab_size: int, max_top_logprobs: int) -> None:
        """Raise :class:`SamplingError` (naming the field) for a value the model in hand cannot
        take: one row the engine cannot write must be refused before it shares a step with others
        (server, ``generate`` and the loop call it)."""
        if self.top_k > vocab_size:
            _refuse("top_k", self.top_k, f"at most the vocabulary's {vocab_size} (0 or -1: off)")
        if self.logprobs is not None and self.logprobs > max_top_logprobs:
            _refuse("logprobs", self.logprobs, f"0 to {max_top_logprobs}")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")


TOP_K_RANGE = "0 or -1 (off), or a positive k"


def _refuse(field: str, value, expected: str):
    raise SamplingError(field, f"'{field}' is {value!r}; expected {expected}")


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the top alternatives (ids and log-probabilities).

    Engines return their ``max_top_logprobs`` alternatives, best first; the scheduler keeps
    the N a request asked for."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class Row:
    """One sequence's part of a step.

    A *decode* row (``tokens == ()``) feeds one token, the one its slot sampled last (it stays
    on the device), at position ``start``. A *prefill* row feeds ``tokens`` at positions
    ``start ..``: a prompt, or a chunk of one. ``pages`` are the sequence's KV pages (page
    ``i`` holds positions ``i * page_size ..``), enough for every position written.
    ``sample``: the step samples the token after the row's last input (every decode row, and
    the last chunk of a prompt), with ``sampling`` and the key of its position, and keeps it
    on the device as the slot's next input. A ``guided`` row samples among the ids its grammar
    allows: the engine runs its forward pass, and samples it once :meth:`Engine.sample_guided` hands
    it the mask (:mod:`hypertron.serve.structured`). ``prompt_targets``: when prompt log-probabilities
    are wanted, the token after each input (-1 where it is not a prompt token). ``prefix``: the
    sequence's tokens just before ``start`` that no row of it fed (on the first chunk after an
    admission that found them cached): the engine only writes them into the slot's token history.
    A decode row with a ``proposal`` (a *verify* row: speculative decoding,
    :mod:`hypertron.serve.speculative`) feeds those tokens after its last one, at ``start + 1 ..``:
    the step samples after each of its tokens and keeps the proposed ones while they equal its
    samples (:func:`hypertron.serve.sampling.verify_proposal`), so it emits 1 to ``draft + 1`` tokens (:attr:`StepResult.emitted`), and its slot's
    sequence then holds ``start`` + what it emitted.
    """

    request: int
    slot: int
    start: int
    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    sampling: SamplingParams
    sample: bool = True
    prompt_targets: tuple[int, ...] | None = None
    prefix: tuple[int, ...] = ()
    adapter: int = -1  # the LoRA slot of its tokens (hypertron.serve.lora_slots); -1: none
    guided: bool = False  # it samples among what its grammar allows (hypertron.serve.structured)
    proposal: tuple[int, ...] = ()  # a decode row's proposed next tokens, which the step checks

    @property
    def draft(self) -> int:
        """The tokens proposed."""
        return len(self.proposal)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) or 1 + len(self.proposal)

    @property
    def end(self) -> int:
        """Tokens the sequence holds once this row is written."""
        return self.start + self.num_tokens


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One engine step: ``decodes`` then ``prefills``. ``logprobs``: some row asked for them (the
    engine then computes its ``max_top_logprobs`` for every row; otherwise none at all);
    ``prompt_logprobs``: some prefill row has ``prompt_targets``."""

    step: int
    decodes: tuple[Row, ...]
    prefills: tuple[Row, ...]
    logprobs: bool = False
    prompt_logprobs: bool = False

    @classmethod
    def of(cls, step: int, decodes: tuple[Row, ...], prefills: tuple[Row, ...]) -> StepPlan:
        """The plan of these rows, its ``logprobs`` and ``prompt_logprobs`` set from them."""
        return cls(step, decodes, prefills,
                   logprobs=any(r.sample and r.sampling.logprobs is not None for r in decodes + prefills),
                   prompt_logprobs=any(r.prompt_targets is not None for r in prefills))

    def only(self, rows: tuple[Row, ...]) -> StepPlan:
        """This step with only ``rows`` (a subset of :attr:`rows`): rows are independent (each its
        own slot and pages), so the rows kept run as they would have in the whole step."""
        keep = {id(r) for r in rows}
        return StepPlan.of(self.step, tuple(r for r in self.decodes if id(r) in keep),
                           tuple(r for r in self.prefills if id(r) in keep))

    @property
    def rows(self) -> tuple[Row, ...]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def proposes(self) -> bool:
        """Some row feeds a proposal (speculative decoding): the loop collects such a step before
        planning the next, whose rows depend on how much of it was kept."""
        return any(r.proposal for r in self.decodes)


@dataclasses.dataclass
class StepResult:
    """What a step produced, one entry per row of :attr:`StepPlan.rows` (meaningless where the
    row did not sample). ``tokens [rows]``; with ``plan.logprobs``, ``logprobs [rows]`` (of the
    sampled token) and ``top_ids`` / ``top_logprobs [rows, N]``; with ``plan.prompt_logprobs``,
    ``prompt[i]`` for prefill row ``i``: ``(chosen [n], top_ids [n, N], top_logprobs [n, N])``
    of its ``prompt_targets`` (None for rows without them). With ``emitted [rows]`` (a plan with
    proposals, :attr:`Row.proposal`), each row's first ``emitted[i]`` tokens are its new ones:
    ``tokens [rows, k + 1]``, ``logprobs [rows, k + 1]`` and ``top_ids`` / ``top_logprobs [rows,
    k + 1, N]`` (:meth:`token` and :meth:`logprobs_of` read either layout)."""

    tokens: np.ndarray
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    prompt: list | None = None
    emitted: np.ndarray | None = None
    proposals: np.ndarray | None = None  # [rows, k]: a draft model's tokens after each row's last (speculative: draft)

    def count(self, i: int) -> int:
        """The tokens row ``i`` emitted (1 but for a verify row)."""
        return 1 if self.emitted is None else int(self.emitted[i])

    def token(self, i: int, j: int = 0) -> int:
        """Row ``i``'s ``j``-th new token."""
        return int(self.tokens[i] if self.emitted is None else self.tokens[i, j])

    def logprobs_of(self, i: int, j: int, n: int) -> TokenLogprobs | None:
        """Row ``i``'s ``j``-th token's log-probability and top ``n``; None when the step computed none."""
        if self.logprobs is None:
            return None
        at = i if self.emitted is None else (i, j)
        return TokenLogprobs(float(self.logprobs[at]), tuple(int(t) for t in self.top_ids[at][:n]),
                             tuple(float(v) for v in self.top_logprobs[at][:n]))


class DraftModel(NamedTuple):
    """A draft model for speculative decoding (``speculative: draft``): its weights and config (the
    target's tokenizer and vocabulary), and ``k``, the tokens it proposes after each sampled row."""

    params: object
    cfg: ModelConfig
    k: int


class Engine(Protocol):
    """What the scheduler and the serving loop need from an engine. Called from one thread."""

    accelerator: bool  # it runs on an accelerator (dispatch_ahead=auto dispatches every step ahead)
    max_slots: int  # decode rows at most; slots are numbered 0 .. max_slots - 1
    max_seq_len: int  # prompt + generated tokens of one sequence, at most
    max_top_logprobs: int  # largest N for SamplingParams.logprobs
    vocab_size: int  # token ids are 0 .. vocab_size - 1
    eos_ids: frozenset[int]  # tokens that end a sequence (unless ignore_eos)
    page_size: int  # tokens per KV page
    num_pages: int  # pages the scheduler may hand out: ids 1 .. num_pages (0 is the null page)

    def dispatch(self, plan: StepPlan) -> object:
        """Start the step (device work queued, nothing waited for); returns a handle for
        :meth:`collect`. Steps run in the order they are dispatched. One that raises must leave the
        device as it was (a row's values are written on the host first), so that its rows can run
        again without the one that raises (``Orchestrator._isolate``)."""

    def collect(self, handle: object) -> StepResult:
        """Wait for a dispatched step and return what it produced."""

    def sample_guided(self, handle: object, masks: list) -> None:
        """Sample a dispatched step's guided rows (:attr:`Row.guided`) with ``masks`` (one per row of
        its plan: the row's allowed ids as :mod:`hypertron.serve.structured`'s bitmask, None for a
        row that is not guided), before it is collected and before the next step is dispatched.
        Only for a plan with guided rows (an engine that serves no grammar need not have it)."""


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A step's time as ``fixed + per_token * tokens`` seconds (:meth:`hypertron.serve.engine.PagedEngine.measure_step_cost`)."""

    fixed: float
    per_token: float

    @property
    def overhead_tokens(self) -> float:
        """The fixed cost in tokens' worth: small where compute grows with the tokens (a CPU),
        large where a step of a few hundred tokens costs about what one does (an accelerator)."""
        return self.fixed / self.per_token if self.per_token > 0 else math.inf


class LoraError(ValueError):
    """A LoRA adapter (:mod:`hypertron.serve.lora_slots`) that cannot be loaded, unloaded or used: ``status`` (400, 404) and ``param``
    for the API's error."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param
