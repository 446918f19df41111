"""A request as the serving loop's scheduler sees it (:class:`Request`), what it hands back for each
(:class:`Output`), and its record of each step (:class:`StepRecord`): the scheduler's records, apart
from its logic (:mod:`hypertron.serve.scheduler`, which exports them too). No JAX."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypertron.serve.types import SamplingParams, TokenLogprobs

STOP, LENGTH, ABORT, ERROR = "stop", "length", "abort", "error"  # finish reasons
WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """A request as the scheduler sees it."""

    id: int
    prompt: list[int]
    sampling: SamplingParams
    want_prompt_logprobs: bool = False
    cache_salt: str | None = None  # only requests of the same salt share cached pages
    adapter: int = -1  # its LoRA slot (hypertron.serve.lora_slots); -1: the base model
    adapter_key: str | None = None  # its adapter's load, a key of its pages (only the same adapter shares them)
    guide: Any = None  # its grammar's state (hypertron.serve.structured.Guide); None: free text
    generated: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int | None = None  # prompt tokens found cached at its first admission
    keys: list[bytes] = dataclasses.field(default_factory=list)  # its full pages' keys, computed so far
    status: str = WAITING
    finish_reason: str | None = None
    # Set at each admission:
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    fill: list[int] = dataclasses.field(default_factory=list)  # what is prefilled: prompt + generated then
    computed: int = 0  # positions written or scheduled to be
    keyed: int = 0  # its first pages that are keyed (or were looked at for a key)
    admitted: int = 0  # admission order, for choosing whom to pre-empt
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Steps dispatched and not collected yet: rows, and those of them that sample a token.
    rows_in_flight: int = 0
    tokens_in_flight: int = 0
    verifying: bool = False  # a verify row of it is in flight (how many tokens it emits is not known yet)
    proposed: tuple[int, list[int]] | None = None  # a draft model's proposal, and the length it follows

    @property
    def outputs(self) -> int:
        """Tokens generated, counting those of steps in flight."""
        return len(self.generated) + self.tokens_in_flight


@dataclasses.dataclass(frozen=True)
class Output:
    """What one sequence got from a step: a token (with its log-probabilities when asked for,
    and the prompt's before the first token when asked for) and/or its end."""

    seq: Request
    token: int | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One scheduled step: the decoded sequences' ids, the prefill chunks ``(id, start,
    tokens)``, the sequences pre-empted for it and its tokens."""

    step: int
    decodes: tuple[int, ...]
    prefills: tuple[tuple[int, int, int], ...]
    preempted: tuple[int, ...]
    num_tokens: int
