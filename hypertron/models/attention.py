"""Attention over one sequence of queries: the training path and the reference.

:func:`self_attention` is what training runs: cuDNN flash
attention on NVIDIA GPUs through ``jax.nn.dot_product_attention``, the splash kernel on TPUs
(:mod:`hypertron.kernels.splash`, in ``shard_map`` over the batch and heads the rules split),
XLA's otherwise, or the explicit-mask :func:`plain_attention`. :func:`attention_mask` is the one definition of who
may attend to whom (causal, same document, inside the sliding window). The caches of
:mod:`hypertron.models.kv_cache` attend with these.

Where the active sharding rules split the tokens of a row (``mesh.context`` > 1),
:func:`context_attention` runs instead, in ``shard_map``: each device keeps its queries and
all-gathers the row's keys, values, positions and segment ids over the context axes (at KV-head
width; the gather's gradient is a reduce-scatter), and masks by positions and segment ids, never
by token index. So a row's tokens may come in any order: load balancing
(``model.context_load_balance``, :func:`hypertron.data.pipeline.balanced_order`) reorders them so
that each device scores as many causal pairs.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from hypertron.config import ModelConfig
from hypertron.kernels.ragged_attention import causal_window_mask
from hypertron.kernels.splash import block_for, splash_attention, splash_takes
from hypertron.parallel.rules import active_rules, mesh_axes, spec_for


def attention_mask(
    q_pos_bt: jax.Array,
    kv_pos_bs: jax.Array,
    cfg: ModelConfig,
    q_seg_bt: jax.Array | None = None,
    kv_seg_bs: jax.Array | None = None,
    kv_valid_bs: jax.Array | None = None,
) -> jax.Array:
    """Boolean mask [b, 1, t, s]: causal, same document, inside the sliding window."""
    mask = causal_window_mask(q_pos_bt[:, None, :, None], kv_pos_bs[:, None, None, :], cfg.sliding_window)
    if q_seg_bt is not None:
        mask &= q_seg_bt[:, None, :, None] == kv_seg_bs[:, None, None, :]
    if kv_valid_bs is not None:
        mask &= kv_valid_bs[:, None, None, :]
    return mask


def plain_attention(q_btnh, k_bskh, v_bskh, mask_b1ts) -> jax.Array:
    """Reference attention in plain XLA ops (float32 softmax); GQA by grouping query heads."""
    b, t, n, h = q_btnh.shape
    kv_heads = k_bskh.shape[2]
    q = q_btnh.reshape(b, t, kv_heads, n // kv_heads, h)  # [b, t, k, g, h]
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k_bskh, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(h)
    mask = mask_b1ts[:, :, None]  # [b, 1, 1, t, s]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh)
    return out.reshape(b, t, n, h)


def cudnn_takes(head_dim: int, dtype, seq_len: int, hopper: bool = True) -> bool:
    """Whether cuDNN's flash attention takes this shape, forward and gradients: bf16/fp16, a head
    dim that is a multiple of 8 and at most 256 on Hopper (``hopper``, the default: the GPUs this
    project plans for) or 128 before it, an even sequence length; anything else fails at compile
    time. Measured on an H200 (2026-11-26, JAX 0.11.2, ``bench/gpu_campaign.py`` ``t2.cudnn_grid``,
    docs/benchmarks.md): head dims 64-256 taken in bf16 and fp16, 100 refused (not a multiple of 8),
    length 2047 refused, float32 refused. Pure (no device is asked): the one rule that
    :func:`attention_impl`, :func:`full_attention` and the memory model (which plans for hardware
    it does not have) follow."""
    return (jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0
            and head_dim <= (256 if hopper else 128) and seq_len % 2 == 0)


def cudnn_supported(cfg: ModelConfig, dtype, seq_len: int, hopper: bool = True) -> bool:
    """:func:`cudnn_takes` for a decoder's heads."""
    return cudnn_takes(cfg.head_dim, dtype, seq_len, hopper)


