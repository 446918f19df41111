"""Grain pipelines from a data source to packed training batches.

Documents flow: list of documents (lazy) -> this process's shard -> shuffled
per epoch -> repeated forever -> tokenised as ``[bos] + tokens + [eos]`` ->
packed into rows of ``seq_len`` -> rows shuffled within a window -> batched.
Packing is Grain's ``ConcatThenSplitIterDataset``: documents are concatenated
and cut at row boundaries, so a long document is split over several rows
instead of dropped (a 300 kB stdlib file is used in full), and since the stream
never ends no row needs padding. (Segment id 0 and loss weight 0 still mark
padding, for sources that may produce it.)

Each document is packed as two aligned features, ``inputs = doc[:-1]`` and
``targets = doc[1:]``. Splitting both at the same place keeps every target the
true next token of its document, also across a row boundary, so every
non-padding position carries loss.

A document continued from the previous row starts again at position 0 (Grain
restarts positions in each row); it has a new segment id in the new row, and
attention never reaches back across rows anyway.

Virtual shards (``shards`` V, ``data.shards``): the documents are V streams, shard v holding
documents v, v + V, ... and shuffled, packed and window-shuffled on its own; each global batch is,
for v = 0 .. V-1 in order, the next global_batch / V rows of shard v. A process feeds the V / P
contiguous shards of its rows, so the global batches are the same on any process count that divides
V, and a run resumes on another one with its data position exact: each shard's position is saved
(:meth:`_Stream.get_state`: ``{"shards": {v: state}}``, this process's shards), and a restoring process
takes the positions of the shards it now feeds from whichever processes saved them
(:meth:`_Stream.restore_from_files`). Shard 0's seeds are the pipeline's own, the others' keyed by
v too; unshuffled, V = P reads as each of P processes read before shards existed (shuffled, the row
window is now a numpy permutation, and the window's rows are divided among the V shards).

The returned iterator is a Grain ``DatasetIterator``: its ``get_state`` /
``set_state`` let a checkpoint resume the stream exactly. A process's shards are read, tokenised
and packed by one background thread, a few batches ahead (:data:`PREFETCH_BATCHES`).
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import grain
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset, ThreadPrefetchDatasetIterator

from hypertron.data.sources import load_documents
from hypertron.errors import DataError
from hypertron.tokenizer import ByteTokenizer, Tokenizer, check_vocab, get_tokenizer

# A process's shards are read and tokenised on one thread (the prefetching one below), not each
# shard on threads of its own: eight shards would hold sixteen threads and 256 documents ahead.
_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
# Batches a process's thread makes ahead of training.
PREFETCH_BATCHES = 4
# Packed rows are shuffled within a window of about half a million tokens (at
# most 1024 rows): filling the first window takes ~0.2 s on the stdlib corpus
# and ~1 s for corpora of 100-byte documents, on two CPU cores.
_ROW_SHUFFLE_TOKENS = 2**19
_ROW_SHUFFLE_MAX_ROWS = 1024


def make_batches(
    *,
    source: str,
    paths: tuple[str, ...] = (),
    text_field: str = "text",
    tokenizer: str = "byte",
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    process_index: int = 0,
    process_count: int = 1,
    shards: int | None = None,
    fewer_shards_for_few_documents: bool = False,
    vocab_size: int = 259,
    split: str = "train",
    eval_fraction: float = 0.0,
) -> Iterator[dict[str, np.ndarray]]:
    """An endless, deterministic stream of packed batches for this process.

    Each batch is a dict of numpy arrays of shape [batch_size, seq_len]:
    ``inputs`` / ``targets`` (int32 token ids, targets the next token of the
    same document), ``segment_ids`` (int32, 1, 2, ... per document within a
    row, 0 on padding), ``positions`` (int32, position within the document;
    a document continued from the previous row restarts at 0) and ``loss_weights`` (float32, 1 on real
    targets, 0 on padding).

    ``batch_size`` is per process. The documents are split into ``shards`` streams
    (default: one a process) before shuffling (the module docstring): this process feeds shards
    ``process_index * shards / process_count`` on, ``batch_size * process_count / shards``
    rows of each a batch, so processes read disjoint documents and the global batch
    does not depend on ``process_count``. Epochs repeat forever, reshuffled per epoch
    from ``seed`` (and the shard); ``fewer_shards_for_few_documents`` (``data.shards`` 0): a corpus of
    fewer documents than ``shards`` takes the largest divisor of it that has a document a shard
    (the same on every process count it allows). ``source="synthetic"`` gives uniform random ids in
    [3, vocab_size), one document per row, keyed by (seed, shard, row), reading no files.

    ``split`` is ``"train"`` or ``"eval"``: a fraction ``eval_fraction`` of the
    documents, spread evenly through the corpus (see :func:`held_out`), is
    held out of training and makes up the eval split. For synthetic data the
    eval split is an independent random stream.

    Raises :class:`DataError` for bad settings or an empty corpus, before any
    batch is made.
    """
    _check_sizes(seq_len=seq_len, batch_size=batch_size, process_index=process_index,
                 process_count=process_count, seed=seed)
    if split not in ("train", "eval"):
        raise DataError(f"split={split!r}: expected 'train' or 'eval'")
    shards = process_count if shards is None else shards
    _check_shards(shards, batch_size * process_count, process_count)
    if source == "synthetic":
        if vocab_size <= ByteTokenizer.eos_id + 1:
            raise DataError(f"model.vocab_size={vocab_size}: synthetic data needs more than 3 ids")
        streams = {v: _synthetic_rows(seq_len=seq_len, vocab_size=vocab_size, seed=seed, shard=v,
                                      stream=int(split == "eval")) for v in _mine(shards, process_index, process_count)}
    else:
        documents = _split(load_documents(source, paths, text_field, tokenizer=tokenizer), split, eval_fraction)
        text_tokenizer = get_tokenizer(tokenizer)
        check_vocab(text_tokenizer, vocab_size)
        # The eval split (never checkpointed) may always take fewer: it is a fraction of the corpus.
        if (fewer_shards_for_few_documents or split == "eval") and len(documents) < shards:
            shards = max([v for v in range(1, len(documents) + 1) if shards % v == 0 and v % process_count == 0],
                         default=shards)  # none fits: _packed_rows says the corpus is too small
        streams = {v: _packed_rows(documents, text_tokenizer, seq_len=seq_len, seed=seed, shuffle=shuffle,
                                   shard=v, shards=shards) for v in _mine(shards, process_index, process_count)}
    return _Stream(_Shards({v: _JsonStateIterator(iter(s)) for v, s in streams.items()},
                           rows=batch_size * process_count // shards))


def balanced_order(seq_len: int, context: int) -> np.ndarray:
    """The order of a row's tokens for context parallelism over ``context`` devices with load
    balancing (``model.context_load_balance``): the row cut into ``2 * context`` chunks, device
    ``i`` (the ``i``-th of ``context`` equal parts of the reordered row) holding chunks ``i`` and
    ``2 * context - 1 - i``. Under a causal mask the late chunks score the most keys, so each
    device then scores as many pairs of one document as any other (torchtitan's and MaxText's
    head-tail split). ``seq_len`` must divide into the ``2 * context`` chunks."""
    chunks = np.arange(seq_len).reshape(2 * context, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[-1 - i]]) for i in range(context)])


def balance_rows(rows: dict[str, np.ndarray], context: int) -> dict[str, np.ndarray]:
    """``rows`` (arrays ``[rows, seq_len]``: inputs, targets, positions, segment ids, loss weights
    alike) with each row's tokens in :func:`balanced_order`. The loss is a sum over tokens and
    attention masks by positions and segment ids, so nothing else changes."""
    order = balanced_order(next(iter(rows.values())).shape[1], context)
    return {k: v[:, order] for k, v in rows.items()}


class _Shards:
    """This process's shards' row iterators (``{shard: iterator}``), ``rows`` rows of each a batch
    in shard order. Its state is ``{"shards": {str(shard): state}}`` as JSON text (the prefetching
    thread copies a state a batch, and a string is copied for nothing: a deep copy of eight shards'
    nested states cost a sixth of the pipeline); ``set_state`` takes a state holding at least its
    own shards' (others are ignored)."""

    def __init__(self, iterators: dict[int, grain.DatasetIterator], rows: int):
        self._iterators, self._rows = iterators, rows

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rows = [next(it) for it in self._iterators.values() for _ in range(self._rows)]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def get_state(self) -> str:
        return json.dumps({"shards": {str(v): it.get_state() for v, it in self._iterators.items()}})

    def set_state(self, state: str) -> None:
        saved = json.loads(state).get("shards", {})
        missing = [v for v in self._iterators if str(v) not in saved]
        if missing:
            raise DataError(f"the saved data position has no state for shards {missing} (saved: "
                            f"{sorted(saved, key=int)}); data.shards or the data settings changed")
        for v, it in self._iterators.items():
            it.set_state(saved[str(v)])


