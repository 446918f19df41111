"""Sharded embedding tables: specs, multi-hot input, routing, pooled lookups, sparse updates,
checkpoints and a placement planner.

See :mod:`hypertron.embed.spec` (tables, features, the input and its checks),
:mod:`hypertron.embed.route` (a batch's ids laid out for the devices that own their rows, on the
host), :mod:`hypertron.embed.tables` (tables laid out over a mesh axis, their lookups and sparse
updates), :mod:`hypertron.embed.checkpoint` (Orbax, restored under any placement) and
:mod:`hypertron.embed.plan` (``hypertron embed plan``).
"""

from hypertron.embed.checkpoint import restore_tables, save_tables
from hypertron.embed.route import OVERFLOW, Routed, route
from hypertron.embed.spec import (
    COMBINERS, OPTIMIZERS, PLACEMENTS, EmbedError, FeatureSpec, Jagged, TableSpec, check_ids, check_specs,
)
from hypertron.embed.tables import (
    ShardedTable, abstract_table, apply_gradients, init_table, lookup, pooled_sharding,
    pooling_fn, reference_lookup, reference_update, shard_table, update_fn,
)

__all__ = ["COMBINERS", "OPTIMIZERS", "OVERFLOW", "PLACEMENTS", "EmbedError", "FeatureSpec", "Jagged", "Routed",
           "ShardedTable", "TableSpec", "abstract_table", "apply_gradients", "check_ids", "check_specs",
           "init_table", "lookup", "pooled_sharding", "pooling_fn", "reference_lookup",
           "reference_update", "restore_tables", "route", "save_tables", "shard_table", "update_fn"]
