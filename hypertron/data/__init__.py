"""Training data: sources, pre-tokenised corpora and packed Grain pipelines.

Tokenisers are not here: they sit on the ground floor (:mod:`hypertron.tokenizer`), since
serving uses them too.
"""

from hypertron.data.pipeline import make_batches, resolve_shards
from hypertron.data.pretokenize import tokenize_corpus
from hypertron.data.sources import SOURCES, check_source, load_documents, stdlib_paths
from hypertron.data.token_corpus import read_metadata
from hypertron.errors import DataError

__all__ = [
    "SOURCES",
    "DataError",
    "check_source",
    "load_documents",
    "make_batches",
    "read_metadata",
    "resolve_shards",
    "stdlib_paths",
    "tokenize_corpus",
]
