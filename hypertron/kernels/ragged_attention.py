"""Ragged paged decode attention: one new query token per sequence over a paged KV cache.
(Any number of queries a row, as a serving step has: :mod:`hypertron.kernels.ragged_paged_attention`,
which shares this module's layout, checks and backends.)

Cache layout (fixed; the serving engine writes it)::

    k_pages, v_pages   [num_kv_heads, num_pages, page_size, head_dim]   float32, bfloat16, int8
    k_scales, v_scales [num_kv_heads, num_pages, page_size]   int8 pages only: int8 * scale
    page_indices       int32 [batch, pages_per_seq]   slot j of sequence b: page_indices[b, j]
    lengths            int32 [batch]   valid tokens of each sequence; 0: an empty slot

Token ``t`` of sequence ``b`` is row ``t % page_size`` of page ``page_indices[b, t // page_size]``
(``K[b, kv, t]`` below). The query ``q [batch, num_heads, head_dim]`` is the token at position
``lengths - 1``, already in the cache. With ``G = num_heads // num_kv_heads``, query head ``h``
reads kv head ``h // G``::

    s = sm_scale * K[b, h // G, start:length] @ q[b, h]
    out[b, h] = softmax(s) @ V[b, h // G, start:length]

with ``start = max(length - window, 0)`` (``0`` without a window), the same window as the
decoder's ``q - kv < sliding_window``. An empty slot gives zeros. Lengths past the page table's
capacity ``pages_per_seq * page_size`` are clipped to it. Page-table entries past a sequence's
last page may be anything in range; nothing is read through them.

Backends (``backend=``):

``"pallas"``
    A Pallas kernel, one program per ``(sequence, kv head)``: the ``G`` query heads of a GQA
    group (padded to a power of two, at least 16 for Triton's dot) share each K/V load. It loops
    over blocks of ``pages_per_block`` of the sequence's own pages, from the block holding
    ``start`` to the block holding ``length - 1`` (a dynamic bound, so pages past the length or
    before the window are never visited), keeping an online softmax in float32 (running max,
    sum and ``[G, head_dim]`` accumulator). A block's pages are gathered through the page table
    in one load; in the first and last block, slots outside ``[first page, last page]`` are
    clamped to those pages (re-read, masked out) so that no entry past the last page is used.
    Positions outside ``[start, length)`` are masked in the scores and in V (and in V's scales),
    so stale or NaN rows in a partly filled page never leak. int8 pages are dequantised in the
    kernel by folding the scales into the scores (K) and into the probabilities (V).
``"native"``
    A C++ kernel for the CPU (:mod:`hypertron.kernels.cpu_decode`): each (sequence, kv head)
    reads its pages straight from the pool with an online softmax, the items over XLA's thread
    pool. Float32 or int8 pages.
``"reference"``
    Pure JAX: gather every page of the page table, dequantise, mask by length and window, float32
    softmax at highest precision. The oracle for tests, and the CPU path where ``native`` is not.
``"auto"``
    ``AUTO_BACKEND[jax.default_backend()]``.

Verified (CPU, JAX 0.10.2, ``tests/test_ragged_attention.py``): the kernel in interpret mode
against the reference (float32, bfloat16 and int8 pages; GQA ratios 1, 2 and 4; lengths 1, a
page, a page + 1, several pages, the capacity, 0; permuted page tables whose entries past the
length point at pages of NaN; a sliding window), the reference against dense attention in numpy
over unpaged K/V, the :func:`quantize_kv` error bound, and that the kernel lowers to Triton IR for
a CUDA target (``jax.export`` with ``platforms=("cuda",)``, no GPU needed). On a GPU (2026-11-25,
one H100): the same tests compiled for it pass in bf16 (float32 then ran in TF32, Triton's
default; the tests now ask for float32 matmuls), and its speed is in docs/benchmarks.md. Not
verified: that pages past the length are never *loaded* (only that they cannot change the
output; the loop bounds make it so by construction). Written for the Triton lowering (named in
``compiler_params``): power-of-two load shapes, no data-dependent shapes, dynamic loop bounds;
not for Mosaic TPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from hypertron.kernels import cpu_decode
from hypertron.kernels.backends import TRITON, auto_backend, interpret_default, whole

BACKENDS = ("auto", "native", "pallas", "reference")

# Tokens per kernel block when pages_per_block is not given (the usual Triton block; untuned).
DEFAULT_BLOCK_TOKENS = 128
# Triton's dot wants at least 16 rows: the query heads of a GQA group are padded up to this.
MIN_GROUP_ROWS = 16

# CPU: the C++ kernel (hypertron.kernels.cpu_decode; the reference where it cannot be built or
# take the shapes), measured 1.5-8x faster than the reference (docs/benchmarks.md, "A C++ decode
# attention on the CPU"); Pallas's interpret mode runs op by op, for correctness only. TPU: the
# Pallas kernel is written for Triton, not Mosaic TPU. GPU: the Pallas kernel, measured 3.6x faster
# than the reference (2026-11-25, one H100, JAX 0.11.2: 64 sequences of 4k-8k tokens, bf16 pages,
# 0.565 against 2.017 ms; docs/benchmarks.md t2.ragged). int8 pages there are still to be timed alone.
AUTO_BACKEND = {"cpu": "native", "gpu": "pallas", "cuda": "pallas",
                "rocm": "reference", "tpu": "reference"}


@dataclasses.dataclass(frozen=True)
class CallConfig:
    """Static (hashable) settings of one call (of this module's attention or
    :mod:`hypertron.kernels.ragged_paged_attention`'s)."""

    backend: str
    sm_scale: float
    pages_per_block: int | None  # None: DEFAULT_BLOCK_TOKENS worth of pages
    interpret: bool


# ---------------------------------------------------------------------------
# Public API


def ragged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            lengths: jax.Array, page_indices: jax.Array, *,
                            k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                            sm_scale: float | None = None, window: int | jax.Array | None = None,
                            backend: str = "auto", pages_per_block: int | None = None,
                            interpret: bool | None = None) -> jax.Array:
    """Decode attention of one query token per sequence over its pages of the KV cache.

    Args:
      q: ``[batch, num_heads, head_dim]``, the token at position ``lengths - 1``.
      k_pages, v_pages: ``[num_kv_heads, num_pages, page_size, head_dim]``, float or int8;
        ``num_heads`` a multiple of ``num_kv_heads``.
      lengths: int ``[batch]``, valid tokens per sequence (0: empty slot, output zeros).
      page_indices: int ``[batch, pages_per_seq]``, the page of each slot of each sequence.
      k_scales, v_scales: ``[num_kv_heads, num_pages, page_size]`` float, given iff the pages
        are int8 (value = int8 * scale; see :func:`quantize_kv`).
      sm_scale: multiplies the scores; default ``head_dim ** -0.5``.
      window: attend only to positions ``>= lengths - window`` (an int >= 1, or an int32 scalar
        array, data like ``lengths``); None: the whole sequence.
      backend: one of :data:`BACKENDS`.
      pages_per_block: pages per kernel step ("pallas"), a power of two; default: enough pages
        for :data:`DEFAULT_BLOCK_TOKENS` tokens.
      interpret: run the Pallas kernel in interpret mode; default: on CPU only.

    Returns:
      ``[batch, num_heads, head_dim]`` in ``q.dtype``; softmax and accumulation in float32.
    """
    _check_shapes(q, k_pages, v_pages, lengths, page_indices, k_scales, v_scales)
    head_dim, asked = q.shape[-1], backend == "native"
    backend, interpret = check_call(backend, window, pages_per_block, interpret, AUTO_BACKEND, head_dim,
                                    k_pages.shape[2])
    backend = native_or_reference(backend, q.shape[1], k_pages, asked)
    sm_scale = float(head_dim ** -0.5 if sm_scale is None else sm_scale)
    cfg = CallConfig(backend, sm_scale, pages_per_block, interpret)
    capacity = page_indices.shape[1] * k_pages.shape[2]
    window = jnp.asarray(capacity if window is None else window, jnp.int32)
    return _attention_jit(q, k_pages, v_pages, lengths, page_indices, k_scales, v_scales,
                          window, cfg)


