"""Routing a feature's ids to the devices that own their rows, on the host, before a step.

Row-wise, the batch is split by samples over the ``S`` devices of the axis, as a data-parallel
model holds it: device ``d`` has samples ``d * b`` to ``(d + 1) * b - 1`` (``b = ceil(batch / S)``;
the batch is padded with empty samples to ``S * b``). Each id goes to the shard that owns its row
(``id % S``). :func:`route` lays the ids out as the all-to-all sends them: ``[S source devices,
S owners, capacity]``, each entry the id's place in its owner's list of distinct rows, its sample
within the source's ``b`` and its weight; unused entries are padding (sample ``b``, weight 0).
Duplicates are found here, on the host, where sorting is cheap: each owner gets the distinct rows
of the whole step (``uniq``), reads each once and, in an update, sums each row's gradients into
one before its optimiser step. That needs the whole step's ids in one process.

On several processes (``process=(index, count)``) each process routes only its own samples (its
slice of the global batch, as the data pipeline splits it) for its own devices, and no process
ever holds the step's ids: row-wise it lays them out as above for its local source devices, each
entry the row itself within its owner's block (``uniq`` is None); column-wise, ``[local devices,
capacity]`` of ids by the device that holds their sample. Duplicates are then merged on the device
that reads them (:mod:`hypertron.embed.tables`): its received rows sorted into distinct ones, each
row's gradients summed before its optimiser step, as above. A table-wise table is not routed per
process yet (its owner would need every process's ids: place it row- or column-wise), nor is a
data-parallel one (a model's step pools each device's own samples from its own copy:
:mod:`hypertron.train.dlrm_fused`).

The capacity, the most ids one device sends to one owner in a step, is sized from the data: the
largest count in this batch, rounded up to a power of two (at least 8) so that steps compile to
few shapes. A fixed ``capacity`` (to keep one compiled shape) that a batch overflows is never
silent: by default it raises :class:`EmbedError` naming the feature and the count needed; with
``overflow="drop"`` the ids past it are dropped (the first ``capacity`` of each source and owner
kept) and counted in :attr:`Routed.dropped`, and the combiners' scales use the ids kept. Per process,
the capacity is agreed: the largest count any process needs (``gather``: each process's value of a
host integer, one small collective), so every process lays its ids out in one shape and an
overflow raises on every process, naming the one that needed more.

Column-wise and table-wise, every shard (or the owner) reads every id: one flat list, padded to a
power of two, of places in the step's distinct ids. There a ``capacity`` (any value) fixes the
distinct ids' buffer at that padded length (or the table's rows, rounded up to a power of two, if
fewer), so that it too depends only on the batch's id count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from hypertron.embed.spec import EmbedError, Jagged, TableSpec
from hypertron.padding import next_pow2

OVERFLOW = ("raise", "drop")
MIN_CAPACITY = 8
PAD = 2**31 - 1  # a row past any table: read as zeros, never written


@dataclasses.dataclass(frozen=True)
class Routed:
    """One feature's batch laid out for one table's placement over ``shards`` devices.

    ``uniq`` holds the distinct rows the batch reads, so each is read (and updated) once: row-wise
    ``[S owners, U]``, each owner's rows within its block; otherwise ``[U]``, the ids. Padding is
    ``PAD``, past any table. Row-wise ``slot``, ``seg`` and ``w`` are ``[S source devices, S
    owners, capacity]``: each id's place in its owner's ``uniq``, its sample on the source device
    (``per_device`` for padding) and its weight (0 for padding). Otherwise they are ``[n]``: the
    place in ``uniq``, the sample (``batch`` for padding) and the weight. ``scale
    [padded_batch]`` is what each sample's pooled sum is multiplied by (the combiner).

    Routed per process (``uniq`` None), the arrays are this process's part of the global ones, split
    on their first axis by device: row-wise ``slot`` is each id's row within its owner's block;
    column-wise ``slot``, ``seg`` and ``w`` are ``[local devices, capacity]`` (the id, its sample
    on its device, its weight); ``scale`` covers this process's samples."""

    placement: str
    shards: int
    batch: int
    per_device: int
    uniq: np.ndarray | None  # None: routed per process, duplicates merged on the device (``slot``: rows)
    slot: np.ndarray
    seg: np.ndarray
    w: np.ndarray
    scale: np.ndarray
    combiner: str
    dropped: int = 0
    processes: int = 1  # how many processes each routed their own part (these arrays are this one's)

    @property
    def padded_batch(self) -> int:
        return len(self.scale)

    @property
    def capacity(self) -> int:
        return self.slot.shape[-1]

    @property
    def merged_on_device(self) -> bool:
        """Routed per process: duplicates are merged where the rows are read, not here."""
        return self.uniq is None

    def arrays(self) -> tuple[np.ndarray, ...]:
        head = () if self.uniq is None else (self.uniq,)
        return (*head, self.slot, self.seg, self.w, self.scale)


