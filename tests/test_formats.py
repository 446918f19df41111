"""Tests of the data formats: parquet, jsonl, Hugging Face datasets, ArrayRecord, and
``hypertron tokenize`` output read back as the ``tokens`` source.

Corpora and tokenisers are made in ``tmp_path``; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys

import numpy as np
import pytest
from test_tokenizers import train_bpe  # tests/ is on sys.path (no __init__.py)

from hypertron.cli import main
from hypertron.data import DataError, check_source, load_documents, make_batches, read_metadata, tokenize_corpus
from hypertron.tokenizer import get_tokenizer
from support.runs import write_documents  # tests/support

DOCUMENTS = [
    "def f(x):\n    return x + 1\n",
    "naïve café — ünïcødé ✓ 日本語 🚀",
    "a",
    "x = [i * i for i in range(10)]  # longer than a row\n" * 3,
    "",
    "short one",
    "another document, of middling length",
]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json")


def write_parquet(directory, documents, *, field="content", row_group_size=2, files=2):
    """``documents`` in column ``field`` (plus an int column) of ``files`` parquet files, small row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(documents) // files)
    for i in range(files):
        part = documents[i * per_file:(i + 1) * per_file]
        table = pa.table({"id": pa.array(range(len(part)), pa.int64()), field: pa.array(part, pa.string())})
        pq.write_table(table, directory / f"part-{i}.parquet", row_group_size=row_group_size)
    return str(directory)


def write_jsonl(path, documents, field="text"):
    path.write_text("".join(json.dumps({field: text, "n": i}) + "\n" for i, text in enumerate(documents)))
    return str(path)


def _batches(count, **kwargs):
    """The first ``count`` batches of ``make_batches(**kwargs)`` (small rows, shuffled with seed 1)."""
    settings = dict(seq_len=16, batch_size=2, seed=1, vocab_size=512)
    return list(itertools.islice(make_batches(**{**settings, **kwargs}), count))


def _assert_same_batches(first, second):
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert a.keys() == b.keys()
        for name in a:
            assert np.array_equal(a[name], b[name]), name


# --- text formats ---------------------------------------------------------------


def test_parquet_source(tmp_path):
    """Documents come in file order, row by row over row groups of two, whatever the access order."""
    corpus = write_parquet(tmp_path / "nested" / "pq", DOCUMENTS)
    (tmp_path / "nested" / "notes.txt").write_text("not parquet, ignored")
    check_source("parquet", (str(tmp_path),), "content")
    documents = load_documents("parquet", (str(tmp_path),), "content")
    assert list(documents) == DOCUMENTS
    assert [documents[i] for i in (6, 0, 3, 2)] == [DOCUMENTS[i] for i in (6, 0, 3, 2)]
    batch = next(make_batches(source="parquet", paths=(corpus,), text_field="content", seq_len=16,
                              batch_size=2))
    assert batch["inputs"].shape == (2, 16)


def test_jsonl_text_field(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS, field="content")
    assert list(load_documents("jsonl", (path,), "content")) == DOCUMENTS
    with pytest.raises(DataError, match="data.text_field: 'text' missing in line 1 of docs.jsonl"):
        check_source("jsonl", (path,), "text")


def test_parquet_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = write_parquet(tmp_path / "good", DOCUMENTS, files=1)
    with pytest.raises(DataError, match=r"data.text_field: 'text' is not a column of .*part-0.parquet "
                                        r"\(columns: id, content\)"):
        check_source("parquet", (corpus,), "text")
    with pytest.raises(DataError, match="data.text_field: 'id' of .* holds int64, not strings"):
        make_batches(source="parquet", paths=(corpus,), text_field="id", seq_len=8, batch_size=1)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.parquet").write_text("not parquet at all")
    with pytest.raises(DataError, match="data.paths: cannot read .*x.parquet as parquet"):
        check_source("parquet", (str(tmp_path / "bad"),), "text")
    (tmp_path / "empty").mkdir()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty" / "e.parquet")
    with pytest.raises(DataError, match="the corpus is empty"):
        check_source("parquet", (str(tmp_path / "empty"),), "text")
    (tmp_path / "nulls").mkdir()
    pq.write_table(pa.table({"text": ["ok", None]}), tmp_path / "nulls" / "n.parquet")
    documents = load_documents("parquet", (str(tmp_path / "nulls"),), "text")
    assert documents[0] == "ok"
    with pytest.raises(DataError, match="data.text_field: 'text' is null in row 1 of n.parquet"):
        documents[1]


