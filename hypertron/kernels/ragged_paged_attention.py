"""Ragged paged attention: any number of queries per row (decode rows, whole prompts, chunks
after cached tokens) over the paged KV cache, every row of a serving step in one call.

The cache layout, int8 pages and their scales, the window and the backends are those of
:mod:`hypertron.kernels.ragged_attention` (whose decode attention is the one-query case). Row ``r``
holds ``kv_lens[r]`` tokens; its queries ``q[query_start[r]:query_start[r + 1]]`` are the last
``n_r`` of them, in order, so query ``i`` is at position ``kv_lens[r] - n_r + i`` and attends to
the row's positions ``p`` with ``causal_window_mask(position, p, window)``.

Backends (``backend=``):

``"reference"``
    Plain JAX, the CPU path: every row's last query in one batch over the rows, the rest in
    blocks of one row's queries, a loop over just the blocks there are; each reads only its row's
    pages, a chunk at a time, from the first its window reaches to the one holding its last
    query, with an online softmax (:func:`ragged_paged_attention_reference`). A prefix the rows
    share (the prefix cache's pages) is read once for all of them first (cascade attention).
``"pallas"``
    A Pallas kernel for the Triton lowering: one program per ``(block of one row's queries, kv
    head)`` (:func:`query_tiles`; a grid of ``ceil(tokens / block_q) + rows`` blocks, the unused
    ones empty), the block's queries x the GQA group's heads as the rows of each dot, an online
    softmax over blocks of the row's pages from the one the first query's window starts in to the
    one holding the last query (dynamic bounds; slots outside clamped and masked as in the decode
    kernel). Queries are gathered into blocks before and scattered back after, so programs never
    write the same rows.
``"auto"``
    ``AUTO_BACKEND[jax.default_backend()]``: the kernel on GPUs, the reference elsewhere, but the
    rows' last queries by the decode attention's kernel where its table has one: on a GPU a
    decode-only step whole, on a CPU every step's last queries (:mod:`~hypertron.kernels.cpu_decode`).

Verified (CPU, JAX 0.10.2, ``tests/test_ragged_attention.py``): the reference against dense
attention in numpy on a mix of decode rows, new prompts, chunks after cached tokens, an empty row
and padding tokens (GQA 1, 2, 4; a window; float32 and int8 pages; every position no query may
read NaN, page-table slots outside a row's pages pointing at a page of NaN); the kernel in
interpret mode against the reference on the same mix; and that the kernel lowers to Triton IR for
a CUDA target. Not run on a GPU yet: its speed there, and ``PALLAS_BLOCK_ROWS``, are unmeasured.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from hypertron.kernels import cpu_decode
from hypertron.kernels.backends import auto_backend
from hypertron.kernels.ragged_attention import AUTO_BACKEND as DECODE_AUTO_BACKEND
from hypertron.kernels.ragged_attention import (
    MIN_GROUP_ROWS,
    CallConfig,
    call_per_kv_head,
    causal_window_mask,
    check_call,
    check_pages,
    gather_pages_by_head,
    online_softmax_block,
    pallas_layout,
    pallas_unfit,
    native_or_reference,
    ragged_decode_attention,
)

# ragged_paged_attention's reference, when block_q is not given: queries per block, and keys per
# step of its loop over a block's pages. Measured on this project's CPU (bench/chunk_attention.py,
# 512 queries after 1,024 tokens): 64 and 256 were fastest of 32-128 and 256-2,048 (larger steps
# miss the cache).
# A row whose queries fill larger blocks runs faster in them: 512 queries of one row after 1,536
# cached tokens, 21.4 ms a layer in blocks of 64, 12.4 in blocks of 256, 12.8 in 512; 8 rows of 64
# after 1,024, 16.1 ms in blocks of 64, 24.3 in 256 (2026-11-27): blocks follow the queries a row has.
DEFAULT_BLOCK_Q = 64
MAX_REFERENCE_BLOCK_Q = 256
REFERENCE_CHUNK_TOKENS = 256
# Queries of rows with several (prompts) read a prefix their rows share in blocks of this many
# of the step's tokens, whatever rows they are in, this many keys a product: of 64-256 tokens and
# 256-1,024 keys, 256 and 512 were fastest or near it for 1 to 8 rows of 64 to 512 queries after a
# shared 1,024 (2026-11-27, this project's CPU, 8 / 4 heads x 32): 1.4-1.9x the blocks of one row
# each for rows of 64-128 queries, the same for one row of 512.
EVERY_BLOCK_Q = 256
EVERY_SHARED_TOKENS = 512
# The decode batch (every row's last queries) reads its rows' own pages this many keys a step (a
# row reads to the end of the step holding its last key), and a prefix they share this many a
# product. The engine's decode step on the serving bench's model (4 layers, 8 / 4 heads x 32,
# float32; 2026-11-29, this project's CPU, engines with 256, 128 and 64 stepped in turn in one
# process, median of 40-80 steps; with V no longer masked, below): 16 rows of ~150 tokens 7.11 /
# 6.47 / 6.48 ms, of ~1,000 tokens 15.58 / 13.18 / 14.42, 4 rows 3.40 / 3.33 / 3.12, 64 rows
# 18.16 / 17.02 / 17.03. With V unmasked in all three, `bench/decode_chunks.py` finds the chunk
# size itself within the runs' spread (docs/benchmarks.md): the gain was the mask's. (Where the
# C++ decode kernel runs, a CPU's default, it reads the rows' pages itself.)
DECODE_CHUNK_TOKENS = 128
DECODE_SHARED_TOKENS = 1024
# The reference's products for at most this many queries a row and KV head (decode rows: the GQA
# group) are multiplies and sums; dots of so few rows were 1.7x slower on this project's CPU
# (2026-11-27: 64 decode rows of ~150 tokens, 8 / 4 heads x 32, one layer).
MULTIPLY_MAX_QUERIES = 8


def reference_block_q(queries_per_row: int | None) -> int:
    """The reference's queries per block for rows of about ``queries_per_row`` queries: the
    power of two that holds all but the row's last (which goes with the decode rows). Rows of
    65 queries (a 64-token chunk and its BOS, the HTTP bench's) fill blocks of 64, not half of
    128: 7 such rows after a shared 1,024, one layer, 8.0 against 9.8 ms (2026-11-27, this
    project's CPU, ``bench/chunk_attention.py --shared --block-q 64 128``)."""
    if queries_per_row is None:
        return DEFAULT_BLOCK_Q
    blocked = max(queries_per_row - 1, 1)
    return min(max(pl.next_power_of_2(blocked), DEFAULT_BLOCK_Q), MAX_REFERENCE_BLOCK_Q)


def block_chunk_tokens(block_q: int) -> int:
    """Keys a block of ``block_q`` queries of one row reads a step, from its row's pages: twice its
    queries, at most :data:`REFERENCE_CHUNK_TOKENS`. Blocks
    of 64 queries reading 128 keys a step, not 256 (2026-11-27, this project's CPU, one layer at the
    serving bench's heads, the two interleaved, fastest of 25 each): 7 new prompts of 65 tokens 1.7
    against 2.6 ms, 15 rows of 33 after a shared 1,024 13.7 against 16.6, 7 of 65 after it 11.4
    against 12.0, 8 rows of 64 after 1,024 of their own 13.9 against 13.7; an engine step of 7
    new prompts 24.2 against 28.5 ms. One row of 512 queries (blocks of 256) ran about 10 % slower
    reading 128, so larger blocks keep 256."""
    return min(REFERENCE_CHUNK_TOKENS, 2 * block_q)


# The reference's time per query-key pair in blocks of each size, relative to the fastest (256):
# one row of 512 queries after 0, 512 and 1,536 cached tokens, one layer at the serving bench's
# heads, fastest of 15 (2026-11-27, this project's 2-core CPU): 64: 1.64-1.89, 128: 1.55-1.71,
# 512: 1.05-1.20 (bench/chunk_attention.py --block-q).
REFERENCE_BLOCK_SLOWDOWN = {64: 1.8, 128: 1.6, 256: 1.0}


def pair_cost(queries_per_row: float, compiled_for: int) -> float:
    """What a query-key pair of rows of about ``queries_per_row`` queries costs, relative to the
    fastest, in a call whose ``queries_per_row`` was ``compiled_for``, with the ``auto`` backend:
    the reference pads each row to whole blocks (:func:`reference_block_q` of ``compiled_for``)
    and runs smaller blocks slower (:data:`REFERENCE_BLOCK_SLOWDOWN`); the Pallas kernel's blocks
    do not follow it (1.0), nor is the reference measured off a CPU (1.0 there too)."""
    if jax.default_backend() != "cpu" or auto_backend(AUTO_BACKEND, "reference") != "reference":
        return 1.0
    block, n = reference_block_q(compiled_for), max(queries_per_row - 1, 1.0)  # the last goes with the decodes
    return -(-n // block) * block / n * REFERENCE_BLOCK_SLOWDOWN.get(block, 1.0)


# The decode kernel's table is its own. GPU: 2026-11-26, one H200, JAX 0.11.2 (bench/gpu_campaign.py
# t2.paged, docs/benchmarks.md): one mixed step at llama-1b's heads (16 decode rows and a 2,048-token
# chunk, each at 4,096 tokens of context) took the kernel 0.69 ms with bf16 pages and 0.81 ms with
# int8, the reference 20.0 and 17.4 ms (29x and 21x), cuDNN's fused attention over pages gathered
# into dense K/V 0.88 and 0.69 ms; the kernel within 2.2e-3 of the reference in float32. ROCm untried.
AUTO_BACKEND = {"cpu": "reference", "gpu": "pallas", "cuda": "pallas", "rocm": "reference",
                "tpu": "reference"}
# The Pallas kernel's block when block_q is not given: this many rows of q (queries x the GQA
# group's heads, padded to a power of two). Untuned.
PALLAS_BLOCK_ROWS = 64


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           kv_lens: jax.Array, page_table: jax.Array, query_start: jax.Array, *,
                           k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                           sm_scale: float | None = None, window: int | jax.Array | None = None,
                           backend: str = "auto", block_q: int | None = None,
                           pages_per_block: int | None = None, interpret: bool | None = None,
                           decode_only: bool = False, queries_per_row: int | None = None,
                           decode_queries: int = 1) -> jax.Array:
    """Causal attention of the last queries of many rows over each row's pages of the KV cache.

    Row ``r``'s queries are ``q[query_start[r]:query_start[r + 1]]``, the last
    ``n_r = query_start[r + 1] - query_start[r]`` of its ``kv_lens[r]`` tokens (positions
    ``kv_lens[r] - n_r`` to ``kv_lens[r] - 1``, already in the cache): a decode row has one, a new
    prompt all of its tokens, a chunk after cached tokens the chunk's. Each query attends to its
    row's positions up to its own (inside ``window``: :func:`causal_window_mask`), reading keys
    through ``page_table[r]`` as :func:`ragged_decode_attention` does.

    Args:
      q: ``[tokens, num_heads, head_dim]``, the rows' queries back to back; tokens from
        ``query_start[-1]`` on are padding (output zeros).
      k_pages, v_pages, k_scales, v_scales, sm_scale, window, pages_per_block, interpret: as
        :func:`ragged_decode_attention`; values no query reads must be finite (the reference reads
        whole chunks past a row's end and weighs them 0; the engine's pool never holds a NaN value:
        :func:`~hypertron.models.kv_pages.write_tokens`).
      kv_lens: int ``[rows]``, tokens of each row once its queries are in (0: output zeros).
      page_table: int ``[rows, pages_per_seq]``.
      query_start: int ``[rows + 1]``, non-decreasing, from 0.
      backend: one of :data:`BACKENDS`.
      block_q: queries per block (static, a power of two); default (reference): the power of two
        of ``queries_per_row`` within :data:`DEFAULT_BLOCK_Q` and :data:`MAX_REFERENCE_BLOCK_Q`,
        else :data:`DEFAULT_BLOCK_Q`; :data:`PALLAS_BLOCK_ROWS` rows of q (pallas).
      queries_per_row: about how many queries a row with several has (static; the engine's
        prefill tokens over its prefill rows), for the reference's default block.
      decode_only: the caller's promise that no row has more than one query (static): the
        reference then builds no loop over blocks (a decode step compiles faster), and with
        ``backend="auto"`` where the decode kernel's own table picks Pallas (a GPU), the rows go
        to :func:`ragged_decode_attention`'s kernel (measured on an H100), not this one's
        reference.
      decode_queries: the reference attends each row's last ``decode_queries`` queries (static;
        speculative decoding's verify rows: a decode token and its proposal's) in the rows' one
        batch, each row's pages read once for all of them, and the rest in blocks; with
        ``decode_only`` no row has more. Above 1, the decode kernel is not used.

    Returns:
      ``[tokens, num_heads, head_dim]`` in ``q.dtype``; softmax and accumulation in float32.
    """
    check_pages(q, k_pages, v_pages, k_scales, v_scales)
    rows = kv_lens.shape[0]
    if kv_lens.ndim != 1 or page_table.shape[:1] != (rows,) or page_table.ndim != 2 \
            or query_start.shape != (rows + 1,):
        raise ValueError(f"kv_lens must be [rows], page_table [rows, pages_per_seq] and query_start "
                         f"[rows + 1], got {kv_lens.shape}, {page_table.shape} and "
                         f"{query_start.shape}")
    if block_q is not None and (block_q < 1 or block_q & (block_q - 1)):
        raise ValueError(f"block_q must be a power of two, got {block_q}")
    fits = pallas_unfit(q.shape[-1], k_pages.shape[2], pages_per_block) is None
    # The rows' last queries by the decode kernel's own table where it has one for this platform:
    # a decode-only step whole, else (the C++ kernel, a CPU) the reference's batch of last queries.
    decode_backend = auto_backend(DECODE_AUTO_BACKEND, "reference") if backend == "auto" else None
    decode_backend = native_or_reference(decode_backend, q.shape[1], k_pages) if decode_queries == 1 else None
    if decode_only and (decode_backend == "native" or decode_backend == "pallas" and fits):
        return _decode_rows(q, k_pages, v_pages, kv_lens, page_table, query_start, k_scales=k_scales,
                            v_scales=v_scales, sm_scale=sm_scale, window=window, backend=decode_backend,
                            pages_per_block=pages_per_block, interpret=interpret)
    backend, interpret = check_call(backend, window, pages_per_block, interpret, AUTO_BACKEND, q.shape[-1],
                                    k_pages.shape[2])
    sm_scale = float(q.shape[-1] ** -0.5 if sm_scale is None else sm_scale)
    cfg = CallConfig(backend, sm_scale, pages_per_block, interpret)
    capacity = page_table.shape[1] * k_pages.shape[2]
    window = jnp.asarray(capacity if window is None else window, jnp.int32)
    if block_q is None:
        group = pl.next_power_of_2(q.shape[1] // k_pages.shape[0])
        block_q = reference_block_q(queries_per_row) if backend == "reference" else \
            max(1, PALLAS_BLOCK_ROWS // group)
    return _paged_jit(q, k_pages, v_pages, kv_lens, page_table, query_start, k_scales, v_scales,
                      window, cfg, block_q, decode_only, decode_queries, decode_backend == "native")


def _decode_rows(q, k_pages, v_pages, kv_lens, page_table, query_start, **kw) -> jax.Array:
    """A decode-only call through a decode kernel (``backend`` in ``kw``): each row's one query
    (a row without one reads as length 0: zeros), scattered back to its token; padding tokens stay
    zeros."""
    n = q.shape[0]
    has = query_start[1:] > query_start[:-1]
    last = jnp.where(has, query_start[1:] - 1, n)
    out = ragged_decode_attention(q[jnp.minimum(last, n - 1)], k_pages, v_pages,
                                  jnp.where(has, kv_lens, 0), page_table, **kw)
    return jnp.zeros_like(q).at[last].set(out, mode="drop")


def ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, page_table, query_start, *,
                                     k_scales=None, v_scales=None, sm_scale=None, window=None,
                                     block_q: int = DEFAULT_BLOCK_Q, decode_only: bool = False,
                                     decode_queries: int = 1, native_last: bool = False) -> jax.Array:
    """:func:`ragged_paged_attention` in plain JAX (arguments as there, ``block_q`` static).

    Every row's last ``decode_queries`` queries (a decode row's only one, or with a verify row's
    proposal all of its) attend in one batch over the rows; the
    others in blocks of up to ``block_q`` queries of one row (:func:`query_tiles`), a loop over
    just the blocks there are (a dynamic trip count). Each reads its row's pages,
    :data:`DECODE_CHUNK_TOKENS` (the batch) or :func:`block_chunk_tokens` (a block) at a time, from
    the first its first query's window reaches to the one holding its last query, with an online
    softmax in float32: the cost follows the
    queries and their context, not rows x queries nor the page table's width. Where the rows
    share a prefix (the same pages from the start), both parts read it once for all their rows
    first (:func:`_attend_pages`' ``shared``; :func:`_shared_prefix_first`), and each block goes on
    from there. ``native_last`` (static): the rows' last queries by the C++ kernel (:func:`_last_queries`).
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group, capacity = num_heads // num_kv_heads, page_table.shape[1] * page_size
    ppc = max(1, DECODE_CHUNK_TOKENS // page_size)  # pages per chunk: the rows' last queries
    ppc_block = max(1, block_chunk_tokens(block_q) // page_size)  # and the blocks of the others
    chunks = functools.partial(
        _Chunks, k_pages=k_pages, v_pages=v_pages, k_scales=k_scales, v_scales=v_scales,
        sm_scale=head_dim ** -0.5 if sm_scale is None else sm_scale,
        window=capacity if window is None else window)
    kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, capacity)
    query_start = query_start.astype(jnp.int32)
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, -page_table.shape[1] % max(ppc, ppc_block))))
    q_pad = jnp.pad(q.astype(jnp.float32).reshape(n, num_kv_heads, group, head_dim),
                    ((0, block_q), (0, 0), (0, 0), (0, 0)))

    def rows_m(x_qkgd):  # [q, k, g, d] -> [k, q * g, d]: row m is query m // g
        return x_qkgd.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)

    native = None if not native_last else functools.partial(
        cpu_decode.paged_decode, k_pages=k_pages, v_pages=v_pages, page_indices=page_table,
        window=jnp.asarray(capacity if window is None else window, jnp.int32), k_scales=k_scales,
        v_scales=v_scales, sm_scale=head_dim ** -0.5 if sm_scale is None else sm_scale)
    out_last, last_r = _last_queries(q, q_pad, kv_lens, table, query_start, functools.partial(chunks, ppc=ppc),
                                     rows_m, decode_queries, native)
    if decode_only:
        out = jnp.zeros((n, num_kv_heads, group, head_dim), jnp.float32)
        return out.at[last_r].set(out_last, mode="drop").reshape(q.shape).astype(q.dtype)

    # The others: first all at once over a prefix their rows share, then blocks of one row's
    # queries, each from there over its row's own pages.
    chunks = functools.partial(chunks, ppc=ppc_block)
    carry, start = _shared_prefix_first(q_pad[:n], kv_lens, table, query_start, chunks, block_q=block_q,
                                        page_size=page_size, ppc=ppc_block, batched=decode_queries)
    rows_t, first_t, count_t, total = query_tiles(query_start, n, block_q, skip_last=decode_queries)
    out = jnp.zeros((n + block_q, num_kv_heads, group, head_dim), jnp.float32)

    def block(t, out):
        r, first, count = rows_t[t], first_t[t], count_t[t]
        pos_q = kv_lens[r] - (query_start[r + 1] - first) + jnp.arange(block_q, dtype=jnp.int32)
        pos_q = jnp.where(jnp.arange(block_q) < count, pos_q, -1)  # -1: not this block's
        mine = chunks(rows_m(lax.dynamic_slice_in_dim(q_pad, first, block_q))[None],
                      jnp.repeat(pos_q, group)[None])
        carry_t = jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, first * group, block_q * group, axis=2),
                               carry)
        got_kmd = mine.result(mine.own(carry_t, table[r][None], jnp.maximum(mine.lo, start)))[0]
        got = got_kmd.reshape(num_kv_heads, block_q, group, head_dim).transpose(1, 0, 2, 3)
        keep = (jnp.arange(block_q) < count)[:, None, None, None]
        old = lax.dynamic_slice_in_dim(out, first, block_q)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(keep, got, old), first, 0)

    out = lax.fori_loop(0, total, block, out)[:n]
    out = out.at[last_r].set(out_last, mode="drop")
    return out.reshape(n, num_heads, head_dim).astype(q.dtype)


def _last_queries(q, q_pad, kv_lens, table, query_start, chunks, rows_m, last_q: int, native=None):
    """Every row's last ``last_q`` queries (a decode row's only one) in one batch over the rows:
    ``[rows * last_q, kv_heads, group, head_dim]`` float32 and their tokens (``n``: none). By
    :func:`_attend_pages`, or with ``native`` (``last_q`` 1; ``cpu_decode.paged_decode`` but for the
    queries and lengths) by the C++ kernel; a prefix the rows share is read once either way."""
    n, (rows,), (_, num_kv_heads, group, head_dim) = q.shape[0], kv_lens.shape, q_pad.shape
    n_r = query_start[1:] - query_start[:-1]
    idx_rq = query_start[1:, None] - last_q + jnp.arange(last_q, dtype=jnp.int32)
    own_rq = (idx_rq >= query_start[:-1, None]) & (n_r[:, None] > 0)
    idx_rq = jnp.where(own_rq, idx_rq, n)
    if native is not None:
        out = native(q[jnp.minimum(idx_rq[:, 0], n - 1)], lengths=jnp.where(own_rq[:, 0], kv_lens, 0))
        return out.astype(jnp.float32).reshape(rows, num_kv_heads, group, head_dim), idx_rq[:, 0]
    pos_rm = jnp.repeat(jnp.where(own_rq, kv_lens[:, None] - (query_start[1:, None] - idx_rq), -1), group, axis=1)
    out = _attend_pages(chunks(jax.vmap(rows_m)(q_pad[idx_rq]), pos_rm), table, shared=True)
    out = out.reshape(rows, num_kv_heads, last_q, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(-1, num_kv_heads, group, head_dim), idx_rq.reshape(-1)


def _shared_prefix_first(q_nkgd, kv_lens, table, query_start, chunks, *, block_q: int, page_size: int, ppc: int,
                         batched: int = 1):
    """Every query but its row's last ``batched`` (rows of more queries: prompts) over the whole chunks of
    a prefix all those rows share (:func:`shared_prefix`; with prefix caching, a system prompt),
    read once for the step in blocks of :data:`EVERY_BLOCK_Q` of the step's tokens, whatever
    rows they are in (cascade attention: rows of few queries each would read the prefix once a
    row, in small products). Returns the online softmax's state for each token (``[kv_heads, 1,
    tokens * group, ...]``, token-major, padded so that a block of ``block_q`` slices it
    anywhere) and the chunk each row goes on from."""
    n, num_kv_heads, group, head_dim = q_nkgd.shape
    n_r = query_start[1:] - query_start[:-1]
    every_q = min(EVERY_BLOCK_Q, n)
    size = n + max(every_q, block_q)  # a block of either size fits from any token on
    token = jnp.arange(size, dtype=jnp.int32)
    row_n = jnp.minimum(jnp.searchsorted(query_start[1:], token, side="right", method="compare_all"),
                        n_r.shape[0] - 1)
    ahead_n = query_start[row_n + 1] - token  # 1: the row's last query; under 1: padding
    pos_n = jnp.where(ahead_n > batched, kv_lens[row_n] - ahead_n, -1)
    q_every = jnp.pad(q_nkgd, ((0, size - n), (0, 0), (0, 0), (0, 0)))
    shared, first_row = shared_prefix(table, n_r > batched, kv_lens - n_r, page_size)
    per_product = max(1, EVERY_SHARED_TOKENS // (ppc * page_size))  # chunks
    # Blocks from the first token with a query here to the last (the decode rows' tokens before
    # them, and padding after, are left out).
    some = jnp.where(pos_n >= 0, token, -1)
    first = jnp.min(jnp.where(some >= 0, some, n))
    blocks = jnp.where(shared > 0, jnp.maximum(jnp.max(some) - first, -1) // every_q + 1, 0)

    def block(i, carry):
        at = first + i * every_q
        x_qkgd = lax.dynamic_slice_in_dim(q_every, at, every_q)
        c = chunks(x_qkgd.transpose(1, 0, 2, 3).reshape(1, num_kv_heads, -1, head_dim),
                   jnp.repeat(lax.dynamic_slice_in_dim(pos_n, at, every_q), group)[None])
        got, _ = c.shared(c.init(), table[first_row], shared, per_product, rest=False)
        return jax.tree.map(lambda a, x: lax.dynamic_update_slice_in_dim(a, x, at * group, axis=2), carry, got)

    init = _Chunks.empty(num_kv_heads, 1, size * group, head_dim)
    read = shared // (per_product * ppc * page_size) * per_product  # the chunks read here
    return lax.fori_loop(0, blocks, block, init), read


def _attend_pages(chunks: _Chunks, table_rp, *, shared: bool = False):
    """Each row's queries of ``chunks`` over its row's pages ``table_rp``, from the first chunk a
    first query's window starts in to the last holding a query: ``[rows, kv_heads, m, d]``
    float32 (zeros for a query with no key).

    ``shared`` (static): the whole chunks every live row's table holds alike from its start, and
    every live row has filled (a prefix the prefix cache shares), are read once for all the rows:
    one gather and one product of all the rows' queries a chunk (cascade attention), then each
    row's own chunks after them. Rows that share nothing cost one comparison of the tables."""
    carry, lo = chunks.init(), chunks.lo
    if shared:  # a row is live by any real query (a verify row's first places may be padding), from its first
        live = jnp.any(chunks.pos >= 0, axis=1)
        first_pos = jnp.min(jnp.where(chunks.pos >= 0, chunks.pos, 2 ** 30), axis=1)
        tokens, first = shared_prefix(table_rp, live, first_pos, chunks.page_size)
        carry, start = chunks.shared(carry, table_rp[first], tokens, max(1, DECODE_SHARED_TOKENS // chunks.chunk_tokens))
        lo = jnp.maximum(lo, start)
    return chunks.result(chunks.own(carry, table_rp, lo))


class _Chunks:
    """Queries ``[rows, kv_heads, m, d]`` at positions ``pos_rm`` (-1: none) reading pages a chunk
    of ``ppc`` pages at a time, with an online softmax in float32 whose state (``carry``: running
    max, sum and output) goes from one read to the next: the reference's inner loop.

    Inside, KV heads lead (``[kv_heads, rows, ...]``, the order the pages gather into). A few
    queries a row (``m <= MULTIPLY_MAX_QUERIES``: decode rows) take their products as multiplies
    and sums on a CPU, not as dots of so few rows (64 decode rows' attention 1.7x faster there)."""

    def __init__(self, q_rkmd, pos_rm, *, k_pages, v_pages, k_scales, v_scales, sm_scale, window, ppc):
        self.q, self.pos = q_rkmd.transpose(1, 0, 2, 3), pos_rm
        self.kv = ((k_pages, k_scales), (v_pages, v_scales))
        self.sm_scale, self.window, self.ppc = sm_scale, window, ppc
        self.page_size = k_pages.shape[2]
        self.chunk_tokens = ppc * self.page_size
        # The first chunk a query's window reaches, and the chunk after the last holding a query
        # (lo > hi when no query is real).
        self.lo = jnp.min(jnp.where(pos_rm >= 0, jnp.maximum(pos_rm - window + 1, 0), 2 ** 30)) // self.chunk_tokens
        self.hi = jnp.max(pos_rm) // self.chunk_tokens + 1
        self.few = self.q.shape[2] <= MULTIPLY_MAX_QUERIES and jax.default_backend() == "cpu"  # measured there only

    def init(self):
        """The state before any chunk: no key seen."""
        return self.empty(*self.q.shape)

    @staticmethod
    def empty(kv_heads: int, rows: int, m: int, head_dim: int):
        """An online softmax's state before any key, for ``[kv_heads, rows, m]`` queries."""
        return (jnp.full((kv_heads, rows, m), -jnp.inf), jnp.zeros((kv_heads, rows, m)),
                jnp.zeros((kv_heads, rows, m, head_dim)))

    def result(self, carry):
        """``[rows, kv_heads, m, d]``: what the chunks read so far gave."""
        _, l_krm, acc_krmd = carry
        return (acc_krmd / jnp.where(l_krm > 0, l_krm, 1.0)[..., None]).transpose(1, 0, 2, 3)

    def own(self, carry, table_rp, lo):
        """``carry`` on over each row's own pages ``table_rp``, the chunks from ``lo`` on."""
        def step(c, carry):
            pages_rp = lax.dynamic_slice_in_dim(table_rp, c * self.ppc, self.ppc, axis=1)
            k_krtd, v_krtd = (gather_pages_by_head(x, s, pages_rp) for x, s in self.kv)
            valid_rmt = self._valid(c, self.chunk_tokens)  # (keys no query reads: stale, never NaN)
            return self._update(carry, jnp.where(valid_rmt[None], self._scores(k_krtd), -jnp.inf), v_krtd)

        return lax.fori_loop(lo, self.hi, step, carry)

    def shared(self, carry, table_p, tokens, per_step: int, rest: bool = True):
        """``carry`` on over the whole chunks of the first ``tokens`` of ``table_p``, pages every
        row reads alike (:func:`shared_prefix`): each chunk gathered once for all the rows,
        ``per_step`` of them a product while there are so many (a step's cost on a CPU is mostly
        fixed, and one product serves every row), then one at a time (``rest=False``: not, one
        loop less to compile; the rows' own loops read them). Returns the carry and the chunk
        after those read."""
        table_1p = jnp.pad(table_p[None], ((0, 0), (0, -table_p.shape[0] % (per_step * self.ppc))))

        def step(c, carry, n=1):  # chunk c of n of the rows' chunks
            pages_1p = lax.dynamic_slice_in_dim(table_1p, c * n * self.ppc, n * self.ppc, axis=1)
            k_ktd, v_ktd = (gather_pages_by_head(x, s, pages_1p)[:, 0] for x, s in self.kv)
            valid_rmt = self._valid(c, n * self.chunk_tokens)
            return self._update(carry, jnp.where(valid_rmt[None], self._scores(k_ktd), -jnp.inf), v_ktd)

        big_hi = tokens // (per_step * self.chunk_tokens)
        carry = lax.fori_loop(jnp.minimum(self.lo // per_step, big_hi), big_hi,
                              functools.partial(step, n=per_step), carry)
        if not rest:
            return carry, big_hi * per_step
        end = tokens // self.chunk_tokens
        return lax.fori_loop(jnp.clip(self.lo, big_hi * per_step, end), end, step, carry), end

    def _scores(self, k_rtd):  # [k, r, t, d] (or [k, t, d]: one set of keys for every row) -> [k, r, m, t]
        hi = lax.Precision.HIGHEST
        if k_rtd.ndim == 3:
            return jnp.einsum("krmd,ktd->krmt", self.q, k_rtd, precision=hi) * self.sm_scale
        if self.few:
            return jnp.sum(self.q[:, :, :, None, :] * k_rtd[:, :, None], axis=-1) * self.sm_scale
        return jnp.einsum("krmd,krtd->krmt", self.q, k_rtd, precision=hi) * self.sm_scale

    def _update(self, carry, s_krmt, v_rtd):  # the online softmax over one chunk's scores
        m_krm, l_krm, acc_krmd = carry
        m_new = jnp.maximum(m_krm, jnp.max(s_krmt, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a query with no key yet
        alpha = jnp.exp(m_krm - m_safe)
        p_krmt = jnp.exp(s_krmt - m_safe[..., None])
        hi = lax.Precision.HIGHEST
        if v_rtd.ndim == 3:
            pv = jnp.einsum("krmt,ktd->krmd", p_krmt, v_rtd, precision=hi)
        elif self.few:
            pv = jnp.sum(p_krmt[..., None] * v_rtd[:, :, None], axis=-2)
        else:
            pv = jnp.einsum("krmt,krtd->krmd", p_krmt, v_rtd, precision=hi)
        return m_new, alpha * l_krm + jnp.sum(p_krmt, axis=-1), alpha[..., None] * acc_krmd + pv

    def _valid(self, c, chunk_tokens):  # [r, m, t]: the pairs of chunk c (of chunk_tokens) that attend
        pos_t = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)
        return (causal_window_mask(self.pos[:, :, None], pos_t[None, None, :], self.window)
                & (self.pos >= 0)[:, :, None])


def shared_prefix(table_rp, live_r, first_pos_r, page_size: int):
    """``(tokens, row)``: how many tokens from the start every live row's table holds in the same
    pages and every live row has in its cache (its first query's position and before; 0 when no
    row is live), and a live row."""
    first = jnp.argmax(live_r)
    same_p = jnp.all((table_rp == table_rp[first]) | ~live_r[:, None], axis=0)
    filled = jnp.min(jnp.where(live_r, first_pos_r + 1, 2 ** 30))
    shared = jnp.minimum(jnp.sum(jnp.cumprod(same_p.astype(jnp.int32))) * page_size, filled)
    return jnp.where(jnp.any(live_r), shared, 0), first


def query_tiles(query_start: jax.Array, num_tokens: int, block_q: int, skip_last: int = 0):
    """Blocks of up to ``block_q`` queries of one row each: ``(row, first, count) [T]`` and how
    many there are (the rest have count 0), with ``T = ceil(num_tokens / block_q) + rows`` (a
    bound: each row's last block may be short). ``skip_last``: leave each row's last this many
    queries out."""
    rows = query_start.shape[0] - 1
    n_r = query_start[1:] - query_start[:-1]
    if skip_last:
        n_r = jnp.maximum(n_r - skip_last, 0)
    blocks_r = -(-n_r // block_q)
    ends_r = jnp.cumsum(blocks_r)
    t = jnp.arange(-(-num_tokens // block_q) + rows, dtype=jnp.int32)
    row_t = jnp.minimum(jnp.searchsorted(ends_r, t, side="right", method="compare_all"), rows - 1).astype(jnp.int32)
    j_t = t - ends_r[row_t] + blocks_r[row_t]
    count_t = jnp.where(t < ends_r[-1], jnp.clip(n_r[row_t] - j_t * block_q, 0, block_q), 0)
    return row_t, query_start[row_t] + j_t * block_q, count_t, ends_r[-1]


@functools.partial(jax.jit, static_argnums=(9, 10, 11, 12, 13))
def _paged_jit(q, k_pages, v_pages, kv_lens, page_table, query_start, k_scales, v_scales, window,
               cfg: CallConfig, block_q: int, decode_only: bool, decode_queries: int, native_last: bool):
    if cfg.backend == "reference":
        return ragged_paged_attention_reference(
            q, k_pages, v_pages, kv_lens, page_table, query_start, k_scales=k_scales,
            v_scales=v_scales, sm_scale=cfg.sm_scale, window=window, block_q=block_q,
            decode_only=decode_only, decode_queries=decode_queries, native_last=native_last)
    return _pallas_paged(q, k_pages, v_pages, kv_lens, page_table, query_start, k_scales,
                         v_scales, window, cfg, block_q)


def _paged_kernel(row_ref, pos0_ref, count_ref, window_ref, table_ref, q_ref, k_ref, v_ref, *rest,
                  page_size: int, pages_per_block: int, sm_scale: float, quantized: bool,
                  group_rows: int):
    """One ``(tile t, kv head h)``: a block of one row's queries (``group_rows`` rows of ``q`` per
    query), online softmax over blocks of the row's pages from the first query's window to the
    last query."""
    ks_ref, vs_ref, out_ref = rest if quantized else (None, None, rest[0])
    t, h = pl.program_id(0), pl.program_id(1)
    r, pos0, count, window = row_ref[t], pos0_ref[t], count_ref[t], window_ref[0]
    block_tokens = pages_per_block * page_size
    q = q_ref[...]  # [M, d]
    rows_m, head_dim = q.shape
    qi = lax.div(jnp.arange(rows_m, dtype=jnp.int32), group_rows)  # the query of each row
    pos_q, q_valid = pos0 + qi, qi < count
    last = pos0 + count - 1
    start = jnp.maximum(pos0 - window + 1, 0)
    first_page = lax.div(start, page_size)
    last_page = lax.div(jnp.maximum(last, 0), page_size)
    first_block = lax.div(first_page, pages_per_block)
    end_block = jnp.where(count > 0, lax.div(last_page, pages_per_block) + 1, first_block)

    def block(i, carry):  # carry: [M], [M], [M, d] float32
        slots = i * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
        pages = table_ref[r, jnp.clip(slots, first_page, last_page)]  # [ppb]
        pos = i * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
        valid = (q_valid[:, None] & (pos[None, :] <= pos_q[:, None])
                 & (pos_q[:, None] - pos[None, :] < window))
        key_valid = (pos >= start) & (pos <= last)  # written: finite; others may be NaN
        return online_softmax_block(carry, q, h, pages, valid, key_valid, k_ref, v_ref, ks_ref, vs_ref,
                                    sm_scale=sm_scale)

    init = (jnp.full((rows_m,), -jnp.inf, jnp.float32), jnp.zeros((rows_m,), jnp.float32),
            jnp.zeros((rows_m, head_dim), jnp.float32))
    _, l, acc = lax.fori_loop(first_block, end_block, block, init)
    out_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(out_ref.dtype)


def _pallas_paged(q, k_pages, v_pages, kv_lens, page_table, query_start, k_scales, v_scales,
                  window, cfg: CallConfig, block_q: int):
    n = q.shape[0]
    num_heads, head_dim, num_kv_heads, page_size, group, ppb, quantized, compute = pallas_layout(
        q, k_pages, k_scales, cfg)
    # A tile's rows: block_q queries x gp heads, at least MIN_GROUP_ROWS (Triton's dot).
    gp = max(pl.next_power_of_2(group), -(-MIN_GROUP_ROWS // block_q))
    kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, page_table.shape[1] * page_size)
    query_start = query_start.astype(jnp.int32)
    row_t, first_t, count_t, _ = query_tiles(query_start, n, block_q)
    pos0_t = kv_lens[row_t] - (query_start[row_t + 1] - first_t)
    idx_tq = first_t[:, None] + jnp.arange(block_q, dtype=jnp.int32)
    idx_tq = jnp.where(jnp.arange(block_q) < count_t[:, None], idx_tq, n)  # n: none (dropped)
    q_nkgd = q.astype(compute).reshape(n, num_kv_heads, group, head_dim)
    q_nkgd = jnp.pad(q_nkgd, ((0, 0), (0, 0), (0, gp - group), (0, 0)))  # zero rows: sliced off
    q_tqkgd = q_nkgd.at[idx_tq].get(mode="fill", fill_value=0)
    tiles, rows_m = idx_tq.shape[0], block_q * gp
    q_tkmd = q_tqkgd.transpose(0, 2, 1, 3, 4).reshape(tiles, num_kv_heads, rows_m, head_dim)
    operands = [row_t, pos0_t, count_t, window.reshape(1), page_table.astype(jnp.int32), q_tkmd,
                k_pages, v_pages] + ([k_scales, v_scales] if quantized else [])
    kernel = functools.partial(_paged_kernel, page_size=page_size, pages_per_block=ppb,
                               sm_scale=cfg.sm_scale, quantized=quantized, group_rows=gp)
    out = call_per_kv_head(kernel, operands, 5, (tiles, num_kv_heads, rows_m, head_dim), q.dtype, cfg,
                           "ragged_paged_attention")
    out_tqkgd = out.reshape(tiles, num_kv_heads, block_q, gp, head_dim).transpose(0, 2, 1, 3, 4)
    out_nkgd = jnp.zeros((n, num_kv_heads, group, head_dim), q.dtype)
    out_nkgd = out_nkgd.at[idx_tq].set(out_tqkgd[..., :group, :], mode="drop")
    return out_nkgd.reshape(n, num_heads, head_dim)