def _places(groups_sorted: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each element's place within its group, for group ids sorted (``counts``: each group's size)."""
    return np.arange(len(groups_sorted)) - (np.cumsum(counts) - counts)[groups_sorted]


def _scale(w: np.ndarray, seg: np.ndarray, b: int, combiner: str) -> np.ndarray:
    """What each of ``b`` samples' pooled sum is multiplied by (``seg == b`` is padding)."""
    if combiner == "sum":
        return np.ones(b, np.float32)
    per = np.bincount(seg, weights=w if combiner == "mean" else w * w, minlength=b + 1)[:b]
    if combiner == "sqrtn":
        per = np.sqrt(per)
    return np.where(per > 0, 1.0 / np.where(per > 0, per, 1.0), 0.0).astype(np.float32)


def route(spec: TableSpec, x: Jagged, combiner: str, shards: int, *, capacity: int | None = None,
          overflow: str = "raise", feature: str | None = None, process: tuple[int, int] | None = None,
          gather: Callable[[int], Sequence[int]] | None = None) -> Routed:
    """``x`` laid out for ``spec``'s placement over ``shards`` devices (ids already checked:
    :func:`hypertron.embed.check_ids`). ``capacity`` (row-wise): ids one device sends one owner,
    None to size it from this batch; ``overflow``: what a batch past it does, ``raise`` or
    ``drop`` (and count). ``process=(index, count)``: ``x`` is this process's samples only, routed
    for its ``shards // count`` devices (the module's docstring); ``gather`` then gives each
    process's value of a host integer: needed on more than one process for a capacity sized from
    the data; without it a fixed capacity's overflow is checked on this process alone (where none
    can overflow it: a capacity of all a device's ids, as the DLRM trainer's)."""
    if overflow not in OVERFLOW:
        raise EmbedError(f"overflow={overflow!r}: must be one of {', '.join(OVERFLOW)}")
    values = np.asarray(x.values, np.int64)
    lengths = np.asarray(x.lengths, np.int64)
    weights = np.ones(len(values), np.float32) if x.weights is None else np.asarray(x.weights, np.float32)
    if process is not None:
        return _per_process(spec, values, lengths, weights, combiner, shards, process, gather,
                            capacity=capacity, overflow=overflow, feature=feature or spec.name)
    b, n = len(lengths), len(values)
    sample = np.repeat(np.arange(b), lengths)
    if spec.placement != "row":
        size = next_pow2(n)
        uv, inv = np.unique(values, return_inverse=True)
        # A batch reads at most all the table's rows: a fixed buffer need not be longer.
        fixed = min(size, next_pow2(spec.rows))
        uniq = np.full(max(fixed if capacity is not None else next_pow2(len(uv)), MIN_CAPACITY), PAD, np.int32)
        uniq[:len(uv)] = uv
        slot, seg, w = np.zeros(size, np.int32), np.full(size, b, np.int32), np.zeros(size, np.float32)
        slot[:n], seg[:n], w[:n] = inv.reshape(-1), sample, weights
        return Routed(spec.placement, shards, b, b, uniq, slot, seg, w, _scale(w, seg, b, combiner), combiner)

    s = shards
    per = max(-(-b // s), 1)
    pair = (sample // per) * s + values % s  # source device, owner
    order = np.argsort(pair, kind="stable")
    counts = np.bincount(pair, minlength=s * s)
    need = int(counts.max()) if n else 0
    cap = capacity if capacity is not None else max(next_pow2(need), MIN_CAPACITY)
    if cap < 1:
        raise EmbedError(f"capacity={cap}: must be positive")
    pair_sorted = pair[order]
    place = _places(pair_sorted, counts)
    keep = place < cap
    dropped = int(n - keep.sum())
    if dropped and overflow == "raise":
        raise EmbedError(_overflowed(feature or spec.name, spec, need, cap, "one device"))
    idx, pos, kept = pair_sorted[keep], place[keep], order[keep]
    # Each owner's distinct rows, in id order: their place in the owner's list is each id's slot.
    uv, inv = np.unique(values[kept], return_inverse=True)
    owner = uv % s
    by_owner = np.argsort(owner, kind="stable")
    per_owner = np.bincount(owner, minlength=s)
    rank = np.empty(len(uv), np.int64)
    rank[by_owner] = _places(owner[by_owner], per_owner)
    if capacity is not None:  # fixed: every id one owner could receive, but no more than the rows it holds
        u = max(min(s * cap, next_pow2(-(-spec.rows // s))), MIN_CAPACITY)
    else:
        u = max(next_pow2(int(per_owner.max()) if len(uv) else 0), MIN_CAPACITY)
    uniq = np.full((s, u), PAD, np.int32)
    uniq[owner, rank] = uv // s
    slot = np.zeros((s * s, cap), np.int32)
    seg = np.full((s * s, cap), per, np.int32)
    w = np.zeros((s * s, cap), np.float32)
    slot[idx, pos] = rank[inv.reshape(-1)]
    seg[idx, pos] = sample[kept] % per
    w[idx, pos] = weights[kept]
    keep_w = np.zeros(n, np.float32)
    keep_w[kept] = weights[kept]
    scale = _scale(keep_w, sample, s * per, combiner)
    return Routed("row", s, b, per, uniq, slot.reshape(s, s, cap), seg.reshape(s, s, cap), w.reshape(s, s, cap),
                  scale, combiner, dropped)


def _overflowed(feature: str, spec: TableSpec, need: int, cap: int, source: str) -> str:
    to = "one shard of table" if spec.placement == "row" else "table"
    return (f"feature {feature!r}: {need} ids go from {source} to {to} {spec.name!r} in this batch, past the "
            f"buffer's capacity={cap}: raise it, leave it unset to size it from the data, or set "
            f"overflow='drop' to drop and count them")


def _per_process(spec: TableSpec, values: np.ndarray, lengths: np.ndarray, weights: np.ndarray, combiner: str,
                 shards: int, process: tuple[int, int], gather: Callable[[int], Sequence[int]] | None, *,
                 capacity: int | None, overflow: str, feature: str) -> Routed:
    """This process's samples laid out for its own devices (the module's docstring)."""
    index, count = process
    if gather is None and count > 1 and capacity is None:
        raise ValueError("a capacity sized from the data on several processes needs gather (each process's need)")
    if spec.placement in ("table", "data"):
        raise EmbedError(f"table {spec.name!r}: {spec.placement}-wise tables are not routed per process yet (a "
                         f"table-wise owner would need every process's ids; a data-parallel table is pooled by the "
                         f"model's step); place it row- or column-wise")
    if count < 1 or not 0 <= index < count or shards % count:
        raise EmbedError(f"process {index} of {count}: the {shards} devices must split evenly over the processes")
    s, local = shards, shards // count
    b, n = len(lengths), len(values)
    if b % local:
        raise EmbedError(f"feature {feature!r}: process {index}'s {b} samples do not split over its {local} devices")
    per = max(b // local, 1)
    sample = np.repeat(np.arange(b), lengths)
    row = spec.placement == "row"
    bins = local * s if row else local
    pair = (sample // per) * s + values % s if row else sample // per  # source device (and owner)
    order = np.argsort(pair, kind="stable") if row else np.arange(n)  # (by device: in sample order already)
    counts = np.bincount(pair, minlength=bins)
    mine = int(counts.max()) if n else 0
    needs = [int(v) for v in gather(mine)] if gather is not None else None  # the one collective
    need = max(needs) if needs else mine
    cap = capacity if capacity is not None else max(next_pow2(need), MIN_CAPACITY)
    if cap < 1:
        raise EmbedError(f"capacity={cap}: must be positive")
    if need > cap and overflow == "raise":  # with gather: on every process alike, naming the one that needed it
        who = needs.index(need) if needs else index
        raise EmbedError(_overflowed(feature, spec, need, cap, f"one device of process {who}"))
    pair_sorted = pair[order]
    place = _places(pair_sorted, counts)
    keep = place < cap
    every = bool(keep.all())
    at, kept = (pair_sorted * cap + place, order) if every else ((pair_sorted * cap + place)[keep], order[keep])
    slot = np.full(bins * cap, PAD, np.int32)
    seg = np.full(bins * cap, per, np.int32)
    w = np.zeros(bins * cap, np.float32)
    slot[at] = values[kept] // s if row else values[kept]
    seg[at] = sample[kept] % per
    w[at] = weights[kept]
    keep_w = weights if every else np.zeros(n, np.float32)
    if not every:
        keep_w[kept] = weights[kept]
    shape = (local, s, cap) if row else (local, cap)
    return Routed(spec.placement, s, b, per, None, slot.reshape(shape), seg.reshape(shape), w.reshape(shape),
                  _scale(keep_w, sample, local * per, combiner), combiner, int(n - keep.sum()), count)
