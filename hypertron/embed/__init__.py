"""Sharded embedding tables: specs, multi-hot input, pooled lookups, sparse updates, checkpoints.

See :mod:`hypertron.embed.spec` (tables, features, the input and its checks),
:mod:`hypertron.embed.tables` (tables laid out over a mesh axis, their lookups and sparse updates)
and :mod:`hypertron.embed.checkpoint` (Orbax, restored under any placement).
"""

from hypertron.embed.checkpoint import restore_tables, save_tables
from hypertron.embed.tables import (
    OPTIMIZERS, ShardedTable, apply_gradients, lookup, reference_lookup, reference_update, shard_table,
)
from hypertron.embed.spec import COMBINERS, PLACEMENTS, EmbedError, FeatureSpec, Jagged, TableSpec, check_ids, check_specs

__all__ = ["COMBINERS", "OPTIMIZERS", "PLACEMENTS", "EmbedError", "FeatureSpec", "Jagged", "ShardedTable", "TableSpec",
           "apply_gradients", "check_ids", "check_specs", "lookup", "reference_lookup", "reference_update",
           "restore_tables", "save_tables", "shard_table"]
