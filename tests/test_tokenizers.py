"""Tests of the subword tokenisers behind ``data.tokenizer``: HF tokenizer.json and SentencePiece.

Both tokenisers are trained inside the tests on a few sentences (milliseconds),
so nothing is downloaded. The wrappers must give exactly the ids of the
libraries called directly, without the libraries' own special tokens.
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

from hypertron.data import DataError, make_batches
from hypertron.tokenizer import HFTokenizer, SentencePieceTokenizer, get_tokenizer, tokenizer_identity
from support.runs import write_documents  # tests/support

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "naïve café — ünïcødé ✓ 日本語",
    "def f(x):\n    return x + 1\n",
    "hello world, hello tokenizers",
] * 20
TEXTS = [
    "hello world",
    "naïve café — ünïcødé ✓ 日本語 🚀",  # the emoji is not in the training corpus
    "def f(x):\n    return x + 1\n",
    "",
    "  two  spaces  ",
]
DOCUMENTS = ["def f(x):\n    return x + 1\n", "naïve café ✓ 日本語", "a", "hello " * 30, "short one"]


def train_bpe(path, *, special_tokens=("<pad>", "<s>", "</s>")) -> str:
    """A byte-level BPE tokenizer.json (GPT-2 style) trained on CORPUS; returns its path.

    Its post-processor adds ``<s> ... </s>``, as real ones do, so the tests can
    tell that hypertron asks for ids without them.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    if "<s>" in special_tokens:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>",
            special_tokens=[(t, tokenizer.token_to_id(t)) for t in ("<s>", "</s>")],
        )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tokenizer.save(str(path))
    return str(path)


def train_sentencepiece(prefix, **options) -> str:
    """A SentencePiece BPE .model trained on CORPUS (byte fallback, no normalisation); returns its path."""
    import sentencepiece

    settings = dict(vocab_size=360, model_type="bpe", byte_fallback=True, character_coverage=1.0,
                    pad_id=0, bos_id=1, eos_id=2, unk_id=3, hard_vocab_limit=False,
                    normalization_rule_name="identity", add_dummy_prefix=False,
                    remove_extra_whitespaces=False, minloglevel=2)
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_prefix=str(prefix),
                                             **{**settings, **options})
    return f"{prefix}.model"


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json")


@pytest.fixture(scope="module")
def metaspace_path(tmp_path_factory):
    """A tokenizer.json as Llama 2's and Mistral's are: BPE over Metaspace pieces (``▁word``) with
    byte fallback (no ``▁`` put before the text: the joined pieces are the text exactly)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    # Llama 2's decoder: its Strip takes the first space off a decoded text, so "▁world" alone decodes to "world".
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                                              show_progress=False))
    spec = json.loads(tokenizer.to_str())  # the byte pieces in the model's vocabulary, as Llama 2's are
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    path = tmp_path_factory.mktemp("metaspace") / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return str(path)


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory):
    return train_sentencepiece(tmp_path_factory.mktemp("sp") / "sp")


def _stream(batches, num_batches):
    """Inputs of the first ``num_batches`` batches, rows concatenated: shape [num_batches * batch * seq]."""
    return np.concatenate([b["inputs"].reshape(-1) for b in itertools.islice(batches, num_batches)])


def _expected_stream(tokenizer, documents, length):
    """``([bos] + ids + [eos])[:-1]`` of each document, repeated: the inputs unshuffled packing reads."""
    framed = []
    for text in documents:
        ids = [i for i in [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id] if i is not None]
        framed.extend(ids[:-1])
    return np.array(framed * (length // len(framed) + 1), np.int32)[:length]


# --- Hugging Face tokenizer.json -----------------------------------------------


def test_hf_ids_match_the_library(bpe_path):
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(bpe_path)
    tokenizer = get_tokenizer(bpe_path)
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)  # found by name
    assert tokenizer.vocab_size == reference.get_vocab_size()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids
        if text:
            assert reference.encode(text).ids == [1, *ids, 2], "the library adds <s> </s>; hypertron does not"
        assert tokenizer.encode_array(text).dtype == np.int32
        assert tokenizer.encode_array(text).tolist() == ids
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(np.array([1, *ids, 2, 0, 10_000])) == text, "special and unknown ids dropped"


def test_hf_agrees_with_transformers(bpe_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    tokenizer = get_tokenizer(bpe_path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=bpe_path)
    for text in TEXTS:
        assert tokenizer.encode(text) == fast.encode(text, add_special_tokens=False)


def test_hf_special_tokens_from_tokenizer_config(tmp_path):
    """A directory's tokenizer_config.json names the special tokens; null there means none."""
    train_bpe(tmp_path / "model" / "tokenizer.json")
    config = {"bos_token": None, "eos_token": {"content": "</s>", "special": True}, "tokenizer_class": "X"}
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = get_tokenizer(str(tmp_path / "model"))  # the directory, as a model directory is given
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (None, 2, 0)

    batches = make_batches(source="text", paths=(write_documents(tmp_path / "docs", DOCUMENTS),),
                           tokenizer=str(tmp_path / "model"), seq_len=16, batch_size=2, shuffle=False,
                           vocab_size=tokenizer.vocab_size)
    stream = _stream(batches, 4)
    assert np.array_equal(stream, _expected_stream(tokenizer, DOCUMENTS, len(stream)))  # doc0.txt, ...
    assert 1 not in stream.tolist(), "no bos is added when the tokenizer has none"

    config["eos_token"] = "<|not-there|>"
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match=r"data.tokenizer: eos_token '<\|not-there\|>' .* not in its vocabulary"):
        get_tokenizer(str(tmp_path / "model"))  # the file changed, so the cache does not answer


