"""KV caches as small pytrees that know how to take new keys and values and attend.

The decoder's layer calls ``cache.attend(layer, q, k, v, positions, segment_ids, cfg)``
(:class:`KVCache`) and never asks which cache it holds; :func:`hypertron.models.forward` with
``cache=`` runs the layers with the cache in the scan's carry, so each layer's writes update it
in place.

* :class:`PagedCache`: one serving step over the engine's page pool
  (:mod:`hypertron.models.kv_pages`): the tokens of many sequences in one flat row (decode
  tokens, whole prompts, chunks after cached tokens), every row attending in one call of the
  ragged paged attention (:mod:`hypertron.kernels.ragged_attention`). Keys and values go
  straight into the pages. Under a mesh whose rules split the heads (a tensor-parallel serving
  engine), the attention runs in ``shard_map``, each rank over its query heads and the KV heads
  they read (its own slice of the pages, or its heads' of pages every rank holds whole): the
  Pallas kernel is no op XLA's partitioner could split.

The contiguous cache (``k`` / ``v [layers, batch, max_len, kv_heads, head_dim]``, each row's
tokens at their positions) is the tests' reference (``tests/contiguous_cache.py``): nothing here
generates that way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Protocol

import jax
from jax.sharding import PartitionSpec as P

from hypertron.config import ModelConfig
from hypertron.kernels.ragged_paged_attention import ragged_paged_attention
from hypertron.models.kv_pages import layer_page_table, pages_per_layer, write_tokens
from hypertron.parallel.rules import active_rules, mesh_axes, spec_for


class KVCache(Protocol):
    """What a layer asks of a cache: take layer ``layer``'s new keys and values
    ``k_btkh`` / ``v_btkh`` at ``positions_bt`` and attend ``q_btnh`` to what it holds; returns
    the attention output ``[b, t, n, h]`` and the cache with the tokens written."""

    def attend(self, layer: Any, q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
               positions_bt: jax.Array, segment_ids_bt: jax.Array | None,
               cfg: ModelConfig) -> tuple[jax.Array, KVCache]: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """One serving step over the page pool: the tokens of many sequences in one flat row.

    The step's tokens come as ``[1, N]``, each sequence's contiguous and in row order (a decode
    row's one token, a prompt's or a chunk's tokens), padding after them. ``pages``: the pool
    (:func:`hypertron.models.kv_pages.init_pages`); ``page_table [rows, width]`` layer 0's pages
    of each sequence of the step; ``lengths [rows]`` the tokens each sequence holds once this
    step's are written (0: a padding row); ``query_start [rows + 1]`` where each row's tokens
    start in the row (the last entry: where padding starts); ``token_rows [N]`` the row of each
    token; ``token_valid [N]`` False for padding (written to the null page, never read). A token
    at position ``p`` attends to its own sequence's positions ``<= p`` (and inside the sliding
    window), every row of the step in one call of
    :func:`~hypertron.kernels.ragged_paged_attention.ragged_paged_attention` (``decode_only``:
    every row has one token at most, and that call compiles only its decode part).
    """

    pages: dict
    page_table: jax.Array
    lengths: jax.Array
    query_start: jax.Array
    token_rows: jax.Array
    token_valid: jax.Array
    decode_only: bool = dataclasses.field(default=False, metadata={"static": True})  # one token a row
    # About how many queries a row of several has (the step's prefill tokens over its prefill rows)
    queries_per_row: int | None = dataclasses.field(default=None, metadata={"static": True})
    # Each row's last queries that attend in the rows' one batch (a verify row's: speculative decoding)
    decode_queries: int = dataclasses.field(default=1, metadata={"static": True})

    def attend(self, layer, q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, cfg: ModelConfig):
        table = layer_page_table(self.page_table, layer, pages_per_layer(self.pages, cfg.num_layers))
        pages = write_tokens(self.pages, k_btkh[0][:, None], v_btkh[0][:, None], positions_bt[0][:, None],
                             table[self.token_rows], self.token_valid[:, None])
        attend = functools.partial(ragged_paged_attention, window=cfg.sliding_window, decode_only=self.decode_only,
                                   queries_per_row=self.queries_per_row, decode_queries=self.decode_queries)
        attn = _by_head(attend, q_btnh[0], pages, self.lengths, table, self.query_start, cfg)
        return attn[None], dataclasses.replace(self, pages=pages)


def _by_head(attend, q_nhd, pages: dict, lengths, table, query_start, cfg: ModelConfig):
    """``attend`` (the ragged paged attention) over the heads: in ``shard_map`` when the active
    rules split the query heads (see the module docstring), else as one call."""
    kv = {n: pages[n] for n in ("k_pages", "v_pages", "k_scales", "v_scales") if n in pages}
    active = active_rules()
    heads = () if active is None else mesh_axes(spec_for((None, "act_heads", None), active[1], active[0], q_nhd.shape)[1])
    if not heads:
        return attend(q_nhd, kv["k_pages"], kv["v_pages"], lengths, table, query_start,
                      k_scales=kv.get("k_scales"), v_scales=kv.get("v_scales"))
    mesh, rules = active
    kv_specs = {n: spec_for(("act_kv_heads",) + (None,) * (x.ndim - 1), rules, mesh, x.shape) for n, x in kv.items()}
    whole = not mesh_axes(kv_specs["k_pages"][0])  # fewer KV heads than ranks: every rank holds them all
    ranks = math.prod(mesh.shape[a] for a in heads)
    per, group = cfg.num_heads // ranks, cfg.num_heads // cfg.num_kv_heads
    assert not (whole and per % group and group % per), "refused by serve_plan.check_split"

    def local(q, kv, lengths, table, query_start):
        if whole:  # the KV heads this rank's query heads read
            first, n = jax.lax.axis_index(heads) * per // group, max(per // group, 1)
            kv = {k: jax.lax.dynamic_slice_in_dim(x, first, n, axis=0) for k, x in kv.items()}
        return attend(q, kv["k_pages"], kv["v_pages"], lengths, table, query_start,
                      k_scales=kv.get("k_scales"), v_scales=kv.get("v_scales"))

    q_spec = P(None, heads[0] if len(heads) == 1 else heads, None)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_specs, P(), P(), P()), out_specs=q_spec,
                       check_vma=False)  # Pallas calls carry no varying-axes types
    return fn(q_nhd, kv, lengths, table, query_start)