class _Stream(grain.DatasetIterator):
    """A process's batches, made a few ahead on one thread, with the state of the last one taken
    (Grain's ``ThreadPrefetchDatasetIterator`` over :class:`_Shards`)."""

    def __init__(self, shards: _Shards):
        super().__init__()
        self._prefetch = ThreadPrefetchDatasetIterator(shards, PREFETCH_BATCHES)

    def __next__(self):
        return next(self._prefetch)

    def get_state(self):
        return json.loads(self._prefetch.get_state())

    def set_state(self, state):
        self._prefetch.set_state(json.dumps(state))

    def start_prefetch(self) -> None:
        self._prefetch.start_prefetch()

    def close(self) -> None:
        if not sys.is_finalizing():  # at exit Grain's module globals may be gone already
            self._prefetch.close()

    def restore_from_files(self, paths: Iterable[Path]) -> None:
        """Take this process's shards' positions from the states saved in ``paths`` (JSON, one per
        process of the saving run, whatever their number: :meth:`_Shards.get_state`'s)."""
        merged: dict = {}
        for path in paths:
            merged.update(json.loads(Path(path).read_text()).get("shards", {}))
        self.set_state({"shards": merged})


class Wrapped(grain.DatasetIterator):
    """A Grain iterator that passes batches and states through to the one it wraps: the base of a
    wrapper that changes one thing about them."""

    def __init__(self, parent: grain.DatasetIterator):
        super().__init__(parent)

    def __next__(self):
        return next(self._parent)

    def get_state(self):
        return self._parent.get_state()

    def set_state(self, state):
        self._parent.set_state(state)