def test_hf_cache_layout(tmp_path):
    """In a Hugging Face cache tokenizer.json links to a blob; the config beside the link still counts."""
    blob = train_bpe(tmp_path / "blobs" / "0123abcd")
    (tmp_path / "snapshot").mkdir()
    os.symlink(blob, tmp_path / "snapshot" / "tokenizer.json")
    (tmp_path / "snapshot" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "</s>"}))
    assert get_tokenizer(str(tmp_path / "snapshot")).bos_id == 2


def test_tokenizer_without_bos_or_eos(tmp_path):
    path = train_bpe(tmp_path / "plain" / "tokenizer.json", special_tokens=("<unk>",))
    with pytest.raises(DataError, match="data.tokenizer: .* has neither a bos nor an eos token"):
        get_tokenizer(path)


# --- SentencePiece -------------------------------------------------------------------


def test_sentencepiece_ids_match_the_library(sp_path):
    import sentencepiece

    reference = sentencepiece.SentencePieceProcessor(model_file=sp_path)
    tokenizer = get_tokenizer(sp_path)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    assert tokenizer.vocab_size == reference.get_piece_size()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text, out_type=int)
        assert tokenizer.encode_array(text).tolist() == ids
        assert tokenizer.decode(ids) == text == reference.decode(ids)
        assert tokenizer.decode([1, *ids, 2, 0, 10_000]) == text


def test_sentencepiece_without_bos(tmp_path):
    path = train_sentencepiece(tmp_path / "nobos", bos_id=-1, pad_id=-1)
    tokenizer = get_tokenizer(path)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (None, 2, 2), "pad falls back to eos"
    (tmp_path / "llama").mkdir()
    os.link(path, tmp_path / "llama" / "tokenizer.model")
    assert isinstance(get_tokenizer(str(tmp_path / "llama")), SentencePieceTokenizer)


# --- both -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["byte", "bpe", "sp"])
def test_streamed_text_after_any_prompt_is_the_decoded_continuation(kind, bpe_path, sp_path):
    """The serving detokenizer (``tokenizers``' DecodeStream for a tokenizer.json, the windowed one
    for the others), given a prompt's ids as context, streams exactly the text the continuation
    adds, at every split of every text between characters, characters split over ids included,
    and never a piece of a character; a special id adds nothing."""
    from hypertron.serve.detokenize import IncrementalDetokenizer, StreamDetokenizer, detokenizer

    tokenizer = get_tokenizer({"byte": "byte", "bpe": bpe_path, "sp": sp_path}[kind])
    assert isinstance(detokenizer(tokenizer), StreamDetokenizer if kind == "bpe" else IncrementalDetokenizer)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        for cut in range(len(ids)):
            if tokenizer.decode(ids[:cut]).endswith("\ufffd"):
                continue  # a prompt ending half-way through a character
            stream = detokenizer(tokenizer, ids[:cut])
            pieces = [stream.add(i) for i in ids[cut:]]
            streamed = "".join(pieces) + stream.flush()
            assert tokenizer.decode(ids[:cut]) + streamed == tokenizer.decode(ids), (text, cut)
            assert all("\ufffd" not in p for p in pieces)
    stream = detokenizer(tokenizer)
    assert stream.add(tokenizer.eos_id) == "" and stream.flush() == ""


@pytest.mark.parametrize("kind", ["byte", "bpe", "sp", "metaspace"])
def test_token_bytes_are_exactly_the_bytes_each_id_adds(kind, bpe_path, sp_path, metaspace_path):
    """Joined, the bytes of a text's ids are the text's UTF-8, even where one id holds only part of
    a character (byte tokens, byte-level BPE pieces, SentencePiece byte fallback) or where a
    Metaspace piece's space goes when it is decoded alone; special ids add none. (Structured
    output's grammars see the tokenizer through these bytes: hypertron.serve.structured.)"""
    tokenizer = get_tokenizer({"byte": "byte", "bpe": bpe_path, "sp": sp_path, "metaspace": metaspace_path}[kind])
    partial = 0
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8"), text
        for i in ids:
            try:
                tokenizer.token_bytes(i).decode("utf-8")
            except UnicodeDecodeError:
                partial += 1
    assert partial > 0  # the texts hold characters split over several ids
    specials = [i for i in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) if i is not None]
    assert all(tokenizer.token_bytes(i) == b"" for i in specials)
    if kind != "byte":  # a special token's own text, for chat templates
        assert tokenizer.token_text(tokenizer.bos_id) == "<s>" and tokenizer.token_text(tokenizer.eos_id) == "</s>"


