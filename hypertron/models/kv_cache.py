"""KV caches as small pytrees that know how to take new keys and values and attend.

The decoder's layer calls ``cache.attend(layer, q, k, v, positions, segment_ids, cfg)``
(:class:`KVCache`) and never asks which cache it holds; :func:`hypertron.models.forward` with
``cache=`` runs the layers with the cache in the scan's carry, so each layer's writes update it
in place.

* :class:`PagedCache`: one serving step over the engine's page pool
  (:mod:`hypertron.models.kv_pages`): the tokens of many sequences in one flat row, decode
  tokens (one per sequence, through the ragged decode-attention kernel) then prefill chunks
  (packed, through the training attention when every chunk starts a sequence; over the
  gathered pages when a chunk follows a cached prefix). Keys and values go straight into the
  pages.

The contiguous cache (``k`` / ``v [layers, batch, max_len, kv_heads, head_dim]``, each row's
tokens at their positions) is the tests' reference (``tests/contiguous_cache.py``): nothing here
generates that way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from hypertron.config import ModelConfig
from hypertron.kernels.ragged_attention import causal_window_mask, gather_pages, ragged_decode_attention
from hypertron.models.attention import self_attention
from hypertron.models.kv_pages import layer_page_table, pages_per_layer, write_tokens


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

    The step's tokens come as ``[1, N]``: first ``num_decode`` decode tokens (one per sequence),
    then the prefill tokens, each sequence's chunk contiguous (padding anywhere after them).
    ``pages``: the pool (:func:`hypertron.models.kv_pages.init_pages`); ``page_table [rows,
    width]`` layer 0's pages of each sequence of the step (decode rows first, then prefill rows);
    ``lengths [rows]`` the tokens each sequence holds once this step's are written (0: a padding
    row); ``token_rows [N]`` the row of each token; ``token_valid [N]`` False for padding (written
    to the null page, never read). A token at position ``p`` attends to its own sequence's
    positions ``<= p`` (and inside the sliding window).

    Decode tokens attend through the ragged decode-attention kernel. Prefill tokens: when
    ``cold`` (every prefill sequence starts at position 0 in this step), the chunks are a packed
    batch of documents and attend through
    :func:`~hypertron.models.attention.self_attention`, the function training uses (cuDNN flash
    attention on GPU), with one segment per sequence; otherwise (a chunk after a cached prefix)
    through :func:`chunk_attention` over the gathered pages.
    """

    pages: dict
    page_table: jax.Array
    lengths: jax.Array
    token_rows: jax.Array
    token_valid: jax.Array
    num_decode: int = dataclasses.field(default=0, metadata={"static": True})
    cold: bool = dataclasses.field(default=False, metadata={"static": True})

    def attend(self, layer, q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, cfg: ModelConfig):
        table = layer_page_table(self.page_table, layer, pages_per_layer(self.pages, cfg.num_layers))
        pos_n = positions_bt[0]
        pages = write_tokens(self.pages, k_btkh[0][:, None], v_btkh[0][:, None], pos_n[:, None],
                             table[self.token_rows], self.token_valid[:, None])
        nd = self.num_decode
        parts = []
        if nd:
            parts.append(ragged_decode_attention(
                q_btnh[0, :nd], pages["k_pages"], pages["v_pages"], self.lengths[:nd], table[:nd],
                k_scales=pages.get("k_scales"), v_scales=pages.get("v_scales"), window=cfg.sliding_window))
        if q_btnh.shape[1] > nd:
            q, pos = q_btnh[:, nd:], positions_bt[:, nd:]
            if self.cold:
                segments = jnp.where(self.token_valid[nd:], self.token_rows[nd:] + 1, 0)[None]
                parts.append(self_attention(q, k_btkh[:, nd:], v_btkh[:, nd:], pos, segments, cfg)[0])
            else:
                parts.append(chunk_attention(q[0], pages, table[nd:], self.lengths[nd:], self.token_rows[nd:] - nd,
                                             pos[0], cfg))
        attn = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
        return attn[None], dataclasses.replace(self, pages=pages)


def chunk_attention(q_nhd, pages: dict, table_rp, lengths_r, rows_n, positions_n, cfg: ModelConfig) -> jax.Array:
    """Queries of several sequences' chunks, flat (``q [N, heads, head_dim]``, token ``n`` of
    sequence ``rows_n[n]`` at ``positions_n[n]``), over each sequence's pages (gathered whole:
    the reference path, for a chunk after a cached prefix). Each query scores every row's keys
    and keeps its own row's, so the cost is ``N x rows x width``: meant for the few prefill
    rows of a step. Positions at or past ``lengths`` are never read."""
    k_rksh = gather_pages(pages["k_pages"], pages.get("k_scales"), table_rp)
    v_rksh = gather_pages(pages["v_pages"], pages.get("v_scales"), table_rp)
    r, kv_heads, s, h = k_rksh.shape
    kv_pos = jnp.arange(s, dtype=jnp.int32)
    kv_valid_rs = kv_pos[None, :] < lengths_r[:, None]
    # Rows never written may hold anything (NaN): V's are zeroed, so 0 * NaN cannot reach the
    # output (K's scores are replaced by the mask, never multiplied).
    v_rksh = jnp.where(kv_valid_rs[:, None, :, None], v_rksh, 0.0)
    n, heads, _ = q_nhd.shape
    g = heads // kv_heads
    # One batched matmul per kv head: [kv, n * g, h] x [kv, r * s, h] (the layout XLA runs fastest).
    q = q_nhd.astype(jnp.float32).reshape(n, kv_heads, g, h).transpose(1, 0, 2, 3).reshape(kv_heads, n * g, h)
    k = k_rksh.transpose(1, 0, 2, 3).reshape(kv_heads, r * s, h)
    v = v_rksh.transpose(1, 0, 2, 3).reshape(kv_heads, r * s, h)
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("kqh,kth->kqt", q, k, precision=hi) / math.sqrt(h)
    mask_nrs = (rows_n[:, None, None] == jnp.arange(r)[None, :, None]) & kv_valid_rs[None]
    mask_nrs &= causal_window_mask(positions_n[:, None, None], kv_pos[None, None, :], cfg.sliding_window)
    mask_qt = jnp.broadcast_to(mask_nrs.reshape(n, 1, r * s), (n, g, r * s)).reshape(n * g, r * s)
    scores = jnp.where(mask_qt[None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("kqt,kth->kqh", probs, v, precision=hi)  # [kv, n * g, h]
    out = out.reshape(kv_heads, n, g, h).transpose(1, 0, 2, 3)
    return out.reshape(n, heads, h).astype(q_nhd.dtype)