def is_hopper(device) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or later (JAX's ``compute_capability``, "9.0")."""
    try:
        return float(getattr(device, "compute_capability", 0) or 0) >= 9.0
    except (TypeError, ValueError):
        return False


def _cudnn_here(head_dim: int, dtype, seq_len: int) -> bool:
    """An NVIDIA GPU is the default backend and cuDNN takes the shape there."""
    device = jax.local_devices()[0]
    return (jax.default_backend() == "gpu" and "nvidia" in getattr(device, "device_kind", "").lower()
            and cudnn_takes(head_dim, dtype, seq_len, is_hopper(device)))


def flash_on(cfg: ModelConfig, platform: str, dtype, seq_len: int, hopper: bool = True) -> bool:
    """Whether ``cfg``'s attention keeps no ``t x t`` scores on ``platform`` (gpu, tpu, cpu): cuDNN's
    where it takes the shape, splash where it does (:func:`attention_impl`'s rule; the memory
    model plans with it)."""
    if cfg.attention == "cudnn":
        return True
    if cfg.attention == "splash":  # any head dim (interpreted, or a TPU's choice to make); whole blocks
        return block_for(seq_len) is not None
    if cfg.attention != "auto":
        return False
    if platform == "gpu":
        return cudnn_supported(cfg, dtype, seq_len, hopper)
    return platform == "tpu" and splash_takes(cfg.head_dim, seq_len)


def attention_impl(cfg: ModelConfig, dtype, seq_len: int) -> str:
    """``auto``: cuDNN flash attention on NVIDIA GPUs where cuDNN takes the shape
    (:func:`cudnn_supported`), the splash kernel on TPUs where it takes it, else XLA."""
    if cfg.attention != "auto":
        return cfg.attention
    if jax.default_backend() == "tpu" and splash_takes(cfg.head_dim, seq_len):
        return "splash"
    return "cudnn" if _cudnn_here(cfg.head_dim, dtype, seq_len) else "xla"


# blocked_attention's blocks where full_attention takes it (CPU): 256 queries mapped, 512 keys a
# scan step. Measured 2026-11-26 on this project's 2-core CPU VM (JAX 0.10.2, float32, one
# thread, median of 3) against jax.nn.dot_product_attention: [2, 4096, 8, 8] 0.33 s against
# 2.88 s (torch's SDPA: 0.61 s), [2, 1024, 8, 8] 22 ms against 185 ms, [2, 4096, 8, 64] 1.65 s
# against 3.90 s, [2, 1024, 8, 40] 0.10 s against 0.32 s, with blocks of 128 x 512. Then, the VM
# alone (medians of 3-5): 256 x 512 against 128 x 512, [2, 4096, 8, 8] 158 against 228 ms,
# [2, 1024, 8, 16] 15.6 against 21.4, [2, 4096, 8, 64] 617 against 967, [2, 1024, 8, 40] 29 against
# 55, [1, 528, 2, 16] 1.0 against 1.5; 64 x 256, 128 x 256, 256 x 256, 32 x 512, 512 x 256,
# 512 x 512, 256 x 1024 and 1024 x 256 were slower than 256 x 512.
BLOCK_Q, BLOCK_K = 256, 512
# full_attention blocks on the CPU from this many scores (queries x keys) a head: [2, 256, 4, 16]
# took 1.6 ms blocked against 13.5 ms, [2, 64, 2, 16] 0.4 ms against 0.2 ms.
BLOCKED_MIN_SCORES = 256 * 256


def _blocks(n: int, most: int) -> tuple[int, int]:
    """``(count, size)``: the fewest blocks of at most ``most`` (a multiple of 8 unless ``n`` is
    smaller) that cover ``n``, as even as can be, so that padding stays under 8 a block."""
    count = -(-n // most)
    size = -(-n // count)
    return count, size if count == 1 else -(-size // 8) * 8


def blocked_attention(q_bsnh: jax.Array, k_btnh: jax.Array, v_btnh: jax.Array, *, block_q: int = BLOCK_Q,
                      block_k: int = BLOCK_K) -> jax.Array:
    """Unmasked attention in plain JAX without the ``[s, t]`` scores in memory (flash attention's
    order): blocks of queries one after another (``lax.map``), each scanning blocks of keys with
    an online softmax in float32; lengths that are no multiple of a block are padded, padded keys
    masked and padded queries dropped. ``[b, s, n, h]`` in ``q``'s dtype, as
    ``jax.nn.dot_product_attention``'s."""
    b, s, n, h = q_bsnh.shape
    t = k_btnh.shape[1]
    (nq, bq), (nk, bk) = _blocks(s, block_q), _blocks(t, block_k)
    f32 = jnp.float32
    q = jnp.pad(q_bsnh.astype(f32) * h ** -0.5, ((0, 0), (0, nq * bq - s), (0, 0), (0, 0)))
    k, v = (jnp.pad(a.astype(f32), ((0, 0), (0, nk * bk - t), (0, 0), (0, 0))) for a in (k_btnh, v_btnh))
    q_qbnmh = q.reshape(b, nq, bq, n, h).transpose(1, 0, 3, 2, 4)
    k_kbnhj = k.reshape(b, nk, bk, n, h).transpose(1, 0, 3, 4, 2)
    v_kbnjh = v.reshape(b, nk, bk, n, h).transpose(1, 0, 3, 2, 4)
    valid_kj = (jnp.arange(nk)[:, None] * bk + jnp.arange(bk)[None, :]) < t
    padded_keys = nk * bk != t

    def query_block(q_bnmh):
        def key_block(carry, kv):
            m_bnm, l_bnm, acc_bnmh = carry
            k_bnhj, v_bnjh, valid_j = kv
            s_bnmj = jnp.einsum("bnmh,bnhj->bnmj", q_bnmh, k_bnhj)
            if padded_keys:  # static: a pass over the scores only where a key block holds padding
                s_bnmj = jnp.where(valid_j, s_bnmj, -jnp.inf)
            m_new = jnp.maximum(m_bnm, s_bnmj.max(-1))
            alpha, p_bnmj = jnp.exp(m_bnm - m_new), jnp.exp(s_bnmj - m_new[..., None])
            acc_bnmh = alpha[..., None] * acc_bnmh + jnp.einsum("bnmj,bnjh->bnmh", p_bnmj, v_bnjh)
            return (m_new, alpha * l_bnm + p_bnmj.sum(-1), acc_bnmh), None

        init = (jnp.full(q_bnmh.shape[:-1], -jnp.inf, f32), jnp.zeros(q_bnmh.shape[:-1], f32), jnp.zeros_like(q_bnmh))
        (_, l_bnm, acc_bnmh), _ = lax.scan(key_block, init, (k_kbnhj, v_kbnjh, valid_kj))
        return acc_bnmh / l_bnm[..., None]  # the first key block is never all padding: l > 0

    o_qbnmh = lax.map(query_block, q_qbnmh)
    return o_qbnmh.transpose(1, 0, 3, 2, 4).reshape(b, nq * bq, n, h)[:, :s].astype(q_bsnh.dtype)


def full_attention(q_bsnh: jax.Array, k_btnh: jax.Array, v_btnh: jax.Array) -> jax.Array:
    """Unmasked attention (the diffusion models'): cuDNN's flash attention for self-attention
    (as many keys as queries) on NVIDIA GPUs where it takes the shape; on the CPU from
    :data:`BLOCKED_MIN_SCORES` scores a head, :func:`blocked_attention`; XLA's otherwise
    (``jax.nn.dot_product_attention`` with no implementation named: unfused, the scores in
    memory; Flux-dev's 4,608-token joint attention ran at 0.74x diffusers' SDPA that way on an
    H100, 2026-11-26)."""
    s, t = q_bsnh.shape[1], k_btnh.shape[1]
    if s == t and _cudnn_here(q_bsnh.shape[-1], q_bsnh.dtype, t):
        return jax.nn.dot_product_attention(q_bsnh, k_btnh, v_btnh, implementation="cudnn")
    if jax.default_backend() == "cpu" and s * t >= BLOCKED_MIN_SCORES:
        return blocked_attention(q_bsnh, k_btnh, v_btnh)
    return jax.nn.dot_product_attention(q_bsnh, k_btnh, v_btnh, implementation="xla")


def self_attention(q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, cfg: ModelConfig):
    """Causal self-attention over one packed sequence, never across documents.

    ``xla`` and ``cudnn`` go through ``jax.nn.dot_product_attention`` (cuDNN
    flash attention on GPU); ``plain`` is the explicit-mask reference. A row split over
    context-parallel devices goes through :func:`context_attention`.
    """
    impl = attention_impl(cfg, q_btnh.dtype, q_btnh.shape[1])
    active = active_rules()
    if active is not None and mesh_axes(spec_for(("batch", "seq"), active[1], active[0], positions_bt.shape)[1]):
        return context_attention(q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, cfg, impl, *active)
    if impl == "plain":
        mask = attention_mask(positions_bt, positions_bt, cfg, segment_ids_bt, segment_ids_bt)
        return plain_attention(q_btnh, k_btkh, v_btkh, mask)
    if impl == "splash":
        return _splash(q_btnh, k_btkh, v_btkh, segment_ids_bt, cfg, active)
    mask = None
    if segment_ids_bt is not None:
        mask = segment_ids_bt[:, None, :, None] == segment_ids_bt[:, None, None, :]
    window = None if cfg.sliding_window is None else (cfg.sliding_window - 1, 0)
    return jax.nn.dot_product_attention(
        q_btnh, k_btkh, v_btkh, mask=mask, is_causal=True, local_window_size=window,
        implementation=impl,
    )


def _head_specs(q_btnh, k_btkh, v_btkh, mesh, rules):
    """The specs of queries and keys/values as the rules split them, and the keys and values to
    use: where the rules split the query heads but not the fewer KV heads, the KV heads are copied
    so that each device gets its query heads' own (one copy a device where the split is a multiple
    of the KV heads, else one a query head)."""
    q_spec = spec_for(("batch", "seq", "act_heads", None), rules, mesh, q_btnh.shape)
    kv_spec = spec_for(("batch", "seq", "act_kv_heads", None), rules, mesh, k_btkh.shape)
    if q_spec[2] is None:
        kv_spec = P(*kv_spec[:2], None, None)
    elif kv_spec[2] is None:
        kv_heads, split = k_btkh.shape[2], math.prod(mesh.shape[a] for a in mesh_axes(q_spec[2]))
        copies = split // kv_heads if split % kv_heads == 0 else q_btnh.shape[2] // kv_heads
        k_btkh, v_btkh = jnp.repeat(k_btkh, copies, axis=2), jnp.repeat(v_btkh, copies, axis=2)
        kv_spec = q_spec
    return q_spec, kv_spec, k_btkh, v_btkh


def _splash(q_btnh, k_btkh, v_btkh, segment_ids_bt, cfg: ModelConfig, active):
    """:func:`splash_attention` of whole rows; under sharding rules, in ``shard_map`` over the
    batch and heads they split (a Pallas kernel is not partitioned by XLA)."""
    if active is None:
        return splash_attention(q_btnh, k_btkh, v_btkh, segment_ids_bt, cfg.sliding_window)
    mesh, rules = active
    q_spec, kv_spec, k_btkh, v_btkh = _head_specs(q_btnh, k_btkh, v_btkh, mesh, rules)
    args = (q_btnh, k_btkh, v_btkh) + (() if segment_ids_bt is None else (segment_ids_bt,))
    specs = (q_spec, kv_spec, kv_spec, P(*q_spec[:2]))[:len(args)]

    def local(q, k, v, seg=None):
        return splash_attention(q, k, v, seg, cfg.sliding_window)

    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


def context_attention(q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, cfg: ModelConfig, impl: str,
                      mesh, rules):
    """:func:`self_attention` of rows whose tokens the rules split over mesh axes (``seq``:
    ``context``): in ``shard_map``, this device's queries against the row's keys and values,
    gathered (see the module docstring). Heads stay split over ``tensor`` as the rules say; where
    they split the query heads but not the fewer KV heads, the KV heads are copied first
    (:func:`_head_specs`), so that a device's query heads meet their own KV heads. The splash kernel masks by
    token index, not position, so a split row's attention is XLA's (scores held, as the memory
    model plans)."""
    q_spec, kv_spec, k_btkh, v_btkh = _head_specs(q_btnh, k_btkh, v_btkh, mesh, rules)
    seq, row_spec = mesh_axes(q_spec[1]), P(*q_spec[:2])
    impl = "xla" if impl == "splash" else impl

    def local(q, k, v, pos, seg=None):
        gather = partial(lax.all_gather, axis_name=seq, axis=1, tiled=True)
        mask = attention_mask(pos, gather(pos), cfg, seg, None if seg is None else gather(seg))
        if impl == "plain":
            return plain_attention(q, gather(k), gather(v), mask)
        return jax.nn.dot_product_attention(q, gather(k), gather(v), mask=mask, implementation=impl)

    args = (q_btnh, k_btkh, v_btkh, positions_bt) + (() if segment_ids_bt is None else (segment_ids_bt,))
    specs = (q_spec, kv_spec, kv_spec, row_spec, row_spec)[:len(args)]
    # check_vma=False: cuDNN's attention is a custom VJP that carries no varying-axes types.
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)