def test_hf_datasets_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"content": DOCUMENTS[:4], "n": list(range(4))}).save_to_disk(tmp_path / "a")
    datasets.Dataset.from_dict({"content": DOCUMENTS[4:], "n": [0] * 3}).save_to_disk(tmp_path / "b")
    paths = (str(tmp_path / "a"), str(tmp_path / "b"))
    check_source("hf", paths, "content")
    assert list(load_documents("hf", paths, "content")) == DOCUMENTS
    assert next(make_batches(source="hf", paths=paths, text_field="content", seq_len=8,
                             batch_size=2))["inputs"].shape == (2, 8)
    with pytest.raises(DataError, match=r"data.text_field: 'text' is not a column of .*a \(columns: content, n"):
        check_source("hf", paths, "text")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})})
    splits.save_to_disk(tmp_path / "dict")
    with pytest.raises(DataError, match="data.paths: .*dict holds the splits train; give one split's"):
        check_source("hf", (str(tmp_path / "dict"),), "text")
    with pytest.raises(DataError, match="data.paths: .* is not a saved Hugging Face dataset"):
        check_source("hf", (str(tmp_path),), "text")


def test_hf_source_without_datasets(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(DataError, match="data.source: 'hf' needs the datasets package, which is not installed"):
        check_source("hf", (str(tmp_path),), "text")


def test_arrayrecord_text_source(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    (tmp_path / "ar").mkdir()
    for i, part in enumerate((DOCUMENTS[:3], DOCUMENTS[3:])):
        writer = ArrayRecordWriter(str(tmp_path / "ar" / f"part-{i}.array_record"), "group_size:1")
        for text in part:
            writer.write(text.encode("utf-8"))
        writer.close()
    check_source("arrayrecord", (str(tmp_path / "ar"),), "text")
    assert list(load_documents("arrayrecord", (str(tmp_path / "ar"),), "text")) == DOCUMENTS
    (tmp_path / "junk.array_record").write_bytes(b"junk")
    with pytest.raises(DataError, match="data.paths: cannot read .*junk.array_record as ArrayRecord"):
        check_source("arrayrecord", (str(tmp_path / "junk.array_record"),), "text")


# --- hypertron tokenize and the tokens source -----------------------------------------


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_tokenize_then_tokens_source_gives_the_same_batches(tmp_path, bpe_path, tokenizer):
    tokenizer = bpe_path if tokenizer == "bpe" else tokenizer
    corpus = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    out = str(tmp_path / "tokens")
    metadata = tokenize_corpus(source="jsonl", paths=(corpus,), tokenizer=tokenizer, out=out)

    text_tokenizer = get_tokenizer(tokenizer)
    assert metadata == read_metadata(out)
    assert metadata["num_documents"] == len(DOCUMENTS)
    assert metadata["num_tokens"] == sum(len(text_tokenizer.encode(t)) for t in DOCUMENTS)
    assert metadata["tokenizer"]["name"] == tokenizer
    assert metadata["tokenizer"]["vocab_size"] == text_tokenizer.vocab_size
    documents = load_documents("tokens", (out,), "text", tokenizer=tokenizer)
    assert [d.tolist() for d in documents] == [text_tokenizer.encode(t) for t in DOCUMENTS]
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "tokens"], "no temporary directory is left"

    on_the_fly = _batches(6, source="jsonl", paths=(corpus,), tokenizer=tokenizer)
    pretokenized = _batches(6, source="tokens", paths=(out,), tokenizer=tokenizer)
    _assert_same_batches(on_the_fly, pretokenized)
    unshuffled = dict(shuffle=False, seq_len=64)
    _assert_same_batches(_batches(3, source="jsonl", paths=(corpus,), tokenizer=tokenizer, **unshuffled),
                         _batches(3, source="tokens", paths=(out,), tokenizer=tokenizer, **unshuffled))


def test_tokens_source_checks_the_tokenizer(tmp_path, bpe_path):
    corpus = write_parquet(tmp_path / "pq", DOCUMENTS, field="text")
    out = str(tmp_path / "tokens")
    metadata = tokenize_corpus(source="parquet", paths=(corpus,), tokenizer=bpe_path, out=out)
    with open(bpe_path, "rb") as f:
        assert metadata["tokenizer"]["sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert metadata["tokenizer"]["path"] == os.path.abspath(bpe_path)

    with pytest.raises(DataError, match=r"data.tokenizer: .*tokens was tokenised with .*tokenizer.json "
                                        r"\(hf, sha256 [0-9a-f]{12}\), not byte \(byte\)"):
        check_source("tokens", (out,), "text", tokenizer="byte")
    other = train_bpe(tmp_path / "other" / "tokenizer.json", special_tokens=("<pad>", "<s>", "</s>", "<x>"))
    with pytest.raises(DataError, match="data.tokenizer: .* was tokenised with"):
        load_documents("tokens", (out,), "text", tokenizer=other)
    # The same file elsewhere (a copied corpus and tokenizer) matches.
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "tokenizer.json").write_bytes(open(bpe_path, "rb").read())
    check_source("tokens", (out,), "text", tokenizer=str(tmp_path / "copy"))
    # The pipeline refuses the mismatch too, before making a batch.
    with pytest.raises(DataError, match="data.tokenizer: .* was tokenised with"):
        next(make_batches(source="tokens", paths=(out,), tokenizer="byte", seq_len=512, batch_size=2,
                          shuffle=False))


def test_tokens_source_errors(tmp_path, bpe_path):
    with pytest.raises(DataError, match="data.paths: .*nowhere does not exist"):
        check_source("tokens", (str(tmp_path / "nowhere"),), "text")
    with pytest.raises(DataError, match="data.paths: .* is not a hypertron tokenize output"):
        check_source("tokens", (str(tmp_path),), "text")
    out = str(tmp_path / "tokens")
    tokenize_corpus(source="text", paths=(write_documents(tmp_path / "docs", DOCUMENTS),), tokenizer="byte", out=out)
    with pytest.raises(DataError, match="data.source: .*tokens was written by hypertron tokenize; "
                                        "read it with data.source=tokens"):
        check_source("arrayrecord", (out,), "text")
    with pytest.raises(DataError, match="read it with data.source=tokens"):
        check_source("arrayrecord", (str(tmp_path),), "text")  # found inside a directory too
    os.remove(os.path.join(out, "tokens-00000.array_record"))
    with pytest.raises(DataError, match="data.paths: .*tokens is incomplete: tokens-00000.array_record is"):
        check_source("tokens", (out,), "text", tokenizer="byte")


def test_tokenize_cli(tmp_path, capsys, bpe_path):
    corpus = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS, field="body")
    out = str(tmp_path / "tokens")
    args = ["tokenize", "--source", "jsonl", "--paths", corpus, "--text-field", "body",
            "--tokenizer", bpe_path, "--out", out]
    assert main(args) == 0
    assert f"wrote {len(DOCUMENTS)} documents" in capsys.readouterr().out
    listing = sorted(os.listdir(out))
    assert listing == ["hypertron_tokens.json", "tokens-00000.array_record"]

    assert main(args) == 2, "an existing non-empty --out is refused"
    err = capsys.readouterr().err
    assert err == f"error: --out: {out} exists and is not empty; nothing was written\n"
    assert sorted(os.listdir(out)) == listing

    (tmp_path / "empty_out").mkdir()  # an empty directory may be filled
    assert main([*args[:-1], str(tmp_path / "empty_out")]) == 0
    capsys.readouterr()

    no_field = ["tokenize", "--source", "jsonl", "--paths", corpus, "--tokenizer", "byte",
                "--out", str(tmp_path / "t2")]
    assert main(no_field) == 2  # the default --text-field text is not in the lines
    assert capsys.readouterr().err == "error: data.text_field: 'text' missing in line 1 of docs.jsonl\n"
    assert main(["tokenize", "--source", "jsonl", "--paths", corpus, "--text-field", "body",
                 "--tokenizer", str(tmp_path / "missing.json"), "--out", str(tmp_path / "t3")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: data.tokenizer: {tmp_path / 'missing.json'} does not exist")
    assert err.count("\n") == 1
    assert not os.path.exists(tmp_path / "t3")


def test_failed_tokenize_leaves_nothing(tmp_path):
    """A bad line found mid-way aborts the run; neither --out nor a temporary directory remains."""
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"other": "no text"}) + "\n")
    with pytest.raises(DataError, match="'text' missing in line 2 of docs.jsonl"):
        tokenize_corpus(source="jsonl", paths=(str(corpus),), tokenizer="byte", out=str(tmp_path / "out"))
    assert os.listdir(tmp_path) == ["docs.jsonl"]
    with pytest.raises(DataError, match="data.source: 'tokens' cannot be tokenised"):
        tokenize_corpus(source="tokens", paths=(str(tmp_path),), tokenizer="byte", out=str(tmp_path / "out"))




@pytest.mark.slow
def test_train_on_pretokenised_subword_corpus(tmp_path):
    """``hypertron train`` end to end on a ``hypertron tokenize`` output with a BPE tokenizer.json."""
    from hypertron.config import load_config
    from hypertron.train.loop import train

    bpe = train_bpe(tmp_path / "tok" / "tokenizer.json")
    out = str(tmp_path / "tokens")
    tokenize_corpus(source="text", paths=(write_documents(tmp_path / "docs", DOCUMENTS),), tokenizer=bpe, out=out)
    result = train(load_config(None, [
        "model=tiny", "model.num_layers=1", "model.vocab_size=400", "train.steps=3", "train.global_batch=8",
        "train.seq_len=16", "data.source=tokens", f"data.paths={out}", f"data.tokenizer={bpe}",
        f"run_dir={tmp_path / 'run'}", "checkpoint.enabled=false"]))
    assert len(result.losses) == 3 and all(np.isfinite(result.losses))
    with pytest.raises(DataError, match="was tokenised with"):
        train(load_config(None, ["model=tiny", "data.source=tokens", f"data.paths={out}",
                                 f"run_dir={tmp_path / 'other'}"]))
    assert not (tmp_path / "other").exists()
