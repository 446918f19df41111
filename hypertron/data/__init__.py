"""Training data: sources, tokenisers, pre-tokenised corpora and packed Grain pipelines."""

from hypertron.data.pipeline import make_batches
from hypertron.data.pretokenize import read_metadata, tokenize_corpus
from hypertron.data.sources import SOURCES, DataError, check_source, load_documents, stdlib_paths
from hypertron.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    get_tokenizer,
    tokenizer_identity,
)

__all__ = [
    "SOURCES",
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "check_source",
    "get_tokenizer",
    "load_documents",
    "make_batches",
    "read_metadata",
    "stdlib_paths",
    "tokenize_corpus",
    "tokenizer_identity",
]