class _JsonStateIterator(Wrapped):
    """The pipeline's iterator, with a state that survives a JSON round trip.

    Grain's checkpoint handler stores iterator states as JSON, which turns
    tuples into lists; ``ConcatThenSplitIterDataset.set_state`` then compares
    its ``remainder_slices`` to the tuple ``(-1, -1)`` and takes every list for
    a remainder, so a restored stream goes wrong (grain 0.2.18). This wrapper
    turns those slices back into tuples before restoring.
    """

    def set_state(self, state):
        self._parent.set_state(_slices_as_tuples(state))

    def start_prefetch(self) -> None:
        self._parent.start_prefetch()


def _slices_as_tuples(state):
    if isinstance(state, dict):
        return {k: ({f: tuple(v) for f, v in val.items()} if k == "remainder_slices" else _slices_as_tuples(val))
                for k, val in state.items()}
    return state


def held_out(num_documents: int, eval_fraction: float) -> np.ndarray:
    """Boolean mask [num_documents]: which documents form the eval split.

    Document ``i`` is held out when the fractional part of ``i * 0.618...``
    (the golden ratio's) is below ``eval_fraction``: about that fraction of
    the documents, spread evenly over a corpus sorted by path rather than
    taken from its end, and the same on every machine.
    """
    golden = (np.sqrt(5.0) - 1.0) / 2.0
    return np.modf(np.arange(num_documents) * golden)[0] < eval_fraction


