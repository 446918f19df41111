"""KV caches as small pytrees that know how to take new keys and values and attend.

The decoder's layer calls ``cache.attend(layer, q, k, v, positions, segment_ids, cfg)`` and
never asks which cache it holds; :func:`hypertron.models.forward` with ``cache=`` runs the
layers with the cache in the scan's carry, so each layer's writes update it in place.

* :class:`ContiguousCache`: ``k`` / ``v [layers, batch, max_len, kv_heads, head_dim]``, each
  row's tokens at their positions. For a batch of sequences generated together.
* :class:`PagedCache`: the serving engine's page pool (:mod:`hypertron.models.kv_pages`), a page
  table per sequence and its length. Queries of any length: one token per sequence goes through
  the ragged decode-attention kernel; several (a prompt, a chunk of one) attend over the
  gathered pages; a *cold* prompt (nothing cached before it) attends through
  :func:`~hypertron.models.attention.self_attention`, the function training uses (cuDNN flash
  attention on GPU), while its keys and values go straight into its pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hypertron.config import ModelConfig
from hypertron.kernels.ragged_attention import gather_pages, ragged_decode_attention
from hypertron.models.attention import attention_mask, plain_attention, self_attention
from hypertron.models.kv_pages import layer_page_table, pages_per_layer, write_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousCache:
    """``k`` / ``v [layers, batch, max_len, kv_heads, head_dim]``; a row's new tokens are written
    from its first position on, and it attends to every cached position up to its own."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype) -> ContiguousCache:
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def attend(self, layer, q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, cfg: ModelConfig):
        def write(cache, new):
            rows = jax.vmap(lambda c, n, p: jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (p[0], 0, 0)))(
                jax.lax.dynamic_index_in_dim(cache, layer, keepdims=False), new, positions_bt)
            return rows, jax.lax.dynamic_update_index_in_dim(cache, rows, layer, 0)

        k_bskh, k = write(self.k, k_btkh)
        v_bskh, v = write(self.v, v_btkh)
        s = k_bskh.shape[1]
        kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (q_btnh.shape[0], s))
        mask = attention_mask(positions_bt, kv_pos, cfg)
        attn = plain_attention(q_btnh, k_bskh.astype(q_btnh.dtype), v_bskh.astype(q_btnh.dtype), mask)
        return attn, ContiguousCache(k, v)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """The page pool (``pages``: :func:`hypertron.models.kv_pages.init_pages`), layer 0's page
    table ``[b, pages_per_seq]`` and ``lengths [b]``: the tokens each sequence holds once this
    call's are written (0: an empty slot; its writes go to the null page). A query at position
    ``p`` attends to positions ``<= p``. ``cold``: no sequence has anything cached before this
    call's tokens, which start at position 0 (a prompt's prefill)."""

    pages: dict
    page_table: jax.Array
    lengths: jax.Array
    cold: bool = dataclasses.field(default=False, metadata={"static": True})

    def attend(self, layer, q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, cfg: ModelConfig):
        table = layer_page_table(self.page_table, layer, pages_per_layer(self.pages, cfg.num_layers))
        valid_bt = positions_bt < self.lengths[:, None]
        pages = write_tokens(self.pages, k_btkh, v_btkh, positions_bt, table, valid_bt)
        if self.cold:
            attn = self_attention(q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, cfg)
        elif q_btnh.shape[1] == 1:
            attn = ragged_decode_attention(
                q_btnh[:, 0], pages["k_pages"], pages["v_pages"], self.lengths, table,
                k_scales=pages.get("k_scales"), v_scales=pages.get("v_scales"), window=cfg.sliding_window,
            )[:, None]
        else:
            attn = paged_attention(q_btnh, pages, table, self.lengths, positions_bt, cfg)
        return attn, dataclasses.replace(self, pages=pages)


def paged_attention(q_btnh, pages: dict, table_bp, lengths_b, positions_bt, cfg: ModelConfig) -> jax.Array:
    """Queries of any length over each sequence's pages (gathered whole: the reference path,
    for chunks of a prompt after a cached prefix). Positions past ``lengths`` are never read."""
    k_bksh = gather_pages(pages["k_pages"], pages.get("k_scales"), table_bp)
    v_bksh = gather_pages(pages["v_pages"], pages.get("v_scales"), table_bp)
    b, s = k_bksh.shape[0], k_bksh.shape[2]
    kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    kv_valid = kv_pos < lengths_b[:, None]
    # Rows never written may hold anything (NaN): zero them, so 0 * NaN cannot reach the output.
    clean = lambda x: jnp.where(kv_valid[:, :, None, None], x.transpose(0, 2, 1, 3), 0).astype(q_btnh.dtype)  # noqa: E731
    mask = attention_mask(positions_bt, kv_pos, cfg, kv_valid_bs=kv_valid)
    return plain_attention(q_btnh, clean(k_bksh), clean(v_bksh), mask)
