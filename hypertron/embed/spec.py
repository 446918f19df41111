"""Embedding tables, the features that read them, and their multi-hot input.

A :class:`TableSpec` is one table (``rows`` x ``dim``), its optimiser, and where it lives over the
mesh (``placement``: ``row``, rows dealt out by id modulo the shard count, as jax-tpu-embedding
does; ``column``, each shard a slice of the dimension; ``table``, the whole table on one device;
``data``, the whole table on every device, each pooling its own samples and the gradients summed
over the devices, as TorchRec's ``data_parallel`` keeps small tables). A :class:`FeatureSpec` names
the table it reads and how a sample's ids are pooled (``combiner``: ``sum``, ``mean``, ``sqrtn``);
several features may share a table. A feature's input for a batch is a :class:`Jagged` (TorchRec's
KeyedJaggedTensor for one key): the ids of every sample one after another (``values``), how many
each sample has (``lengths``, 0 for an empty sample) and, optionally, a weight per id.

Everything here runs on the host, before anything compiles: :func:`check_specs` (a feature naming
no table, a column split that does not divide a table's dimension, a table that fits no device
under its placement) and :func:`check_ids` (an id
past its table or negative, lengths that do not add up) raise :class:`EmbedError`, one line naming
the feature or table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from hypertron.errors import UserError
from hypertron.units import describe_bytes

COMBINERS = ("sum", "mean", "sqrtn")
PLACEMENTS = ("row", "column", "table", "data")
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")


class EmbedError(UserError):
    """A mistake in the embedding specs or their input; one line naming the feature or table."""


@dataclasses.dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    dim: int
    placement: str = "row"
    init_scale: float | None = None  # init_table: uniform(-scale, scale); None: sqrt(1 / rows), as TorchRec
    optimizer: str = "sgd"  # sgd, adagrad (a state per value), rowwise_adagrad (one per row)

    def device_bytes(self, shards: int, placement: str | None = None) -> int:
        """The most bytes one device holds of this table and its optimiser state (float32) under
        ``placement`` (its own when None) over ``shards`` devices."""
        placement = placement or self.placement
        state = {"sgd": 0, "adagrad": self.dim, "rowwise_adagrad": 1}[self.optimizer]
        if placement == "row":
            return -(-self.rows // shards) * (self.dim + state) * 4
        if placement == "column":  # row-wise Adagrad's accumulator is whole on every shard
            return self.rows * (self.dim // shards + (state // shards if self.optimizer == "adagrad" else state)) * 4
        return self.rows * (self.dim + state) * 4


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    name: str
    table: str
    combiner: str = "sum"


@dataclasses.dataclass(frozen=True)
class Jagged:
    """One feature's ids for a batch: ``values [N]`` (int), ``lengths [batch]`` (their sum is N),
    ``weights [N]`` (float) or None for weight 1."""

    values: np.ndarray
    lengths: np.ndarray
    weights: np.ndarray | None = None

    @property
    def batch(self) -> int:
        return len(self.lengths)


def check_specs(tables: Sequence[TableSpec], features: Sequence[FeatureSpec], shards: int,
                device_bytes: int | None = None) -> dict[str, TableSpec]:
    """The tables by name, once every spec is usable on ``shards`` devices of ``device_bytes``
    each (not checked when None); else :class:`EmbedError`."""
    by_name: dict[str, TableSpec] = {}
    for t in tables:
        if t.name in by_name:
            raise EmbedError(f"table {t.name!r}: defined twice")
        if t.rows < 1 or t.dim < 1:
            raise EmbedError(f"table {t.name!r}: rows={t.rows}, dim={t.dim}: both must be positive")
        if t.placement not in PLACEMENTS:
            raise EmbedError(f"table {t.name!r}: placement={t.placement!r}: must be one of {', '.join(PLACEMENTS)}")
        if t.optimizer not in OPTIMIZERS:
            raise EmbedError(f"table {t.name!r}: optimizer={t.optimizer!r}: must be one of {', '.join(OPTIMIZERS)}")
        if t.placement == "column" and t.dim % shards:
            raise EmbedError(f"table {t.name!r}: dim={t.dim} does not split into {shards} column shards")
        if device_bytes is not None and t.device_bytes(shards) > device_bytes:
            raise EmbedError(f"table {t.name!r}: {t.rows} x {t.dim} with {t.optimizer} needs "
                             f"{describe_bytes(t.device_bytes(shards))} on a device {t.placement}-wise over "
                             f"{shards} devices, more than a device's {describe_bytes(device_bytes)}")
        by_name[t.name] = t
    names = set()
    for f in features:
        if f.name in names:
            raise EmbedError(f"feature {f.name!r}: defined twice")
        names.add(f.name)
        if f.table not in by_name:
            raise EmbedError(f"feature {f.name!r} reads table {f.table!r}, which is not defined "
                             f"(tables: {', '.join(sorted(by_name)) or 'none'})")
        if f.combiner not in COMBINERS:
            raise EmbedError(f"feature {f.name!r}: combiner={f.combiner!r}: must be one of {', '.join(COMBINERS)}")
    return by_name


# What check_ids can find wrong with a feature's input, by code (a process's code is what the others learn).
_PROBLEMS = {1: "no input in the batch", 2: "a sample count unlike the other features'",
             3: "lengths that do not add up to its ids (or a negative length)", 4: "weights unlike its ids in number",
             5: "an id that is not a row of its table"}


def _problem(features: Sequence[FeatureSpec], tables: Mapping[str, TableSpec],
             batch: Mapping[str, Jagged]) -> tuple[int, int, str] | None:
    """The first thing wrong with ``batch``: (the feature's index, a :data:`_PROBLEMS` code, the
    message), or None."""
    size = None
    for i, f in enumerate(features):
        if f.name not in batch:
            return i, 1, f"feature {f.name!r}: no input in the batch"
        x, rows = batch[f.name], tables[f.table].rows
        if size is not None and x.batch != size:
            return i, 2, f"feature {f.name!r}: {x.batch} samples, the other features {size}"
        size = x.batch
        if (np.asarray(x.lengths) < 0).any() or int(np.sum(x.lengths)) != len(x.values):
            return i, 3, (f"feature {f.name!r}: lengths add up to {int(np.sum(x.lengths))} but there are "
                          f"{len(x.values)} ids (or a length is negative)")
        if x.weights is not None and len(x.weights) != len(x.values):
            return i, 4, f"feature {f.name!r}: {len(x.weights)} weights for {len(x.values)} ids"
        values = np.asarray(x.values)
        bad = values[(values < 0) | (values >= rows)]
        if bad.size:
            return i, 5, (f"feature {f.name!r}: id {int(bad[0])} is not a row of table {f.table!r} "
                          f"(0 to {rows - 1}); {bad.size} such ids in this batch")
    return None


def check_ids(features: Sequence[FeatureSpec], tables: Mapping[str, TableSpec], batch: Mapping[str, Jagged], *,
              gather: Callable[[int], Sequence[int]] | None = None) -> None:
    """Every feature's input is there and well formed, and every id is a row of its table.

    On several processes (``gather``: each process's value of a host integer, in process order, one
    small collective) each checks its own samples and every process raises the same error, naming
    the feature, what is wrong and the first process that found it, so none goes on into a step
    the others left (and waits for them there)."""
    found = _problem(features, tables, batch)
    if gather is None:
        if found:
            raise EmbedError(found[2])
        return
    codes = [int(c) for c in gather(0 if found is None else found[0] * 8 + found[1])]
    bad = next((p for p, c in enumerate(codes) if c), None)
    if bad is not None:
        f = features[codes[bad] // 8]
        what = _PROBLEMS[codes[bad] % 8].replace("its table", f"table {f.table!r} (0 to {tables[f.table].rows - 1})")
        raise EmbedError(f"feature {f.name!r}: {what}, in the samples of process {bad}")
