"""Tests of the data layer: byte tokenizer, sources, and packed Grain batches.

All corpora are tiny files written to ``tmp_path``; only the stdlib test reads
the real standard library.
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

from hypertron.data import DataError, check_source, load_documents, make_batches, stdlib_paths
from hypertron.tokenizer import ByteTokenizer, get_tokenizer
from hypertron.data.pipeline import held_out

TOKENIZER = ByteTokenizer()
FIELDS = {
    "inputs": np.int32,
    "targets": np.int32,
    "segment_ids": np.int32,
    "positions": np.int32,
    "loss_weights": np.float32,
}
# Distinct documents of mixed lengths: shorter and longer than a row, non-ASCII included.
DOCUMENTS = [
    "def f(x):\n    return x + 1\n",
    "naïve café — ünïcødé ✓ 日本語",
    "a",
    "x = [i * i for i in range(10)]  # a line longer than one row of sixteen tokens\n" * 3,
    "short one",
    "another document, of middling length",
]


@pytest.fixture
def text_corpus(tmp_path):
    """DOCUMENTS as .txt files in a directory tree, plus files the source must ignore."""
    (tmp_path / "nested").mkdir()
    for i, text in enumerate(DOCUMENTS):
        folder = tmp_path / "nested" if i % 2 else tmp_path
        (folder / f"doc{i}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01 not a text file")
    (tmp_path / "empty.txt").write_text("")
    return tmp_path


def _rows(batches, num_batches):
    """The rows of the first ``num_batches`` batches, as dicts of arrays of shape [seq_len]."""
    rows = []
    for batch in itertools.islice(batches, num_batches):
        for r in range(len(batch["inputs"])):
            rows.append({name: values[r] for name, values in batch.items()})
    return rows


def _segments(row):
    """(inputs, targets, positions) of each segment of a row, checking the packing invariants."""
    segment_ids = row["segment_ids"]
    pieces = []
    for segment_id in range(1, segment_ids.max() + 1):
        where = np.flatnonzero(segment_ids == segment_id)
        assert where.size > 0, "segment ids are consecutive"
        assert np.all(np.diff(where) == 1), "a segment is one contiguous span"
        inputs, targets = row["inputs"][where], row["targets"][where]
        assert np.array_equal(row["positions"][where], np.arange(where.size))
        assert np.array_equal(targets[:-1], inputs[1:]), "targets are the next inputs"
        assert np.sum(inputs == TOKENIZER.bos_id) <= 1 and np.all(inputs[1:] != TOKENIZER.bos_id), (
            "two documents share a segment"
        )
        pieces.append(inputs.tolist() + [int(targets[-1])])
    padding = segment_ids == 0
    assert np.all(row["loss_weights"][padding] == 0)
    assert np.all(row["loss_weights"][~padding] == 1)
    assert np.all(row["inputs"][padding] == TOKENIZER.pad_id)
    return pieces


def _documents_in_order(rows):
    """Documents rebuilt from rows in stream order (continuations joined), texts in order."""
    documents, current = [], None
    for row in rows:
        for piece in _segments(row):
            # piece = inputs + last target; a new document starts with bos.
            if piece[0] == TOKENIZER.bos_id:
                current = piece
            elif current is not None:
                current = current[:-1] + piece  # drop the overlap: last target == next first input
            if current is not None and current[-1] == TOKENIZER.eos_id:
                documents.append(TOKENIZER.decode(current))
                current = None
    return documents


def _whole_documents(rows):
    """Texts of the documents that lie whole inside one segment, in any order."""
    texts = []
    for row in rows:
        for piece in _segments(row):
            if piece[0] == TOKENIZER.bos_id and piece[-1] == TOKENIZER.eos_id:
                texts.append(TOKENIZER.decode(piece))
    return texts


# --- tokenizer ---------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello, world", "naïve café ✓ 日本語 🚀", "\x00\n\t"])
def test_byte_tokenizer_round_trip(text):
    ids = TOKENIZER.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(3 <= i < TOKENIZER.vocab_size for i in ids)
    assert TOKENIZER.decode(ids) == text
    assert TOKENIZER.decode(np.array(ids, np.int32)) == text


def test_byte_tokenizer_decode_drops_special_and_out_of_range_ids():
    ids = [TOKENIZER.bos_id] + TOKENIZER.encode("ab") + [TOKENIZER.eos_id, TOKENIZER.pad_id, 259, 1000]
    assert TOKENIZER.decode(ids) == "ab"
    assert TOKENIZER.encode("A") == [ord("A") + 3]
    assert TOKENIZER.decode([0xFF + 3]) == "\ufffd"  # a lone 0xff byte is not UTF-8


def test_get_tokenizer():
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError, match="data.tokenizer"):
        get_tokenizer("sentencepiece-of-nowhere")


# --- batches -----------------------------------------------------------------


@pytest.mark.parametrize("source", ["text", "synthetic"])
def test_batch_shapes_and_dtypes(text_corpus, source):
    batches = make_batches(source=source, paths=(str(text_corpus),), seq_len=16, batch_size=3)
    for batch in itertools.islice(batches, 3):
        assert set(batch) == set(FIELDS)
        for name, dtype in FIELDS.items():
            assert batch[name].shape == (3, 16), name
            assert batch[name].dtype == dtype, name


def test_synthetic_rows():
    batch = next(make_batches(source="synthetic", seq_len=8, batch_size=4, vocab_size=50))
    assert batch["inputs"].min() >= 3 and batch["inputs"].max() < 50
    assert np.array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    assert np.all(batch["segment_ids"] == 1)
    assert np.array_equal(batch["positions"], np.tile(np.arange(8), (4, 1)))
    assert np.all(batch["loss_weights"] == 1)


def test_packing_rebuilds_the_corpus_in_order(text_corpus):
    """Without shuffling, the rows spell out the sorted files, split long documents included."""
    batches = make_batches(source="text", paths=(str(text_corpus),), seq_len=16, batch_size=4,
                           shuffle=False)
    rows = _rows(batches, 12)  # 192 tokens: more than one epoch of the corpus
    files = sorted(text_corpus.rglob("doc*.txt"), key=os.fspath)
    expected = [path.read_text(encoding="utf-8") for path in files]
    assert sorted(expected) == sorted(DOCUMENTS)
    rebuilt = _documents_in_order(rows)
    assert rebuilt[: len(expected)] == expected
    assert rebuilt[len(expected)] == expected[0], "the next epoch starts over"
    assert any(row["segment_ids"].max() > 1 for row in rows), "short documents share rows"


def test_shuffled_packing_keeps_documents_whole(text_corpus):
    batches = make_batches(source="text", paths=(str(text_corpus),), seq_len=512, batch_size=4, seed=3)
    rows = _rows(batches, 10)  # 20k tokens: dozens of epochs, so each document lies whole somewhere
    assert set(_whole_documents(rows)) == set(DOCUMENTS)


def test_jsonl_source(tmp_path):
    lines = [json.dumps({"text": text, "id": i}) for i, text in enumerate(DOCUMENTS)]
    (tmp_path / "part.jsonl").write_text("\n".join(lines[:3]) + "\n\n" + "\r\n".join(lines[3:]) + "\n")
    assert list(load_documents("jsonl", (str(tmp_path),), "text")) == DOCUMENTS
    batches = make_batches(source="jsonl", paths=(str(tmp_path / "part.jsonl"),), seq_len=32,
                           batch_size=2, shuffle=False)
    assert _documents_in_order(_rows(batches, 8))[: len(DOCUMENTS)] == DOCUMENTS


def test_determinism_and_seeds(text_corpus):
    def first_batches(seed, count=4):
        batches = make_batches(source="text", paths=(str(text_corpus),), seq_len=16, batch_size=2,
                               seed=seed)
        return [b["inputs"] for b in itertools.islice(batches, count)]

    assert all(np.array_equal(a, b) for a, b in zip(first_batches(1), first_batches(1)))
    assert all(np.array_equal(a, b) for a, b in zip(first_batches(2**40), first_batches(2**40)))
    assert not all(np.array_equal(a, b) for a, b in zip(first_batches(1), first_batches(2)))


@pytest.mark.parametrize("consumed", [1, 3, 4])
def test_iterator_state_resumes_the_stream_after_a_json_round_trip(text_corpus, consumed):
    """Checkpoints store the state as JSON (tuples become lists); the stream must still resume exactly."""
    def make():
        return make_batches(source="text", paths=(str(text_corpus),), seq_len=16, batch_size=2, seed=5)

    batches = make()
    for _ in range(consumed):
        next(batches)
    state = json.loads(json.dumps(batches.get_state()))
    expected = [next(batches)["inputs"] for _ in range(3)]
    resumed = make()
    resumed.set_state(state)
    assert all(np.array_equal(next(resumed)["inputs"], e) for e in expected)


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_eval_split_is_held_out_of_training(text_corpus, fraction):
    mask = held_out(1000, fraction)
    assert abs(mask.mean() - fraction) < 0.01
    assert mask[:10].any() and mask[-100:].any()  # spread through the corpus, not taken from one end

    def docs(split):
        batches = make_batches(source="text", paths=(str(text_corpus),), seq_len=512, batch_size=2,
                               shuffle=False, split=split, eval_fraction=fraction)
        return set(_whole_documents(_rows(batches, 6)))

    train_docs, eval_docs = docs("train"), docs("eval")
    assert train_docs and eval_docs and not train_docs & eval_docs
    assert train_docs | eval_docs == set(DOCUMENTS)


@pytest.mark.parametrize("shuffle", [False, True])
def test_processes_read_disjoint_documents(text_corpus, shuffle):
    seen = []
    for process_index in range(2):
        batches = make_batches(source="text", paths=(str(text_corpus),), seq_len=512 if not shuffle else 64,
                               batch_size=2, shuffle=shuffle, process_index=process_index, process_count=2)
        seen.append(set(_whole_documents(_rows(batches, 6))))
    assert seen[0] and seen[1]
    assert not seen[0] & seen[1]
    if not shuffle:  # rows of 512 hold every document whole
        assert seen[0] | seen[1] == set(DOCUMENTS)


def _global_batches(processes: int, count: int, corpus, **kwargs) -> list[np.ndarray]:
    """The first ``count`` global batches' inputs of 8 shards read by ``processes`` processes
    (their local batches side by side, in process order)."""
    streams = [make_batches(source="text", paths=(str(corpus),), seq_len=16, batch_size=8 // processes, seed=3,
                            shards=8, process_index=p, process_count=processes, **kwargs) for p in range(processes)]
    return [np.concatenate([next(s)["inputs"] for s in streams]) for _ in range(count)]


def test_shards_make_the_same_global_batches_on_every_process_count(tmp_path):
    """data.shards=8: one, two, four or eight processes feed the same global batches (issue 46), and
    shard 0's rows are the unsharded stream's with its window (the seeds of shard 0 are the pipeline's)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(24):
        (corpus / f"{i:02d}.txt").write_text(f"document {i}: " + "abcdefghij"[i % 10] * (5 + 7 * i))
    want = _global_batches(1, 5, corpus)
    for processes in (2, 4, 8):
        got = _global_batches(processes, 5, corpus)
        assert all(np.array_equal(a, b) for a, b in zip(want, got)), processes
    # Each shard holds its own documents: shard v's rows come from documents v, v + 8, v + 16 only.
    first = _global_batches(1, 1, corpus, shuffle=False)[0]
    for v in range(8):
        text = TOKENIZER.decode([int(t) for t in first[v] if t > 2])
        assert text.startswith(f"document {v}: "), (v, text)
    synthetic = [make_batches(source="synthetic", seq_len=8, batch_size=4 // n, shards=4, process_index=p,
                              process_count=n, vocab_size=50) for n in (1, 2) for p in range(n)]
    one, halves = next(synthetic[0])["inputs"], [next(s)["inputs"] for s in synthetic[1:]]
    np.testing.assert_array_equal(one, np.concatenate(halves))


def test_a_position_saved_by_two_processes_resumes_on_one_and_on_four(tmp_path, text_corpus):
    """Each process saves its shards' positions (as a checkpoint's data/process_P-of-N.json); a stream
    on another process count takes its own shards' from those files and goes on as the
    uninterrupted run would."""
    def streams(processes):
        return [make_batches(source="text", paths=(str(text_corpus),), seq_len=16, batch_size=4 // processes,
                             seed=7, shards=4, process_index=p, process_count=processes) for p in range(processes)]

    straight = streams(1)[0]
    want = [next(straight)["inputs"] for _ in range(6)]
    two = streams(2)
    for _ in range(3):
        for s in two:
            next(s)
    files = []
    for p, s in enumerate(two):
        files.append(tmp_path / f"process_{p}-of-2.json")
        files[-1].write_text(json.dumps(s.get_state()))
    for processes in (1, 4):
        resumed = streams(processes)
        for s in resumed:
            s.restore_from_files(files)
        got = [np.concatenate([next(s)["inputs"] for s in resumed]) for _ in range(3)]
        assert all(np.array_equal(a, b) for a, b in zip(want[3:], got)), processes
    with pytest.raises(DataError, match=r"no state for shards \[2\]"):  # process 1 of 2 saved shards 2, 3
        streams(4)[2].restore_from_files(files[:1])


def test_bad_shard_counts_are_refused_in_one_line(text_corpus):
    with pytest.raises(DataError, match=r"^data.shards=8: the 3 processes that read the data must divide it"):
        make_batches(source="text", paths=(str(text_corpus),), seq_len=8, batch_size=4, shards=8,
                     process_index=0, process_count=3)
    with pytest.raises(DataError, match=r"^data.shards=8 must divide the global batch of 4 rows"):
        make_batches(source="text", paths=(str(text_corpus),), seq_len=8, batch_size=4, shards=8)
    with pytest.raises(DataError, match=r"too few for data.shards=8"):
        next(make_batches(source="text", paths=(str(text_corpus),), seq_len=8, batch_size=8, shards=8))
    # The eval split, a few documents, always takes fewer (its position is never saved).
    held = make_batches(source="text", paths=(str(text_corpus),), seq_len=8, batch_size=8, shards=8, split="eval",
                        eval_fraction=0.5)
    assert len(held.get_state()["shards"]) < 8 and next(held)["inputs"].shape == (8, 8)
    # data.shards 0 (the task's default) takes fewer shards for a corpus of 6 documents: 4 of 8.
    few = make_batches(source="text", paths=(str(text_corpus),), seq_len=8, batch_size=8, shards=8,
                       fewer_shards_for_few_documents=True)
    assert sorted(few.get_state()["shards"]) == ["0", "1", "2", "3"]


def test_stdlib_source_yields_a_batch():
    paths = stdlib_paths()
    assert paths == sorted(paths) and len(paths) > 100
    assert not any("site-packages" in p.split(os.sep) for p in paths)
    check_source("stdlib", (), "text")
    batch = next(make_batches(source="stdlib", seq_len=256, batch_size=2))
    assert batch["inputs"].shape == (2, 256)
    assert np.all(batch["loss_weights"] == 1)


# --- errors ------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(DataError, match=f"data.paths: {missing} does not exist"):
        check_source("text", (missing,), "text")
    with pytest.raises(DataError, match="does not exist"):
        make_batches(source="jsonl", paths=(missing,), seq_len=8, batch_size=1)


def test_unknown_source_and_no_paths():
    with pytest.raises(DataError, match="data.source"):
        check_source("csv", (), "text")
    with pytest.raises(DataError, match="data.paths"):
        check_source("text", (), "text")


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "other.csv").write_text("a,b\n")
    (tmp_path / "blank.jsonl").write_text("\n  \n" + json.dumps({"text": ""}) + "\n")
    for source in ("text", "jsonl"):
        with pytest.raises(DataError, match="the corpus is empty"):
            check_source(source, (str(tmp_path),), "text")
    with pytest.raises(DataError, match="the corpus is empty"):
        make_batches(source="text", paths=(str(tmp_path / "empty.txt"),), seq_len=8, batch_size=1)


