"""Fine-tuning batches (``task: sft``): records -> examples -> rows packed whole -> batches.

A record is one line of a jsonl file, one row of a parquet file or of a saved Hugging Face dataset
(:func:`hypertron.data.sources.read_records`), read as TRL reads its dataset formats (``data.format``):

- ``messages``: a conversation, ``{"messages": [{"role", "content"}, ...]}``, rendered with the
  chat template (:func:`hypertron.data.chat.chat_example`);
- ``prompt_completion``: ``{"prompt", "completion"}``, two strings or two message lists
  (:func:`hypertron.data.chat.prompt_completion_example`);
- ``preference`` (``task: dpo``): ``{"prompt", "chosen", "rejected"}``, read as two
  prompt-completion examples that share their prompt (:func:`read_pairs`), one pair a row
  (:func:`make_dpo_batches`).

The field names are settings (``data.messages_field``, ``data.prompt_field``,
``data.completion_field``). Every record is read and tokenised before training starts, so a bad
record is refused with its file and line before anything compiles, and the examples of each
process's share are packed into rows by best-fit decreasing (:mod:`hypertron.data.packing`): an
example is never split, and one longer than a row keeps its start (``data.overlong=truncate``,
counted) or is refused (``error``).

The rows of an epoch are a fixed list; the stream is that list repeated, each epoch in its own
order (``data.shuffle``, seeded by ``data.seed``), batched. It is a Grain ``MapDataset`` underneath,
so the iterator's state is the index of its next batch and a checkpoint resumes it exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np

from hypertron.data.chat import chat_example, prompt_completion_example
from hypertron.data.packing import pack_rows
from hypertron.data.pipeline import _check_sizes, _JsonStateIterator, _ShuffledEpochs, held_out
from hypertron.data.sources import read_records
from hypertron.errors import DataError
from hypertron.tokenizer import Tokenizer

DEFAULT_LOSS_ON = {"messages": "assistant", "prompt_completion": "completion"}


@dataclasses.dataclass(frozen=True)
class Examples:
    """A fine-tuning set, read and tokenised: ``examples[i]`` is ``(ids, loss_mask)`` of the
    ``i``-th record in file order; ``truncated`` counts those longer than a row."""

    examples: list[tuple[list[int], list[int]]]
    truncated: int

    def __len__(self) -> int:
        return len(self.examples)


def read_examples(*, source: str, paths: Sequence[str], fmt: str, fields: dict[str, str], tokenizer: Tokenizer,
                  loss_on: str, template: str | None, seq_len: int, overlong: str) -> Examples:
    """Every record of ``paths`` as an example (see the module docstring). A
    :class:`DataError` naming the file and line (or row) for a record that is not a JSON object, lacks a
    field or has one of the wrong type, a message without ``role``, what the chat template
    refuses (its ``raise_exception`` text), and with ``overlong="error"`` an example longer than
    ``seq_len + 1`` tokens."""
    if loss_on == "auto":
        loss_on = DEFAULT_LOSS_ON[fmt]
    examples, truncated = [], 0
    for where, record in read_records(source, paths):
        try:
            ids, mask = _example(record, fmt, fields, tokenizer, loss_on, template)
        except DataError as e:
            raise DataError(f"data.paths: {where}: {e}") from None
        if len(ids) - 1 > seq_len:
            if overlong == "error":
                raise DataError(f"data.overlong=error: the example at {where} has {len(ids)} tokens, more than "
                                f"train.seq_len={seq_len} + 1")
            truncated += 1
        examples.append((ids, mask))
    if not examples:
        raise DataError(f"data: no examples in {', '.join(paths)}")
    return Examples(examples, truncated)


@dataclasses.dataclass(frozen=True)
class Pairs:
    """A preference set, read and tokenised: ``pairs[i]`` is ``(prompt, chosen, rejected)`` ids of
    the ``i``-th record; ``truncated`` counts those with a sequence longer than half a row."""

    pairs: list[tuple[list[int], list[int], list[int]]]
    truncated: int

    def __len__(self) -> int:
        return len(self.pairs)


def read_pairs(*, source: str, paths: Sequence[str], fields: dict[str, str], tokenizer: Tokenizer,
               template: str | None, seq_len: int, overlong: str) -> Pairs:
    """Every record of ``paths`` as a preference pair (``{prompt, chosen, rejected}``: three strings,
    or three message lists, TRL's explicit-prompt preference format; or ``{chosen, rejected}``, two
    conversations whose shared first turns are the prompt, as TRL's ``extract_prompt`` splits them). Strings are
    ``[bos] + prompt`` and ``completion + [eos]``; message lists the prompt rendered with the
    generation prompt and each completion what rendering it after the prompt adds. A pair's two
    sequences each take half of a row (``seq_len // 2 + 1`` tokens at most): a longer one keeps its
    start (counted), or with ``overlong="error"`` is refused. Errors as :func:`read_examples`."""
    half = seq_len // 2
    pairs, truncated = [], 0
    for where, record in read_records(source, paths):
        try:
            pair = _pair(record, fields, tokenizer, template)
        except DataError as e:
            raise DataError(f"data.paths: {where}: {e}") from None
        if max(len(pair[0]) + len(pair[1]), len(pair[0]) + len(pair[2])) - 1 > half:
            if overlong == "error":
                raise DataError(f"data.overlong=error: the pair at {where} has a sequence longer than half of "
                                f"train.seq_len={seq_len} + 1 tokens")
            truncated += 1
        pairs.append(pair)
    if not pairs:
        raise DataError(f"data: no pairs in {', '.join(paths)}")
    return Pairs(pairs, truncated)


def make_dpo_batches(pairs: Pairs, *, seq_len: int, batch_size: int, seed: int = 0, shuffle: bool = True,
                     process_index: int = 0, process_count: int = 1, pad_id: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """An endless, deterministic stream of this process's batches of pairs, one pair a row
    (:func:`dpo_rows`; the pairs ``process_index::process_count``). A pair is never split between
    rows or batches."""
    _check_sizes(seq_len=seq_len, batch_size=batch_size, process_index=process_index,
                 process_count=process_count, seed=seed)
    indices = np.arange(len(pairs.pairs))[process_index::process_count]
    if not len(indices):
        raise DataError(f"data: {len(pairs.pairs)} pairs are too few for {process_count} processes")
    return _stream(dpo_rows(pairs, indices, seq_len=seq_len, pad_id=pad_id), batch_size=batch_size, seed=seed,
                   shuffle=shuffle)


def dpo_rows(pairs: Pairs, indices: Sequence[int], *, seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """The rows of the pairs ``indices``, one a row (the trainer's fields, [pairs, seq_len]): the
    chosen sequence (segment 1) in the first half, the rejected one (segment 2) in the second,
    positions from 0 in each, ``loss_weights`` on the completions' targets; ``pair`` [pairs], each
    row's index in ``pairs`` (what a precomputed reference is looked up by); and ``truncated``
    [pairs], 1 where a sequence was cut to its half."""
    half = seq_len // 2
    count = len(indices)
    rows = {"inputs": np.full((count, seq_len), pad_id, np.int32),
            "targets": np.full((count, seq_len), pad_id, np.int32),
            "loss_weights": np.zeros((count, seq_len), np.float32),
            "segment_ids": np.zeros((count, seq_len), np.int32),
            "positions": np.zeros((count, seq_len), np.int32),
            "pair": np.asarray(indices, np.int32), "truncated": np.zeros(count, np.int32)}
    for r, index in enumerate(indices):
        prompt, chosen, rejected = pairs.pairs[int(index)]
        rows["truncated"][r] = len(prompt) + max(len(chosen), len(rejected)) > half + 1
        for segment, completion in ((1, chosen), (2, rejected)):
            ids = np.asarray((list(prompt) + list(completion))[:half + 1], np.int32)
            mask = np.asarray(([0] * len(prompt) + [1] * len(completion))[:half + 1], np.float32)
            n, start = len(ids) - 1, (segment - 1) * half
            span = slice(start, start + n)
            rows["inputs"][r, span], rows["targets"][r, span] = ids[:-1], ids[1:]
            rows["loss_weights"][r, span] = mask[1:]
            rows["segment_ids"][r, span] = segment
            rows["positions"][r, span] = np.arange(n)
    return rows


def make_sft_batches(examples: Examples, *, seq_len: int, batch_size: int, seed: int = 0, shuffle: bool = True,
                     process_index: int = 0, process_count: int = 1, pad_id: int = 0, split: str = "train",
                     eval_fraction: float = 0.0) -> Iterator[dict[str, np.ndarray]]:
    """An endless, deterministic stream of this process's batches of packed examples, each field
    [batch_size, seq_len] (as :func:`hypertron.data.pipeline.make_batches` gives, ``loss_weights``
    from the examples' masks). Examples are split (``eval_fraction``: :func:`held_out` over the
    examples) and sharded by process before packing."""
    _check_sizes(seq_len=seq_len, batch_size=batch_size, process_index=process_index,
                 process_count=process_count, seed=seed)
    chosen = np.arange(len(examples.examples))
    if eval_fraction:
        mask = held_out(len(chosen), eval_fraction)
        chosen = np.flatnonzero(mask if split == "eval" else ~mask)
    elif split == "eval":
        raise DataError("data.eval_fraction=0 holds out no examples for evaluation")
    shard = [examples.examples[int(i)] for i in chosen[process_index::process_count]]
    if not shard:
        raise DataError(f"data: {len(chosen)} {split} examples are too few for {process_count} processes")
    packed, _ = pack_rows(shard, seq_len, pad_id)
    return _stream(packed, batch_size=batch_size, seed=seed, shuffle=shuffle)


def _stream(fields: dict[str, np.ndarray], *, batch_size: int, seed: int, shuffle: bool) -> Iterator[dict]:
    """Batches of the rows of ``fields`` ([rows, seq_len] each), repeated, each epoch in its own
    seeded order (or in order); the iterator's state is its next batch's index."""
    rows = grain.MapDataset.source(_Rows(fields))
    epochs = _ShuffledEpochs(rows, seed=seed) if shuffle else rows.repeat()
    return _JsonStateIterator(iter(epochs.batch(batch_size, drop_remainder=True).to_iter_dataset()))


class _Rows(Sequence):
    """Row ``i`` of packed fields ``[rows, seq_len]`` as a dict of arrays [seq_len]."""

    def __init__(self, packed: dict[str, np.ndarray]):
        self._packed = packed

    def __len__(self) -> int:
        return len(next(iter(self._packed.values())))

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {k: v[index] for k, v in self._packed.items()}


def _pair(record: Any, fields: dict[str, str], tokenizer: Tokenizer,
          template: str | None) -> tuple[list[int], list[int], list[int]]:
    names = ("prompt", "chosen", "rejected")
    if not isinstance(record, dict):
        raise DataError(f"a record must be a JSON object with {', '.join(fields[n] for n in names)}")
    for name in names[1:]:
        if fields[name] not in record:
            raise DataError(f"no {fields[name]!r} (data.{name}_field)")
    chosen, rejected = record[fields["chosen"]], record[fields["rejected"]]
    if fields["prompt"] in record:
        prompt = record[fields["prompt"]]
    elif isinstance(chosen, list) and isinstance(rejected, list):  # implicit: the turns both share
        shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    else:
        raise DataError(f"no {fields['prompt']!r} (data.prompt_field), and chosen and rejected are not conversations "
                        "whose shared turns would be the prompt")
    out = []
    for completion in (chosen, rejected):
        ids, mask = prompt_completion_example(tokenizer, prompt, completion, loss_on="completion", template=template)
        head = mask.index(1) if 1 in mask else len(mask)
        out.append((ids[:head], ids[head:]))
    if out[0][0] != out[1][0]:
        raise DataError("the chat template renders the prompt differently before the chosen and the rejected "
                        "completions")
    if not out[0][1] or not out[1][1]:
        raise DataError("a completion is empty")
    return out[0][0], out[0][1], out[1][1]


def _example(record: Any, fmt: str, fields: dict[str, str], tokenizer: Tokenizer, loss_on: str,
             template: str | None) -> tuple[list[int], list[int]]:
    names = ("messages",) if fmt == "messages" else ("prompt", "completion")
    if not isinstance(record, dict):
        raise DataError(f"a record must be a JSON object with {', '.join(fields[n] for n in names)}")
    for name in names:
        if fields[name] not in record:
            raise DataError(f"no {fields[name]!r} (data.{name}_field)")
    if fmt == "messages":
        return chat_example(tokenizer, record[fields["messages"]], loss_on=loss_on, template=template)
    return prompt_completion_example(tokenizer, record[fields["prompt"]], record[fields["completion"]],
                                     loss_on=loss_on, template=template)
