"""Packing fine-tuning examples into rows without splitting one: best-fit decreasing.

Pre-training cuts a concatenated stream at row boundaries (:mod:`hypertron.data.pipeline`); a
fine-tuning example cut in two would train its second half without its prompt. Here each example
goes whole into one row, as a segment of its own: positions restart at 0 and the segment id keeps
attention inside it, so a packed row computes what its examples would one at a time.

Best-fit decreasing (TRL's ``packing_strategy="bfd"``): the examples sorted longest first (ties in
input order), each into the open row whose free space it fills most tightly, or a new row when
none has room. It is deterministic in the lengths alone, so a set of examples always packs the same
way and a stream of its rows resumes by row index. An example longer than a row keeps its start, is
cut to the row and counted.

Why not Grain's ``BestFitPackIterDataset`` (grain 0.2.18): it is best fit *online*, not
decreasing. It fills a fixed number of open bins in arrival order and emits them all as soon as
one element fits none. It raises on an element longer than a row instead of truncating it. And it
reports no example indices, so which example went where, and how many were cut, cannot be read
back. Sorting needs the lengths of a whole set, which a finite fine-tuning set has.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


def best_fit_decreasing(lengths: Sequence[int], seq_len: int) -> tuple[list[list[int]], int]:
    """Rows of ``seq_len`` slots holding examples of ``lengths`` [n] whole: ``(rows, truncated)``,
    each row the list of its examples' indices (longest first), every index in exactly one row,
    and ``truncated`` the number of examples longer than ``seq_len`` (each fills a row of its own,
    cut to it)."""
    if seq_len <= 0:
        raise ValueError(f"seq_len={seq_len}: must be positive")
    clipped = np.minimum(np.asarray(lengths, np.int64).reshape(-1), seq_len)
    if clipped.size and clipped.min() < 0:
        raise ValueError("example lengths must be non-negative")
    truncated = int(np.sum(np.asarray(lengths).reshape(-1) > seq_len))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free slots, row) of the open rows, ascending
    for index in np.argsort(-clipped, kind="stable"):
        length = int(clipped[index])
        at = bisect.bisect_left(free, (length, -1))  # the tightest row with room
        if at < len(free):
            room, row = free.pop(at)
        else:
            room, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(int(index))
        bisect.insort(free, (room - length, row))
    return rows, truncated


def pack_rows(examples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int,
              pad_id: int) -> tuple[dict[str, np.ndarray], int]:
    """``examples``, each ``(ids, loss_mask)`` of equal length (``loss_mask[i]``: token ``i`` is a
    target the loss counts, as :func:`hypertron.data.chat.chat_example` gives), packed by
    :func:`best_fit_decreasing` -> ``(batch, truncated)``.

    ``batch`` holds the training fields, each [rows, seq_len]: ``inputs`` and ``targets`` int32
    (an example of n tokens fills n-1 slots: ``ids[:-1]`` predicting ``ids[1:]``),
    ``loss_weights`` float32 (``loss_mask[1:]``: the mask shifted onto the targets),
    ``segment_ids`` int32 (1, 2, ... per example in a row; 0 on padding) and ``positions`` int32
    (from 0 in each example); and ``truncated`` int32 [rows], the row's examples that were cut.
    Padding has ``pad_id`` tokens and weight 0. An example longer than ``seq_len + 1`` tokens keeps
    its first ``seq_len + 1``; ``truncated`` counts them.
    """
    for ids, mask in examples:
        if len(ids) != len(mask):
            raise ValueError(f"an example has {len(ids)} ids but {len(mask)} mask values")
    lengths = [max(len(ids) - 1, 0) for ids, _ in examples]
    rows, truncated = best_fit_decreasing(lengths, seq_len)
    shape = (len(rows), seq_len)
    batch = {"inputs": np.full(shape, pad_id, np.int32), "targets": np.full(shape, pad_id, np.int32),
             "loss_weights": np.zeros(shape, np.float32), "segment_ids": np.zeros(shape, np.int32),
             "positions": np.zeros(shape, np.int32), "truncated": np.zeros(len(rows), np.int32)}
    for r, row in enumerate(rows):
        start, segment = 0, 0
        for index in row:
            ids, mask = examples[index]
            batch["truncated"][r] += len(ids) > seq_len + 1
            ids = np.asarray(ids[:seq_len + 1], np.int32)
            n = len(ids) - 1
            if n <= 0:  # one token predicts nothing
                continue
            segment += 1
            span = slice(start, start + n)
            batch["inputs"][r, span] = ids[:-1]
            batch["targets"][r, span] = ids[1:]
            batch["loss_weights"][r, span] = np.asarray(mask[1:n + 1], np.float32)
            batch["segment_ids"][r, span] = segment
            batch["positions"][r, span] = np.arange(n)
            start += n
    return batch, truncated