def causal_window_mask(q_pos: jax.Array, kv_pos: jax.Array, window: int | jax.Array | None = None) -> jax.Array:
    """Whether the query at position ``q_pos`` attends to the key at ``kv_pos`` (broadcast
    together): causal, and with a sliding ``window``, only the ``window`` latest positions (its
    own included). The one definition of the rule: the reference here, training attention's mask
    (``models.attention.attention_mask``) and a chunk after cached pages
    (``models.kv_cache``) all call it; the Pallas kernel's loop bounds follow it."""
    mask = kv_pos <= q_pos
    if window is not None:
        mask &= q_pos - kv_pos < window
    return mask


def ragged_decode_attention_reference(q, k_pages, v_pages, lengths, page_indices, *,
                                      k_scales=None, v_scales=None, sm_scale=None,
                                      window=None) -> jax.Array:
    """:func:`ragged_decode_attention` in plain JAX: gather every page, mask, softmax.

    Arguments as there (``window`` an int, an int32 scalar or None); returns ``[b, h, d]`` in
    ``q.dtype``. Materialises ``[batch, kv_heads, pages_per_seq * page_size, head_dim]`` float32.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    capacity = page_indices.shape[1] * page_size
    sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, capacity)
    pos_t = jnp.arange(capacity, dtype=jnp.int32)
    # The query is the token at lengths - 1 (an empty slot's, at -1, sees nothing).
    valid_bt = causal_window_mask(lengths[:, None] - 1, pos_t[None, :], window)

    k_bktd = gather_pages(k_pages, k_scales, page_indices)
    v_bktd = gather_pages(v_pages, v_scales, page_indices)
    # Masked rows may hold anything (stale tokens, NaN): zero them so 0 * NaN cannot appear.
    v_bktd = jnp.where(valid_bt[:, None, :, None], v_bktd, 0.0)
    q_bkgd = q.astype(jnp.float32).reshape(batch, num_kv_heads, -1, head_dim)
    hi = lax.Precision.HIGHEST
    s_bkgt = jnp.einsum("bkgd,bktd->bkgt", q_bkgd, k_bktd, precision=hi) * sm_scale
    s_bkgt = jnp.where(valid_bt[:, None, None, :], s_bkgt, -jnp.inf)
    m_bkg1 = jnp.max(s_bkgt, axis=-1, keepdims=True)
    p_bkgt = jnp.exp(s_bkgt - jnp.where(jnp.isfinite(m_bkg1), m_bkg1, 0.0))
    l_bkg1 = jnp.sum(p_bkgt, axis=-1, keepdims=True)
    out_bkgd = jnp.einsum("bkgt,bktd->bkgd", p_bkgt, v_bktd, precision=hi)
    out_bkgd = out_bkgd / jnp.where(l_bkg1 > 0, l_bkg1, 1.0)  # empty slot: 0 / 1
    return out_bkgd.reshape(batch, num_heads, head_dim).astype(q.dtype)


def quantize_kv(x: jax.Array, scale_dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantisation per vector of the last axis (per token, per head).

    ``x [..., head_dim]`` -> ``(values int8 [..., head_dim], scales [...] in scale_dtype)`` with
    ``x ~= values * scales[..., None]``: ``scale = max|x| / 127``, rounded to ``scale_dtype``
    first and the values computed from the rounded scale, so the error per element is about
    half a scale step (at most ``0.51 * max|x| / 127`` for bfloat16 scales). A zero vector gets
    scale 0 and values 0 (no division by zero).
    """
    x32 = x.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(x32), axis=-1) / 127.0).astype(scale_dtype)
    s32 = scale.astype(jnp.float32)[..., None]
    safe = jnp.where(s32 > 0, s32, 1.0)
    values = jnp.clip(jnp.round(x32 / safe), -127, 127).astype(jnp.int8)
    return values, scale