def _split(documents: grain.MapDataset, split: str, eval_fraction: float) -> grain.MapDataset:
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"data.eval_fraction={eval_fraction}: must be in [0, 1)")
    if eval_fraction == 0.0:
        if split == "eval":
            raise DataError("data.eval_fraction=0 holds out no documents for evaluation")
        return documents
    mask = held_out(len(documents), eval_fraction)
    indices = np.flatnonzero(mask if split == "eval" else ~mask)
    if len(indices) == 0:
        raise DataError(
            f"data.eval_fraction={eval_fraction} leaves no {split} documents of {len(documents)}"
        )
    return grain.MapDataset.source(indices).map(lambda i: documents[int(i)])


def _check_sizes(*, seq_len: int, batch_size: int, process_index: int, process_count: int,
                 seed: int) -> None:
    if seq_len <= 0:
        raise DataError(f"train.seq_len={seq_len}: must be positive")
    if batch_size <= 0:
        raise DataError(f"batch_size={batch_size}: must be positive")
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} is outside 0..{process_count - 1}")
    if seed < 0:
        raise DataError(f"data.seed={seed}: must be non-negative")


def resolve_shards(asked: int, global_batch: int, readers: int) -> int:
    """``data.shards``: ``asked``, or for 0 the largest of 8, 4, 2 and 1 that divides ``global_batch``
    and that the ``readers`` (processes feeding their own rows) divide, else one a reader (a resume
    then needs the same process count). :func:`make_batches` refuses an ``asked`` the readers do not
    divide, in one line."""
    if asked:
        return asked
    fits = [v for v in (8, 4, 2, 1) if global_batch % v == 0 and v % readers == 0]
    return fits[0] if fits else readers


