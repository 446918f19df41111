"""The contiguous KV cache: the tests' reference for the paged one.

``k`` / ``v [layers, batch, max_len, kv_heads, head_dim]``, each row's tokens at their
positions, attended through the explicit-mask attention. A :class:`hypertron.models.KVCache`
like :class:`hypertron.models.PagedCache`, so ``forward(..., cache=init_cache(...))`` prefills
and decodes a batch generated together; the package itself serves only from pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hypertron.config import ModelConfig
from hypertron.models import resolve_dtype
from hypertron.models.attention import attention_mask, plain_attention


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


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> ContiguousCache:
    """An empty contiguous cache for ``batch`` sequences of up to ``max_len`` tokens."""
    return ContiguousCache.init(cfg, batch, max_len, resolve_dtype(cfg.dtype) if dtype is None else dtype)
