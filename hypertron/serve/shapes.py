"""The static sizes of a compiled serving step (:class:`Shape`), how a plan's sizes are padded to
them, and what a step of a shape costs (:func:`step_flops`), by which the engine picks the compiled
step a plan runs padded to and the shapes worth compiling (:mod:`hypertron.serve.engine`); and
the shapes a server compiled, kept for its next start (:class:`ShapeMemory`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from pathlib import Path

from hypertron.config import ModelConfig
from hypertron.kernels.ragged_paged_attention import pair_cost
from hypertron.models.flops import attention_flops, dense_flops_per_token
from hypertron.padding import bucket

log = logging.getLogger(__name__)

# A server's compiled shapes kept for its next start (ShapeMemory): the most recent this many.
REMEMBERED_SHAPES = 128
# ... in this folder of JAX's persistent compilation cache.
SHAPE_MEMORY_FOLDER = "hypertron-serve-shapes"
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
    """The static sizes of one compiled step (:func:`hypertron.serve.device_step.step`): decode rows,
    prefill rows, prefill tokens, and its variants."""

    num_decode: int
    prefill_rows: int
    prefill_tokens: int
    _: dataclasses.KW_ONLY  # the variants by name (a fourth size was the page table's width until 2026-11-27)
    logprobs: bool = False
    prompt_logprobs: bool = False
    lora: bool = False  # some row has a LoRA adapter
    guided: bool = False  # some row's sample is masked by a grammar (hypertron.serve.structured)
    verify: int = 0  # proposed tokens a decode row may feed (speculative decoding; each a query); 0: none

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
                and self.logprobs >= other.logprobs and self.lora >= other.lora and self.guided >= other.guided
                and self.verify >= other.verify
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
    decode = shape.num_decode * (shape.verify + 1)  # a decode row's queries: its token and its proposal's
    pairs = (decode + shape.prefill_rows + shape.prefill_tokens * slow) * keys
    return overhead_flops + (decode + shape.prefill_tokens) * dense_flops_per_token(cfg) \
        + attention_flops(cfg, pairs)


class ShapeMemory:
    """The step shapes compiled for one model and engine settings, most recent last (at most
    :data:`REMEMBERED_SHAPES`), kept as JSON in ``folder/<digest>.json``, ``digest`` being
    :attr:`~hypertron.serve.engine.PagedEngine.program_digest`. ``hypertron serve`` keeps one beside
    JAX's persistent compilation cache and precompiles :attr:`shapes` at its start: their programs
    then load from that cache (about 0.5 s a shape of the HTTP bench's model on this project's CPU,
    against 2 to 3 s compiled), before a load meets them. A file that is not such a list is
    started afresh (a warning); a shape that fails to compile later costs only that compile."""

    def __init__(self, folder: str | os.PathLike, digest: str):
        self.path = Path(folder) / f"{digest}.json"
        self._lock = threading.Lock()
        self.shapes: list[Shape] = self._read()

    @classmethod
    def beside_compile_cache(cls, digest: str) -> ShapeMemory | None:
        """The memory of ``digest`` in JAX's persistent compilation cache's folder (``hypertron serve
        --compile-cache``), under :data:`SHAPE_MEMORY_FOLDER`; None when that cache is off."""
        import jax

        folder = jax.config.jax_compilation_cache_dir
        if not (jax.config.jax_enable_compilation_cache and folder):
            return None
        return cls(os.path.join(folder, SHAPE_MEMORY_FOLDER), digest)

    def _read(self) -> list[Shape]:
        try:
            items = json.loads(self.path.read_text())
            if not isinstance(items, list):
                raise TypeError(f"a JSON {type(items).__name__}, not a list")
            shapes = [Shape(**item) for item in items]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError) as e:  # unreadable, not JSON, not shapes' fields
            log.warning("%s: not a list of step shapes (%s); starting a new one", self.path, e)
            return []
        if not all(_well_typed(s) for s in shapes):
            log.warning("%s: a step shape with a size not a whole number or a variant not true or false; "
                        "starting a new one", self.path)
            return []
        return shapes[-REMEMBERED_SHAPES:]

    def add(self, shape: Shape) -> None:
        """Keep ``shape`` as the most recent (written at once; a file others may read whole)."""
        with self._lock:
            # a new list: a reader may be going through the one before
            self.shapes = [*(s for s in self.shapes if s != shape), shape][-REMEMBERED_SHAPES:]
            text = json.dumps([dataclasses.asdict(s) for s in self.shapes])
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                scratch = self.path.with_name(f"{self.path.name}.{os.getpid()}.{threading.get_ident()}")
                scratch.write_text(text)
                os.replace(scratch, self.path)
            except OSError as e:  # a read-only cache folder: the shapes are not kept, serving goes on
                log.warning("%s: cannot keep the compiled step shapes (%s)", self.path, e.strerror or e)


def _well_typed(shape: Shape) -> bool:
    sizes = ("num_decode", "prefill_rows", "prefill_tokens", "verify")
    values = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}
    return all(type(v) is int and v >= 0 if k in sizes else type(v) is bool for k, v in values.items())