@pytest.mark.parametrize("kind", ["byte", "bpe", "sp"])
def test_encode_offsets_give_each_id_its_characters(kind, bpe_path, sp_path):
    """``encode_offsets`` (how chat masks find the assistant's tokens): ``encode``'s ids, each with the
    characters its bytes lie in, in order; an id holding part of a character spans that character."""
    tokenizer = get_tokenizer({"byte": "byte", "bpe": bpe_path, "sp": sp_path}[kind])
    for text in TEXTS:
        ids, offsets = tokenizer.encode_offsets(text)
        assert ids == tokenizer.encode(text) and len(offsets) == len(ids), text
        assert [a for a, _ in offsets] == sorted(a for a, _ in offsets)
        for i, (a, b) in zip(ids, offsets, strict=True):
            assert 0 <= a < b <= len(text) and tokenizer.token_bytes(i).strip() in text[a:b].encode("utf-8"), text
        assert not offsets or offsets[-1][1] == len(text)


def test_end_of_turn_ids_and_chat_template_come_from_the_files_beside_the_tokenizer(tmp_path, bpe_path):
    import shutil

    shutil.copyfile(bpe_path, tmp_path / "tokenizer.json")
    plain = get_tokenizer(str(tmp_path))
    assert plain.eos_ids == {plain.eos_id} and plain.chat_template is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 100_000]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    tokenizer = get_tokenizer(str(tmp_path))
    assert tokenizer.eos_ids == {2, 7}  # ids outside the vocabulary left out
    assert tokenizer.chat_template == "{{ messages }}" and get_tokenizer("byte").chat_template is None




@pytest.mark.parametrize("kind", ["bpe", "sp"])
def test_make_batches_with_subword_tokenizer(tmp_path, kind, bpe_path, sp_path):
    """Unshuffled rows spell out [bos] + ids + [eos] of each document, in order."""
    name = bpe_path if kind == "bpe" else sp_path
    tokenizer = get_tokenizer(name)
    lines = [json.dumps({"text": text}) for text in DOCUMENTS]
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    batches = make_batches(source="jsonl", paths=(str(tmp_path / "corpus.jsonl"),), tokenizer=name,
                           seq_len=32, batch_size=2, shuffle=False, vocab_size=tokenizer.vocab_size)
    stream = _stream(batches, 4)
    assert np.array_equal(stream, _expected_stream(tokenizer, DOCUMENTS, len(stream)))
    with pytest.raises(DataError, match=f"model.vocab_size=300: .* needs at least {tokenizer.vocab_size}"):
        make_batches(source="jsonl", paths=(str(tmp_path / "corpus.jsonl"),), tokenizer=name,
                     seq_len=32, batch_size=2, vocab_size=300)


def test_get_tokenizer_caches_by_path(bpe_path, sp_path):
    assert get_tokenizer(bpe_path) is get_tokenizer(bpe_path)
    assert get_tokenizer(sp_path) is get_tokenizer(sp_path)
    assert get_tokenizer("byte") is get_tokenizer("byte")
    identity = tokenizer_identity(bpe_path)
    assert identity["kind"] == "hf" and identity["path"] == os.path.abspath(bpe_path)
    assert len(identity["sha256"]) == 64
    assert tokenizer_identity("byte") == {"name": "byte", "kind": "byte", "path": None, "sha256": None}


def test_bad_tokenizer_paths(tmp_path):
    missing = str(tmp_path / "nope" / "tokenizer.json")
    with pytest.raises(DataError, match=f"data.tokenizer: {missing} does not exist"):
        get_tokenizer(missing)
    (tmp_path / "broken.json").write_text('{"model": ')
    with pytest.raises(DataError, match=f"data.tokenizer: cannot read {tmp_path / 'broken.json'}"):
        get_tokenizer(str(tmp_path / "broken.json"))
    (tmp_path / "broken.model").write_bytes(b"not a protobuf")
    with pytest.raises(DataError, match=f"data.tokenizer: cannot read {tmp_path / 'broken.model'}"):
        get_tokenizer(str(tmp_path / "broken.model"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="data.tokenizer: .*empty_dir is a directory without tokenizer.json"):
        get_tokenizer(str(tmp_path / "empty_dir"))
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(DataError, match="data.tokenizer: .*vocab.txt is not a .json or .model file"):
        get_tokenizer(str(tmp_path / "vocab.txt"))

