"""The static sizes of a compiled serving step (:class:`Shape`), how a plan's sizes are padded to
them, and what a step of a shape costs (:func:`step_flops`), by which the engine picks the compiled
step a plan runs padded to and the shapes worth compiling (:mod:`hypertron.serve.engine`)."""

from __future__ import annotations

import dataclasses

from hypertron.config import ModelConfig
from hypertron.kernels.ragged_paged_attention import pair_cost
from hypertron.models.flops import attention_flops, dense_flops_per_token
from hypertron.padding import bucket

# Prefill tokens: at least this many.
MIN_PREFILL_TOKENS = 16
# Prefill tokens are bucketed by eighths (under 12.5 % padding; decode rows by quarters): prefill
# is where a step's compute goes, and a 129-token prompt padded to 160 costs a fifth more for
# nothing. The extra sizes compile in the background.
PREFILL_BUCKET_PARTS = 8


def prefill_bucket(tokens: int) -> int:
    """The prefill tokens a step of ``tokens`` prompt tokens is compiled for."""
    return max(bucket(tokens, PREFILL_BUCKET_PARTS), MIN_PREFILL_TOKENS)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The static sizes of one compiled step (:func:`hypertron.serve.engine.step`): decode rows,
    prefill rows, prefill tokens, and its variants."""

    num_decode: int
    prefill_rows: int
    prefill_tokens: int
    _: dataclasses.KW_ONLY  # the variants by name (a fourth size was the page table's width until 2026-11-27)
    logprobs: bool = False
    prompt_logprobs: bool = False
    lora: bool = False  # some row has a LoRA adapter

    @property
    def queries_per_row(self) -> int | None:
        """The prefill queries a row has, about (the step's attention is compiled for it); None
        without prefill rows."""
        return -(-self.prefill_tokens // self.prefill_rows) if self.prefill_rows else None

    def holds(self, other: Shape) -> bool:
        """Whether a plan of shape ``other`` can run padded to this one: every size at least
        ``other``'s, and no variant it lacks."""
        return (self.num_decode >= other.num_decode and self.prefill_rows >= other.prefill_rows
                and self.prefill_tokens >= other.prefill_tokens
                and self.logprobs >= other.logprobs and self.lora >= other.lora
                and self.prompt_logprobs >= other.prompt_logprobs)


def step_flops(cfg: ModelConfig, shape: Shape, keys: int = 0, queries_per_row: float | None = None,
               overhead_flops: float = 0.0) -> float:
    """A step's FLOPs as the model counts them, for a plan whose rows have about
    ``queries_per_row`` prefill queries (default: the shape's own) against ``keys`` keys each:
    every token through the weights; each query against the keys, a prefill query at what its
    pair costs in the blocks ``shape``'s attention is compiled for (:func:`pair_cost`: padded to
    blocks compiled for shorter rows, the reference on a CPU reads each pair up to 1.8x slower),
    and each row's last query again (the rows' last queries attend as a batch); plus
    ``overhead_flops``, a step's fixed cost in FLOPs' worth."""
    own = shape.queries_per_row
    slow = pair_cost(queries_per_row or own, own) if own else 1.0
    pairs = (shape.num_decode + shape.prefill_rows + shape.prefill_tokens * slow) * keys
    return overhead_flops + (shape.num_decode + shape.prefill_tokens) * dense_flops_per_token(cfg) \
        + attention_flops(cfg, pairs)