def _mine(shards: int, process_index: int, process_count: int) -> range:
    """The shards process ``process_index`` of ``process_count`` feeds: a contiguous block."""
    return range(process_index * shards // process_count, (process_index + 1) * shards // process_count)


def _check_shards(shards: int, global_batch: int, process_count: int) -> None:
    if shards < 1:
        raise DataError(f"data.shards={shards}: must be at least 1")
    if shards % process_count:
        raise DataError(f"data.shards={shards}: the {process_count} processes that read the data must divide it "
                        f"(each feeds the same number of shards)")
    if global_batch % shards:
        raise DataError(f"data.shards={shards} must divide the global batch of {global_batch} rows "
                        f"(each shard gives the same number of rows)")


def _packed_rows(
    documents: grain.MapDataset,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    seed: int,
    shuffle: bool,
    shard: int,
    shards: int,
) -> grain.IterDataset:
    """Shard ``shard`` of ``shards``' rows of packed documents: dicts of arrays of shape [seq_len]
    (see make_batches)."""
    # Shard before shuffling: the shard is then a fixed set of documents, whatever the seed.
    docs = documents[shard::shards]
    if len(docs) == 0:
        raise DataError(
            f"data: the corpus has {len(documents)} training documents, too few for data.shards={shards}"
        )
    epochs = _ShuffledEpochs(docs, seed=seed, shard=shard) if shuffle else docs.repeat()
    examples = epochs.map(functools.partial(_document_example, tokenizer))
    packed = ConcatThenSplitIterDataset(
        examples.to_iter_dataset(_READ_OPTIONS),
        length_struct={"inputs": seq_len, "targets": seq_len},
    )
    rows = packed.map(_training_row)
    if shuffle:
        # A long document fills many consecutive rows; mixing rows within a
        # window keeps one big file from making up whole batches in a row.
        # The V shards divide the window's rows among them (a process holds its shards' parts).
        window_rows = max(1, min(_ROW_SHUFFLE_MAX_ROWS, _ROW_SHUFFLE_TOKENS // seq_len) // shards)
        rows = _WindowShuffle(rows, window=window_rows, seed=seed, shard=shard)
    return rows


def _shard_key(shard: int, *key: int) -> tuple[int, ...]:
    """A shuffle's random key for ``shard``: ``key``, with the shard appended past shard 0 (whose
    key is the unsharded pipeline's)."""
    return key + ((shard,) if shard else ())


class _ShuffledEpochs(grain.MapDataset):
    """The parent repeated forever, each epoch in its own random order.

    Element ``i`` is ``parent[order_e[i % n]]`` for epoch ``e = i // n``, where
    ``order_e`` is a numpy permutation seeded by ``(seed, e)`` (``(seed, e, shard)`` past shard 0). Grain's own
    ``shuffle`` computes each index with ``index_shuffle``, which costs
    milliseconds per index on small datasets (10 ms for 2 documents, 0.3 ms for
    100, measured with grain 0.2.18); one permutation per epoch is O(n) once.
    Being a ``MapDataset``, its iterator state is still just the next index.
    """

    _MUTATES_ELEMENT_SPEC = False

    def __init__(self, parent: grain.MapDataset, *, seed: int, shard: int = 0):
        super().__init__(parent)
        self._seed = seed
        self._shard = shard
        self._parent_length = len(parent)
        self._order = (-1, np.zeros(0, np.int64))  # (epoch, permutation): the latest epoch's order

    def __len__(self) -> int:
        return sys.maxsize

    def __str__(self) -> str:
        return f"_ShuffledEpochs(seed={self._seed})"

    def _epoch_order(self, epoch: int) -> np.ndarray:
        cached_epoch, order = self._order  # one read: another thread may replace it concurrently
        if cached_epoch != epoch:
            order = np.random.default_rng(_shard_key(self._shard, self._seed, epoch)).permutation(self._parent_length)
            self._order = (epoch, order)
        return order

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        epoch, index_in_epoch = divmod(index, self._parent_length)
        return self._parent[int(self._epoch_order(epoch)[index_in_epoch])]


class _WindowShuffle(grain.IterDataset):
    """The parent's elements in windows of ``window``, each window in a numpy permutation seeded by
    ``(seed, window index)`` (``(seed, window index, shard)`` past shard 0). Grain's
    ``WindowShuffleIterDataset`` draws each position with ``index_shuffle``, whose cost grows as the
    window shrinks (28 us an element for 1,024, 200 for 128: grain 0.2.18, this project's CPU), which
    eight shards' windows of 128 rows made most of the pipeline's time. The same state as Grain's:
    the parent's state at the window's start and the position in it."""

    def __init__(self, parent: grain.IterDataset, *, window: int, seed: int, shard: int = 0):
        super().__init__(parent)
        self._window, self._seed, self._shard = window, seed, shard

    def __iter__(self):
        return _WindowShuffleIterator(self._parent.__iter__(), self._window, self._seed, self._shard)


class _WindowShuffleIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, window: int, seed: int, shard: int):
        super().__init__(parent)
        self._size, self._seed, self._shard = window, seed, shard
        self._index, self._pos, self._window = 0, 0, []
        self._start = self._parent.get_state()

    def _fill(self) -> None:
        rows = [next(self._parent) for _ in range(self._size)]  # the stream is endless
        order = np.random.default_rng(_shard_key(self._shard, self._seed, self._index)).permutation(len(rows))
        self._window = [rows[i] for i in order]

    def __next__(self):
        if self._pos == len(self._window):
            if self._window:
                self._index += 1
            self._start = self._parent.get_state()
            self._pos = 0
            self._fill()
        self._pos += 1
        return self._window[self._pos - 1]

    def get_state(self):  # self._start is replaced, never changed in place
        return {"parent_window_start_state": self._start, "window_index": self._index,
                "pos_in_window": self._pos}

    def set_state(self, state):
        self._start = copy.deepcopy(state["parent_window_start_state"])
        self._parent.set_state(self._start)
        self._index, self._pos = state["window_index"], state["pos_in_window"]
        self._fill()


def _document_example(tokenizer: Tokenizer, document: str | np.ndarray) -> dict[str, np.ndarray]:
    """One document as aligned ``inputs`` / ``targets``, each of shape [num_tokens + 1].

    ``document`` is text, or ids tokenised already (an integer array of shape
    [num_tokens], from the ``tokens`` source), which are framed the same way
    without encoding: ``[bos] + ids + [eos]``. A special token the tokenizer
    does not have is left out (shapes [num_tokens]; an empty document then
    adds nothing to the rows).
    """
    if isinstance(document, str):
        ids = tokenizer.encode_array(document)
    else:
        ids = np.asarray(document)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise DataError(f"data: pre-tokenised documents must be 1-D integer ids, not {ids.dtype} "
                            f"of shape {ids.shape}")
        if ids.size and int(ids.max()) >= tokenizer.vocab_size:
            raise DataError(f"data.tokenizer: a pre-tokenised document has id {int(ids.max())}, "
                            f"beyond the {tokenizer.vocab_size} ids of {tokenizer.name}")
    bos = [np.array([tokenizer.bos_id], np.int32)] if tokenizer.bos_id is not None else []
    eos = [np.array([tokenizer.eos_id], np.int32)] if tokenizer.eos_id is not None else []
    tokens = np.concatenate([*bos, ids.astype(np.int32, copy=False), *eos])
    return {"inputs": tokens[:-1], "targets": tokens[1:]}


def _training_row(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rename Grain's packing outputs to the training names; all arrays are [seq_len]."""
    segment_ids = packed["inputs_segment_ids"].astype(np.int32)
    return {
        "inputs": packed["inputs"].astype(np.int32),
        "targets": packed["targets"].astype(np.int32),
        "segment_ids": segment_ids,
        "positions": packed["inputs_positions"].astype(np.int32),
        # Every packed target is the true next token of its document, so only padding is masked.
        "loss_weights": (segment_ids > 0).astype(np.float32),
    }


def _synthetic_rows(*, seq_len: int, vocab_size: int, seed: int, shard: int,
                    stream: int = 0) -> grain.IterDataset:
    """Endless rows of random ids, one document per row, each array of shape [seq_len]."""
    row_ids = grain.MapDataset.range(sys.maxsize)
    make_row = functools.partial(_synthetic_row, seq_len=seq_len, vocab_size=vocab_size,
                                 seed=seed, shard=shard, stream=stream)
    return row_ids.map(make_row).to_iter_dataset(_READ_OPTIONS)


def _synthetic_row(row_id: int, *, seq_len: int, vocab_size: int, seed: int,
                   shard: int, stream: int) -> dict[str, np.ndarray]:
    # Seeding by (seed, shard, row) makes every row reproducible on its own,
    # so a restored iterator gives the same rows without replaying the stream.
    # The eval stream (1) appends a key, leaving the train stream (0) unchanged.
    key = (seed, shard, row_id) + ((stream,) if stream else ())
    rng = np.random.default_rng(key)
    tokens = rng.integers(ByteTokenizer.eos_id + 1, vocab_size, size=seq_len + 1, dtype=np.int32)
    return {
        "inputs": tokens[:-1],
        "targets": tokens[1:],
        "segment_ids": np.ones(seq_len, np.int32),
        "positions": np.arange(seq_len, dtype=np.int32),
        "loss_weights": np.ones(seq_len, np.float32),
    }
