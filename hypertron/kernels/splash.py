"""Flash attention on TPUs: JAX's Pallas splash attention kernel
(``jax.experimental.pallas.ops.tpu.splash_attention``, the one MaxText trains with), for the
decoder's causal self-attention over packed rows.

:func:`splash_attention` takes a device's rows as the decoder holds them, ``[b, t, heads, h]``
queries and ``[b, t, kv_heads, h]`` keys and values with per-token segment ids (a packed row's
documents): causal by token index, never across documents, inside ``window`` tokens when given
(Mistral's sliding window). Each row goes through the kernel alone (``vmap``); grouped-query
attention is the kernel's multi-query form once per KV head, over that head's query heads. The
kernel scores in float32 and keeps no ``t x t`` scores, forward or backward (its own backward
kernels recompute them).

Off a TPU the kernel runs in Pallas's interpret mode (tests: ``tests/test_splash.py`` compares it
with XLA's attention on the CPU); the TPU itself has not run it here.

Block sizes: 512 queries and keys (MaxText's default for Llama on v5p and v6e), else 256 or 128,
the largest that divides the row; the kernel takes rows of whole blocks of a multiple of 128
tokens, interpreted too (:func:`block_for`), and ``auto`` picks it on a TPU for head dims of a
multiple of 128 (:func:`splash_takes`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

BLOCKS = (512, 256, 128)  # the kernel's blocks, largest first; each a multiple of a TPU's 128 lanes
LANES = 128


def block_for(seq_len: int) -> int | None:
    """The block the kernel runs rows of ``seq_len`` in: the largest of :data:`BLOCKS` dividing it
    (None: no block does, and the kernel does not take such rows)."""
    return next((b for b in BLOCKS if seq_len % b == 0), None)


def splash_takes(head_dim: int, seq_len: int) -> bool:
    """Whether ``auto`` picks the kernel on a TPU: rows of whole blocks, head dims a multiple of 128
    (the MXU's width; Llama's 128, Gemma's 256)."""
    return block_for(seq_len) is not None and head_dim % LANES == 0


@functools.lru_cache(maxsize=32)
def _kernel(seq_len: int, group: int, window: int | None, interpret: bool):
    shape = (seq_len, seq_len)
    one = mask_lib.CausalMask(shape) if window is None else mask_lib.LocalMask(shape, (window - 1, 0), 0)
    block = block_for(seq_len)
    if block is None:
        raise ValueError(f"splash attention: rows of {seq_len} tokens are no whole number of blocks of {LANES}")
    sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                  block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # Its mask tables are arrays made once, outside whatever trace asked first (cached across them).
    with jax.ensure_compile_time_eval():
        return kernel_lib.make_splash_mqa(mask_lib.MultiHeadMask([one] * group), block_sizes=sizes, head_shards=1,
                                          q_seq_shards=1, interpret=interpret)


def splash_attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, segment_ids_bt: jax.Array | None,
                     window: int | None = None, interpret: bool | None = None) -> jax.Array:
    """Causal attention of packed rows by the splash kernel (module docstring): ``[b, t, n, h]``
    in ``q``'s dtype. ``interpret`` defaults to "not on a TPU"."""
    b, t, n, h = q_btnh.shape
    kv_heads = k_btkh.shape[2]
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    kernel = _kernel(t, n // kv_heads, window, interpret)
    q = (q_btnh * h ** -0.5).astype(q_btnh.dtype)  # the kernel does not scale
    q_bkgth = q.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)
    k_bkth, v_bkth = k_btkh.transpose(0, 2, 1, 3), v_btkh.transpose(0, 2, 1, 3)

    def row(q_kgth, k_kth, v_kth, seg_t=None):
        ids = None if seg_t is None else kernel_lib.SegmentIds(q=seg_t, kv=seg_t)
        return jax.vmap(lambda q_gth, k_th, v_th: kernel(q_gth, k_th, v_th, segment_ids=ids))(q_kgth, k_kth, v_kth)

    rows = (q_bkgth, k_bkth, v_bkth) + (() if segment_ids_bt is None else (segment_ids_bt.astype(jnp.int32),))
    out_bkgth = jax.vmap(row)(*rows)
    return out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_btnh.dtype)