def gather_pages(pages, scales, page_indices) -> jax.Array:
    """``[k, P, S, d]`` pages read through ``page_indices [b, p]`` -> float32 ``[b, k, p*S, d]``."""
    return gather_pages_by_head(pages, scales, page_indices).transpose(1, 0, 2, 3)


def gather_pages_by_head(pages, scales, page_indices) -> jax.Array:
    """:func:`gather_pages` with the KV heads first, ``[k, b, p*S, d]``: the order the gather
    makes, with no transpose."""
    num_kv_heads, _, page_size, head_dim = pages.shape
    batch, per_seq = page_indices.shape
    x_kbpsd = pages[:, page_indices].astype(jnp.float32)
    if scales is not None:
        x_kbpsd = x_kbpsd * scales[:, page_indices].astype(jnp.float32)[..., None]
    return x_kbpsd.reshape(num_kv_heads, batch, per_seq * page_size, head_dim)


# ---------------------------------------------------------------------------
# Pallas kernel


def online_softmax_block(carry, q, h, pages, mask, key_valid, k_ref, v_ref, ks_ref, vs_ref, *,
                         sm_scale: float):
    """One block of pages in a Pallas kernel's online softmax (this module's decode kernel and
    :mod:`~hypertron.kernels.ragged_paged_attention`'s): the scores of ``q [M, d]`` against KV
    head ``h``'s ``pages``, ``mask [M, T]`` (or broadcast to it) the pairs that attend,
    ``key_valid [T]`` the keys written (others may be NaN, as may their int8 scales: both
    masked), ``ks_ref``/``vs_ref`` None for float pages. ``carry`` (running max, sum, output:
    ``[M]``, ``[M]``, ``[M, d]`` float32) in, the next out; a query with no key yet stays 0."""
    m, l, acc = carry
    block_tokens, head_dim = key_valid.shape[0], q.shape[1]
    k = k_ref[h, pages].reshape(block_tokens, head_dim).astype(q.dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if ks_ref is not None:  # K's scale is per column of the scores
        s = s * ks_ref[h, pages].reshape(1, block_tokens).astype(jnp.float32)
    s = jnp.where(mask, s * sm_scale, -jnp.inf)  # [M, T]
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    l = alpha * l + jnp.sum(p, axis=1)
    v = v_ref[h, pages].reshape(block_tokens, head_dim)
    if vs_ref is not None:  # V's scale is per row of V: fold it into p (masked: it may be NaN)
        v_scale = vs_ref[h, pages].reshape(block_tokens).astype(jnp.float32)
        p = p * jnp.where(key_valid, v_scale, 0.0)[None, :]
    else:
        v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))
    pv = lax.dot_general(p.astype(q.dtype), v.astype(q.dtype), (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)
    return m_new, l, alpha[:, None] * acc + pv


def _decode_kernel(lengths_ref, window_ref, table_ref, q_ref, k_ref, v_ref, *rest,
                   page_size: int, pages_per_block: int, sm_scale: float, quantized: bool):
    """One ``(sequence b, kv head h)``: online softmax over blocks of b's pages."""
    ks_ref, vs_ref, out_ref = rest if quantized else (None, None, rest[0])
    b, h = pl.program_id(0), pl.program_id(1)
    block_tokens = pages_per_block * page_size
    length = lengths_ref[b]
    start = jnp.maximum(length - window_ref[0], 0)
    first_page = lax.div(start, page_size)
    last_page = lax.div(jnp.maximum(length - 1, 0), page_size)
    first_block = lax.div(first_page, pages_per_block)
    end_block = jnp.where(length > 0, lax.div(last_page, pages_per_block) + 1, first_block)
    q = q_ref[...]  # [Gp, d], already in the compute dtype
    gp, head_dim = q.shape

    def block(i, carry):  # carry: [Gp], [Gp], [Gp, d] float32
        slots = i * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
        # Clamped: slots before the window or past the last page re-read a page in range.
        pages = table_ref[b, jnp.clip(slots, first_page, last_page)]  # [ppb]
        pos = i * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
        valid = (pos >= start) & (pos < length)  # [T]
        return online_softmax_block(carry, q, h, pages, valid[None, :], valid, k_ref, v_ref, ks_ref,
                                    vs_ref, sm_scale=sm_scale)

    init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32),
            jnp.zeros((gp, head_dim), jnp.float32))
    _, l, acc = lax.fori_loop(first_block, end_block, block, init)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # an empty slot visits nothing: 0 / 1
    out_ref[...] = out.astype(out_ref.dtype)


