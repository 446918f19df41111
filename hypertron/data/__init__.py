"""Training data: sources, tokenisers and packed Grain pipelines."""

from hypertron.data.pipeline import make_batches
from hypertron.data.sources import DataError, check_source, load_documents, stdlib_paths
from hypertron.data.tokenizer import ByteTokenizer, get_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataError",
    "check_source",
    "get_tokenizer",
    "load_documents",
    "make_batches",
    "stdlib_paths",
]
