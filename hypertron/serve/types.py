"""What the serving engine and the orchestrator exchange (no JAX here).

The engine (:mod:`hypertron.serve.engine`) owns the device state: a fixed number
of decode *slots* and a pool of KV-cache *pages*. The orchestrator
(:mod:`hypertron.serve.orchestrator`) owns requests: it admits them into free
slots, steps the engine, streams tokens out, and frees slots. This module is
the contract between the two, so that either can be tested against a fake of
the other.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, applied on the device. ``temperature == 0`` is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None  # None: a seed drawn by the server; the same seed gives the same tokens
    logprobs: int | None = None  # top-N log-probabilities per generated token (None = none)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the top alternatives (ids and log-probabilities).

    Engines return their ``max_top_logprobs`` alternatives, best first; the orchestrator
    keeps the N a request asked for."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclasses.dataclass
class Prefix:
    """A prefilled prompt, ready for :meth:`Engine.insert`.

    ``first_token`` is sampled from the prompt's last position; ``prompt_logprobs[i]`` is
    the log-probability of prompt token ``i + 1`` given the tokens before it (for ``echo``),
    present only when asked for. ``kv`` is the engine's own device data.
    """

    tokens: list[int]
    sampling: SamplingParams
    first_token: int
    first_logprobs: TokenLogprobs
    prompt_logprobs: list[TokenLogprobs] | None
    kv: object


@dataclasses.dataclass
class StepOutput:
    """One decode step for every slot (entries of inactive slots are meaningless).

    ``tokens [slots]`` the token each active slot produced; ``logprobs [slots]`` its
    log-probability; ``top_ids`` / ``top_logprobs [slots, N]`` the engine's top-N.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class Engine(Protocol):
    """What the orchestrator needs from an engine. All methods are called from one thread."""

    max_slots: int  # decode batch size
    max_seq_len: int  # prompt + generated tokens of one sequence, at most
    max_top_logprobs: int  # largest N for SamplingParams.logprobs
    eos_ids: frozenset[int]  # tokens that end a sequence (unless ignore_eos)

    def can_prefill(self, num_tokens: int) -> bool:
        """Whether KV pages are free for a prompt of ``num_tokens`` (and its first decode write)."""

    def prefill(self, tokens: list[int], sampling: SamplingParams, want_prompt_logprobs: bool = False) -> Prefix:
        """Run the prompt through the model, its KV into pages taken for it now, and sample its
        first token (touches no slot). Only after :meth:`can_prefill` said yes."""

    def can_insert(self, prefix: Prefix) -> bool:
        """Whether a slot is free for the prefilled prompt."""

    def insert(self, prefix: Prefix, slot: int) -> None:
        """Put a prefilled prompt (and its pages) into free slot ``slot`` and start decoding it."""

    def release(self, prefix: Prefix) -> None:
        """Give back the pages of a prefilled prompt that will not be inserted."""

    def reserve_step(self) -> list[int]:
        """Take the pages the next :meth:`generate` writes into; return the active slots left
        without one (the pool is exhausted). The orchestrator frees (pre-empts) slots until
        this returns []."""

    def generate(self) -> StepOutput:
        """One decode step for every active slot: each feeds its last token and gets the next."""

    def free(self, slot: int) -> None:
        """End the sequence in ``slot`` at once and return its pages."""

    def stats(self) -> dict[str, int]:
        """``slots_in_use``, ``slots_total``, ``pages_free``, ``pages_total``."""
