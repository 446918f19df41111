"""DLRM batches: planted-teacher synthetic samples and Criteo-format files, as Grain iterators.

A batch is a dict of numpy arrays: ``dense [B, dense_features]`` float32, ``sparse [B, sum of
ids_per_sample]`` int32 (feature ``f``'s ids in its own columns, in feature order) and ``labels
[B]`` float32 (0 or 1). Iterators are Grain's, so a checkpoint holds their position and a resumed
run reads exactly the batches it would have.

Each process reads its block of every global batch, and a global batch is the same whatever the
process count, so a run resumes on another process count with the batches it would have read: a
stream's position is the global batch's index, the same on every process
(``restore_from_files`` takes it from whichever process saved it).

**Synthetic, with a planted teacher.** A global batch is ``shards`` blocks of rows (the
``data.shards`` of the run), block ``k`` of batch ``i`` made from ``(seed, k, i, split)`` alone;
a process makes its own blocks. Dense floats are standard normal; feature ``f``'s ids are ``floor(rows * u**2)``
for uniform ``u`` (low ids are common, as in click logs). The teacher gives every row of every
table a value in ``[-1, 1)`` (a hash of ``teacher_seed``, the feature and the id: no table is
stored, so the MLPerf sizes cost nothing) and the label is drawn with probability
``sigmoid(logit)``, ``logit = teacher_scale * s * (1 + tanh(w . dense / sqrt(D)) / 2)``, ``s`` the sum
over features of the mean of their ids' values, scaled to unit variance. The dense floats only
scale the sparse signal: ``s`` is symmetric about zero and independent of them, so labels carry no
information about the dense floats alone. A model whose embeddings are zeroed then ranks no
better than chance (AUC 0.5), which shows that what it learned is in the tables.

**Criteo-format files** (the Criteo 1TB click logs, and Kaggle's Display Advertising data): one
sample per line, tab-separated: the label, 13 integer counts and 26 categorical ids in hex; empty
fields are allowed. As the DLRM reference reads them, a count becomes ``log(1 + max(x, 0))`` and an
id is taken modulo its table's rows (an empty one is 0). These lines have one id per feature, so
``ids_per_sample`` must be all 1. The lines of each file are indexed once (8 bytes a line, through
a memory map), then read in a seeded shuffled order, epoch after epoch: global batch ``i`` is
lines ``i * B`` to ``(i + 1) * B - 1`` of that order, and a process parses its block of them.
"""

from __future__ import annotations

import functools
import json
import mmap
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import grain
import numpy as np

from hypertron.config import DlrmConfig
from hypertron.data.pipeline import Wrapped
from hypertron.errors import DataError

_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 that scrambles every bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def teacher_values(seed: int, feature: int, ids: np.ndarray) -> np.ndarray:
    """The planted teacher's value of each row ``ids`` of table ``feature``, uniform in ``[-1, 1)``."""
    salt = _mix(np.array([(seed * 1_000_003 + feature) & 0xFFFFFFFFFFFF], np.uint64))
    x = _mix(np.asarray(ids, np.uint64) ^ salt)
    return (x >> np.uint64(11)).astype(np.float64) * (2.0 / 2**53) - 1.0


def teacher_logits(cfg: DlrmConfig, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    """The teacher's logit of each sample (see the module's docstring)."""
    s = np.zeros(len(dense))
    start = 0
    for f, hot in enumerate(cfg.ids_per_sample):
        s += teacher_values(cfg.teacher_seed, f, sparse[:, start:start + hot]).mean(axis=1)
        start += hot
    s /= np.sqrt(sum(1.0 / (3.0 * hot) for hot in cfg.ids_per_sample))  # unit variance
    w = np.random.default_rng((cfg.teacher_seed, 1)).standard_normal(cfg.dense_features)
    gain = 1.0 + 0.5 * np.tanh(dense @ w / np.sqrt(cfg.dense_features))
    return cfg.teacher_scale * s * gain


def synthetic_batch(index: int, *, cfg: DlrmConfig, batch_size: int, seed: int, stream: int = 0,
                    shards: Sequence[int] = (0,)) -> dict[str, np.ndarray]:
    """Batch ``index`` of the synthetic stream (``stream`` 1: the held-out one): ``batch_size`` rows
    of each of ``shards`` (the global batch's blocks this process makes), in shard order."""
    blocks = [_synthetic_block(index, cfg, batch_size, seed, shard, stream) for shard in shards]
    return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}


def _synthetic_block(index: int, cfg: DlrmConfig, rows: int, seed: int, shard: int, stream: int) -> dict:
    rng = np.random.default_rng((seed, shard, index, stream))
    dense = rng.standard_normal((rows, cfg.dense_features)).astype(np.float32)
    cols = []
    for table_rows, hot in zip(cfg.table_rows, cfg.ids_per_sample):
        u = rng.random((rows, hot))
        cols.append(np.minimum((table_rows * u * u).astype(np.int64), table_rows - 1))
    sparse = np.concatenate(cols, axis=1)
    p = 1.0 / (1.0 + np.exp(-teacher_logits(cfg, dense.astype(np.float64), sparse)))
    labels = (rng.random(rows) < p).astype(np.float32)
    return {"dense": dense, "sparse": sparse.astype(np.int32), "labels": labels}