def pallas_layout(q, k_pages, k_scales, cfg: CallConfig) -> tuple[int, int, int, int, int, int, bool, Any]:
    """What both Pallas kernels read off their operands: ``(num_heads, head_dim, num_kv_heads,
    page_size, group, pages_per_block, quantized, compute dtype)`` (the shapes
    :func:`pallas_unfit` passed). int8 pages are converted to q's dtype in the kernel (exact for bf16/f32); float
    pages meet q in their common type."""
    _, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    ppb = cfg.pages_per_block or default_pages_per_block(page_size)
    quantized = k_scales is not None
    compute = q.dtype if quantized else jnp.promote_types(q.dtype, k_pages.dtype)
    return num_heads, head_dim, num_kv_heads, page_size, num_heads // num_kv_heads, ppb, quantized, compute


def _pallas_attention(q, k_pages, v_pages, lengths, page_indices, k_scales, v_scales, window,
                      cfg: CallConfig):
    batch = q.shape[0]
    num_heads, head_dim, num_kv_heads, page_size, group, ppb, quantized, compute = pallas_layout(
        q, k_pages, k_scales, cfg)
    gp = max(MIN_GROUP_ROWS, pl.next_power_of_2(group))
    q_bkgd = q.astype(compute).reshape(batch, num_kv_heads, group, head_dim)
    q_bkgd = jnp.pad(q_bkgd, ((0, 0), (0, 0), (0, gp - group), (0, 0)))  # zero rows: sliced off
    operands = [lengths, window.reshape(1), page_indices, q_bkgd, k_pages, v_pages]
    operands += [k_scales, v_scales] if quantized else []
    kernel = functools.partial(_decode_kernel, page_size=page_size, pages_per_block=ppb,
                               sm_scale=cfg.sm_scale, quantized=quantized)
    out = call_per_kv_head(kernel, operands, 3, (batch, num_kv_heads, gp, head_dim), q.dtype, cfg,
                           "ragged_decode_attention")
    return out[:, :, :group].reshape(batch, num_heads, head_dim)