def test_jsonl_missing_field(tmp_path):
    bad_first = tmp_path / "bad_first.jsonl"
    bad_first.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(DataError, match="data.text_field: 'text' missing in line 1 of bad_first.jsonl"):
        check_source("jsonl", (str(bad_first),), "text")
    # A bad line after the first document is only found when the pipeline reads it.
    bad_later = tmp_path / "later" / "bad_later.jsonl"
    bad_later.parent.mkdir()
    bad_later.write_text("\n".join(json.dumps(r) for r in [{"text": "ok"}, {"text": "ok2"}, {"body": "x"}]))
    check_source("jsonl", (str(bad_later),), "text")
    batches = make_batches(source="jsonl", paths=(str(bad_later),), seq_len=8, batch_size=1,
                           shuffle=False)
    with pytest.raises(DataError, match="'text' missing in line 3 of bad_later.jsonl"):
        for _ in range(10):
            next(batches)


def test_too_many_processes_and_bad_sizes(text_corpus):
    with pytest.raises(DataError, match="too few"):
        make_batches(source="text", paths=(str(text_corpus / "doc0.txt"),), seq_len=8, batch_size=1,
                     process_index=1, process_count=2)
    with pytest.raises(DataError, match="seq_len"):
        make_batches(source="synthetic", seq_len=0, batch_size=1)
    with pytest.raises(DataError, match="vocab_size"):
        make_batches(source="text", paths=(str(text_corpus),), seq_len=8, batch_size=1, vocab_size=100)