class _GlobalPosition(Wrapped):
    """A process's stream whose position (the global batch's index) is the same on every process,
    so a checkpoint of any process count restores it from any process's saved state."""

    def restore_from_files(self, paths: Iterable[Path]) -> None:
        paths = list(paths)
        if not paths:
            raise DataError("the checkpoint holds no data position")
        self.set_state(json.loads(Path(paths[0]).read_text()))


class _Lines:
    """The lines of some text files, by index (each file's line starts found once)."""

    def __init__(self, paths: tuple[str, ...]):
        self._files, self._starts, self._sizes = [], [], []
        for path in paths:
            f = open(path, "rb")
            size = Path(path).stat().st_size
            if size == 0:
                f.close()
                continue
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            ends = np.flatnonzero(np.frombuffer(m, np.uint8) == 10)
            starts = np.r_[0, ends + 1]
            if starts[-1] >= size:
                starts = starts[:-1]
            self._files.append(m)
            self._starts.append(starts)
            self._sizes.append(size)
        self._offsets = np.cumsum([0] + [len(s) for s in self._starts])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, index: int) -> bytes:
        f = int(np.searchsorted(self._offsets, index, side="right")) - 1
        i = index - self._offsets[f]
        starts, m = self._starts[f], self._files[f]
        end = starts[i + 1] - 1 if i + 1 < len(starts) else self._sizes[f]
        return m[starts[i]:end]

    def __repr__(self) -> str:
        return f"_Lines({len(self)} lines)"


def parse_criteo(line: bytes, table_rows: tuple[int, ...]) -> dict[str, np.ndarray]:
    """One Criteo-format line as a sample (see the module's docstring)."""
    fields = line.rstrip(b"\r\n").split(b"\t")
    if len(fields) != 40:
        raise DataError(f"a Criteo line has 40 tab-separated fields (label, 13 counts, 26 ids), this one "
                        f"{len(fields)}: {line[:80]!r}")
    try:
        label = float(int(fields[0] or b"0") > 0)
        counts = np.array([int(x) if x else 0 for x in fields[1:14]], np.float64)
        ids = [int(x, 16) if x else 0 for x in fields[14:]]
    except ValueError:
        raise DataError(f"a Criteo line holds a field that is not a number: {line[:80]!r}") from None
    dense = np.log1p(np.maximum(counts, 0)).astype(np.float32)
    sparse = np.array([i % rows for i, rows in zip(ids, table_rows)], np.int32)
    return {"dense": dense, "sparse": sparse, "labels": np.float32(label)}


def check_files(paths: tuple[str, ...], key: str = "dlrm.paths") -> None:
    for p in paths:
        if not Path(p).is_file():
            raise DataError(f"{key}: {p} is not a file")


def make_batches(cfg: DlrmConfig, *, batch_size: int, seed: int, split: str = "train", process_index: int = 0,
                 process_count: int = 1, shards: int = 1) -> grain.DatasetIterator:
    """This process's batches of ``batch_size`` samples (its block of each global batch of
    ``batch_size * process_count``), endlessly; ``split``: ``train`` or ``eval`` (the held-out
    stream, or ``eval_paths``); ``shards``: the synthetic global batch's blocks (the processes
    divide them)."""
    if split not in ("train", "eval"):
        raise DataError(f"split={split!r}: expected 'train' or 'eval'")
    if cfg.source == "synthetic":
        if shards % process_count or (batch_size * process_count) % shards:
            raise DataError(f"data.shards={shards}: must divide the global batch of {batch_size * process_count} "
                            f"and be divided by the {process_count} processes")
        mine = range(process_index * shards // process_count, (process_index + 1) * shards // process_count)
        make = functools.partial(synthetic_batch, cfg=cfg, batch_size=batch_size // len(mine), seed=seed,
                                 stream=int(split == "eval"), shards=mine)
        return _GlobalPosition(iter(grain.MapDataset.range(sys.maxsize).map(make).to_iter_dataset(_READ_OPTIONS)))
    if any(hot != 1 for hot in cfg.ids_per_sample):
        raise DataError("dlrm.source=criteo: Criteo lines hold one id per feature; set dlrm.ids_per_sample to all 1")
    paths = cfg.paths if split == "train" else cfg.eval_paths
    check_files(paths, "dlrm.paths" if split == "train" else "dlrm.eval_paths")
    lines = _Lines(paths)
    if len(lines) < batch_size * process_count:
        raise DataError(f"{', '.join(paths)}: {len(lines)} lines, fewer than one batch of {batch_size} for each of "
                        f"{process_count} processes")
    ds = grain.MapDataset.source(lines)
    if split == "train":
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(None).map(functools.partial(parse_criteo, table_rows=cfg.table_rows))
    # Blocks of this process's size in the global order: global batch i is blocks i * P to i * P + P - 1.
    ds = ds.batch(batch_size, drop_remainder=True)[process_index::process_count]
    return _GlobalPosition(iter(ds.to_iter_dataset(_READ_OPTIONS)))