def call_per_kv_head(kernel, operands: list, q_index: int, out_shape: tuple[int, int, int, int], dtype,
                     cfg: CallConfig, name: str) -> jax.Array:
    """``kernel`` as one Triton program per (block, KV head): ``out_shape`` is ``[blocks, kv_heads,
    rows, head_dim]``; ``operands[q_index]`` (the queries, laid out so) and the output are blocked
    by it, every other operand is whole (the kernels index the pages themselves)."""
    blocks, kv_heads, rows, head_dim = out_shape
    spec = pl.BlockSpec((None, None, rows, head_dim), lambda i, h: (i, h, 0, 0))
    in_specs = [whole(x) for x in operands]
    in_specs[q_index] = spec
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(out_shape, dtype), grid=(blocks, kv_heads),
                          in_specs=in_specs, out_specs=spec, interpret=cfg.interpret, compiler_params=TRITON,
                          name=name)(*operands)


@functools.partial(jax.jit, static_argnums=8)
def _attention_jit(q, k_pages, v_pages, lengths, page_indices, k_scales, v_scales, window,
                   cfg: CallConfig):
    capacity = page_indices.shape[1] * k_pages.shape[2]
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, capacity)
    page_indices = page_indices.astype(jnp.int32)
    if cfg.backend == "reference":
        return ragged_decode_attention_reference(
            q, k_pages, v_pages, lengths, page_indices, k_scales=k_scales, v_scales=v_scales,
            sm_scale=cfg.sm_scale, window=window)
    if cfg.backend == "native":
        return cpu_decode.paged_decode(q, k_pages, v_pages, lengths, page_indices, window, k_scales=k_scales,
                                       v_scales=v_scales, sm_scale=cfg.sm_scale)
    return _pallas_attention(q, k_pages, v_pages, lengths, page_indices, k_scales, v_scales,
                             window, cfg)


def check_pages(q, k_pages, v_pages, k_scales, v_scales) -> None:
    if (q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape
            or v_pages.dtype != k_pages.dtype):
        raise ValueError("ragged attention wants q [tokens, heads, head_dim] and k_pages, v_pages "
                         "[kv_heads, pages, page_size, head_dim] of one shape and dtype, got "
                         f"{q.shape}, {k_pages.shape} {k_pages.dtype}, "
                         f"{v_pages.shape} {v_pages.dtype}")
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_pages.shape[0]
    if k_pages.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {q.shape} does not fit pages {k_pages.shape}: head_dim must agree and "
                         "num_heads be a multiple of num_kv_heads")
    quantized = k_pages.dtype == jnp.int8
    if (k_scales is not None, v_scales is not None) != (quantized, quantized):
        raise ValueError("k_scales and v_scales are given exactly when the pages are int8, got "
                         f"{k_pages.dtype} pages with scales "
                         f"{[s is not None for s in (k_scales, v_scales)]}")
    if quantized and (k_scales.shape != k_pages.shape[:3] or v_scales.shape != k_pages.shape[:3]):
        raise ValueError(f"k_scales and v_scales must be {k_pages.shape[:3]}, got "
                         f"{k_scales.shape} and {v_scales.shape}")


def _check_shapes(q, k_pages, v_pages, lengths, page_indices, k_scales, v_scales) -> None:
    check_pages(q, k_pages, v_pages, k_scales, v_scales)
    batch = q.shape[0]
    if lengths.shape != (batch,) or page_indices.ndim != 2 or page_indices.shape[0] != batch:
        raise ValueError(f"lengths must be [{batch}] and page_indices [{batch}, pages_per_seq], "
                         f"got {lengths.shape} and {page_indices.shape}")


def default_pages_per_block(page_size: int) -> int:
    """Enough pages for :data:`DEFAULT_BLOCK_TOKENS` keys per kernel step."""
    return max(1, DEFAULT_BLOCK_TOKENS // page_size)


def pallas_unfit(head_dim: int, page_size: int, pages_per_block: int | None) -> str | None:
    """Why the Pallas kernels cannot take these shapes (None: they can). Triton's ``dot`` wants
    every dimension a power of two and at least 16: with ``head_dim`` 8 (the tests' tiny Mistral
    and Mixtral) the kernel compiled for an H100 returned wrong attention, off by 7-12 % of the
    log-probabilities, where the CPU's interpret mode was right (2026-11-26, JAX 0.11.2)."""
    block_tokens = (pages_per_block or default_pages_per_block(page_size)) * page_size
    for name, n in [("page_size", page_size), ("head_dim", head_dim)]:
        if n & (n - 1):
            return f"the pallas backend wants {name} a power of two, got {n}"
    for name, n in [("head_dim", head_dim), ("pages_per_block x page_size", block_tokens)]:
        if n < MIN_GROUP_ROWS:
            return f"the pallas backend wants {name} >= {MIN_GROUP_ROWS} (Triton's dot), got {n}"
    return None


def native_or_reference(backend: str, num_heads: int, k_pages: jax.Array, asked: bool = False) -> str:
    """``backend`` as resolved by :func:`check_call`, but ``native`` only on a CPU where the C++
    kernel takes the call (:func:`hypertron.kernels.cpu_decode.fits`): the reference where ``auto``
    chose it, an error where it was asked for (``asked``)."""
    if backend != "native":
        return backend
    if jax.default_backend() == "cpu" and cpu_decode.fits(num_heads, k_pages.shape[3], k_pages):
        return backend
    if asked:
        raise ValueError(f"the native backend runs on a CPU with float32 or int8 pages, at most "
                         f"{cpu_decode.MAX_GROUP} query heads a KV head, head_dim <= {cpu_decode.MAX_HEAD_DIM} "
                         f"and pages of <= {cpu_decode.MAX_PAGE_SIZE} tokens"
                         + (f" (not built here: {cpu_decode.unavailable()})" if cpu_decode.unavailable() else ""))
    return "reference"


def check_call(backend: str, window, pages_per_block: int | None, interpret: bool | None,
               table: dict[str, str], head_dim: int, page_size: int) -> tuple[str, bool]:
    """The checks both attention functions make of their settings; the backend and interpret
    mode they resolve to: ``auto`` takes the reference where the table's Pallas kernel cannot
    take the shapes (:func:`pallas_unfit`), an explicit ``pallas`` is refused there."""
    if isinstance(window, (int, np.integer)) and window < 1:
        raise ValueError(f"window must be >= 1 (or None), got {window}")
    ppb = pages_per_block
    if ppb is not None and (ppb < 1 or ppb & (ppb - 1)):
        raise ValueError(f"pages_per_block must be a power of two, got {pages_per_block}")
    if backend not in BACKENDS:
        raise ValueError(f"ragged attention backend must be one of {BACKENDS}, got {backend!r}")
    unfit = pallas_unfit(head_dim, page_size, ppb)
    if backend == "auto":
        backend = auto_backend(table, "reference")
        backend = "reference" if backend == "pallas" and unfit else backend
    elif backend == "pallas" and unfit:
        raise ValueError(unfit)
    return backend, interpret_default(interpret)
