"""Ragged paged attention, decode (one query a sequence) and ragged (any number a row): each kernel
against its reference, each reference against dense attention in numpy, int8 quantisation of the
cache, and the kernels' Triton lowering.

The Pallas kernel runs in interpret mode (the default on CPU). Every case is built from dense
per-sequence K/V ``[batch, kv_heads, capacity, head_dim]`` scattered into pages through a
permuted page table, with poison where nothing may be read: positions outside
``[length - window, length)`` hold NaN (NaN scales for int8 pages), and page-table slots before
the window's first page or past the last page point at a page of NaN. Lengths include 1, a full
page, a page + 1, several pages, the whole capacity and 0 (an empty slot: zeros, finite).

Tolerances (relative to the largest reference value): float32 pages 1e-5; bfloat16 pages, or
int8 pages with a bfloat16 query, 2e-2 (the kernel rounds the probabilities to bf16 for the PV dot,
and the output is bf16).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.kernels import cpu_decode
from hypertron.kernels import ragged_attention as ra
from hypertron.kernels.ragged_attention import (
    quantize_kv,
    ragged_decode_attention,
    ragged_decode_attention_reference,
)
from hypertron.kernels import ragged_paged_attention as rpa
from hypertron.kernels.ragged_paged_attention import ragged_paged_attention

# The GPU campaign's T1 runs these compiled for the GPU; the oracles multiply in exact float32
# (numpy, and the reference at highest precision), so the kernels are asked to as well (conftest.float32_matmuls).
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("float32_matmuls")]

S, D, P, H = 16, 16, 5, 4  # page_size, head_dim, pages per sequence, query heads
CAP = S * P
# one token, a full page, an empty slot, a page + 1, several pages, the whole capacity
LENGTHS = np.array([1, S, 0, S + 1, 3 * S + 5, CAP], np.int32)
WINDOW = 20  # more than a page: the window's first page is partly masked
_reference = jax.jit(ragged_decode_attention_reference, static_argnames="window")


def _case(seed, kv_heads, q_dtype, page_dtype, lengths, window=None):
    """Inputs of one call (dict of arrays) and the dense float32 ``(q, k, v)`` they came from."""
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    q = rng.standard_normal((batch, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((batch, kv_heads, CAP, D)).astype(np.float32) for _ in "kv")
    start = np.maximum(lengths - (CAP if window is None else window), 0)
    valid = (np.arange(CAP) >= start[:, None]) & (np.arange(CAP) < lengths[:, None])  # [b, t]
    mask = valid[:, None, :, None]
    home = rng.permutation(batch * P).reshape(batch, P)  # the page of each slot's rows
    poison = batch * P  # one more page, all NaN (int8: NaN scales)

    def paged(x_bkt, fill):  # [b, k, t(, d)] -> [k, pages + 1, S(, d)]; slot (b, j) -> home[b, j]
        x_kbpsd = x_bkt.reshape(batch, kv_heads, P, S, *x_bkt.shape[3:]).swapaxes(0, 1)
        pages = np.full((kv_heads, poison + 1, S, *x_bkt.shape[3:]), fill, x_bkt.dtype)
        pages[:, home.ravel()] = x_kbpsd.reshape(kv_heads, batch * P, S, *x_bkt.shape[3:])
        return pages

    args = {"q": jnp.asarray(q, q_dtype), "lengths": jnp.asarray(lengths)}
    if page_dtype == "int8":
        dense = []
        for name, x in [("k", k), ("v", v)]:
            values, scales = (np.asarray(a, np.float32)
                              for a in quantize_kv(jnp.asarray(x), jnp.dtype(q_dtype)))
            dense.append(np.where(mask, values * scales[..., None], np.nan))
            args[f"{name}_pages"] = jnp.asarray(paged(values, 0), jnp.int8)
            scales = np.where(valid[:, None], scales, np.nan)
            args[f"{name}_scales"] = jnp.asarray(paged(scales, np.nan), q_dtype)
        k, v = dense
    else:
        k, v = (np.asarray(jnp.asarray(np.where(mask, x, np.nan), page_dtype), np.float32)
                for x in (k, v))
        args["k_pages"], args["v_pages"] = (jnp.asarray(paged(x, np.nan), page_dtype)
                                            for x in (k, v))
    slot = np.arange(P)
    outside = ((slot < (start // S)[:, None]) | (slot > ((lengths - 1) // S)[:, None])
               | (lengths == 0)[:, None])  # before the window's first page, past the last
    args["page_indices"] = jnp.asarray(np.where(outside, poison, home), jnp.int32)
    return args, (np.asarray(args["q"], np.float32), k, v)


def _dense_attention(q, k, v, lengths, window=None):
    """The definition, one sequence and head at a time over contiguous K/V, in float64."""
    num_heads = q.shape[1]
    group = num_heads // k.shape[1]
    out = np.zeros(q.shape)  # an empty sequence stays 0
    for b, n in enumerate(lengths):
        lo = max(n - (CAP if window is None else window), 0)
        for h in range(num_heads if n else 0):
            kk, vv = k[b, h // group, lo:n].astype(np.float64), v[b, h // group, lo:n]
            s = kk @ q[b, h] * D ** -0.5
            p = np.exp(s - s.max())
            out[b, h] = p @ vv / p.sum()
    return out


def _assert_close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape and np.isfinite(got).all()
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


def _lengths(seed):
    """LENGTHS, and a second random set (with an empty slot) of the same batch size."""
    rng = np.random.default_rng(seed)
    return [LENGTHS, np.append(rng.integers(1, CAP + 1, len(LENGTHS) - 1), 0).astype(np.int32)]


# (query dtype, page dtype, kv heads (GQA ratio 4 / kv_heads), pages per block, tolerance)
CASES = [
    ("float32", "float32", 4, 1, 1e-5),
    ("float32", "float32", 2, 2, 1e-5),
    ("float32", "float32", 1, 4, 1e-5),
    ("bfloat16", "bfloat16", 2, 2, 2e-2),
    ("float32", "int8", 2, None, 1e-5),  # default block: 8 pages, more than a sequence has
    ("bfloat16", "int8", 1, 2, 2e-2),
]


@pytest.mark.parametrize("q_dtype,page_dtype,kv_heads,ppb,tol", CASES)
def test_kernel_matches_reference(q_dtype, page_dtype, kv_heads, ppb, tol):
    compiled = ra._attention_jit._cache_size()
    for seed, lengths in enumerate(_lengths(kv_heads)):
        for window in (None, WINDOW):
            args, _ = _case(seed, kv_heads, q_dtype, page_dtype, lengths, window)
            got = ragged_decode_attention(**args, window=window, backend="pallas",
                                          pages_per_block=ppb)
            want = ragged_decode_attention(**args, window=window, backend="reference")
            assert got.dtype == jnp.dtype(q_dtype)
            _assert_close(got, want, tol)
            assert not np.asarray(got, np.float32)[lengths == 0].any()  # empty slot: zeros
    # lengths, page tables and windows are data: one compiled function per backend for all
    assert ra._attention_jit._cache_size() - compiled <= 2


@pytest.mark.parametrize("page_dtype", ["float32", "int8"])
@pytest.mark.parametrize("window", [None, WINDOW])
def test_reference_is_dense_attention(page_dtype, window):
    for kv_heads in (4, 1):
        args, (q, k, v) = _case(7, kv_heads, "float32", page_dtype, LENGTHS, window)
        got = _reference(**args, window=window)
        _assert_close(got, _dense_attention(q, k, v, LENGTHS, window), 1e-5)
    assert ra.AUTO_BACKEND["cpu"] == "native"


needs_native = pytest.mark.skipif(cpu_decode.unavailable() is not None,
                                  reason=f"the C++ decode kernel: {cpu_decode.unavailable()}")


@needs_native
@pytest.mark.parametrize("page_dtype", ["float32", "int8"])
def test_native_kernel_is_dense_attention(page_dtype):
    """The C++ kernel (``native``, the CPU's ``auto``) against dense attention in numpy: GQA 1, 2
    and 4, with and without a window, both sets of lengths (an empty slot: zeros), pages of NaN
    wherever nothing may be read; int8 pages with bfloat16 scales (the engine's) beside a float32
    query. Shapes it cannot take go to the reference under ``auto`` and are refused when asked."""
    for kv_heads in (4, 2, 1):
        for seed, lengths in enumerate(_lengths(kv_heads)):
            for window in (None, WINDOW):
                args, (q, k, v) = _case(seed, kv_heads, "bfloat16" if page_dtype == "int8" else "float32",
                                        page_dtype, lengths, window)
                args["q"] = args["q"].astype(jnp.float32)  # bf16 scales, a float32 query
                got = ragged_decode_attention(**args, window=window, backend="native")
                _assert_close(got, _dense_attention(q, k, v, lengths, window), 1e-5)
                np.testing.assert_array_equal(ragged_decode_attention(**args, window=window), got)  # auto
                assert not np.asarray(got)[lengths == 0].any()
    args, _ = _case(0, 2, "bfloat16", "bfloat16", LENGTHS)
    jaxpr = str(jax.make_jaxpr(lambda a: ragged_decode_attention(**a))(args))
    assert cpu_decode.TARGET not in jaxpr  # bfloat16 pages: the reference
    with pytest.raises(ValueError, match="native backend runs on a CPU with float32 or int8 pages"):
        ragged_decode_attention(**args, backend="native")


@pytest.mark.parametrize("scale_dtype,bound", [("float32", 0.5 + 1e-5), ("bfloat16", 0.51)])
def test_quantize_kv_round_trip(scale_dtype, bound):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 64)) * np.exp(rng.uniform(-6, 6, (3, 5, 1)))
    x[1, 2] = 0.0  # a zero vector
    values, scales = quantize_kv(jnp.asarray(x, jnp.float32), jnp.dtype(scale_dtype))
    assert values.dtype == jnp.int8 and values.shape == x.shape
    assert scales.dtype == jnp.dtype(scale_dtype) and scales.shape == x.shape[:-1]
    back = np.asarray(values, np.float32) * np.asarray(scales, np.float32)[..., None]
    assert np.isfinite(back).all() and not back[1, 2].any() and float(scales[1, 2]) == 0.0
    step = np.abs(x).max(-1, keepdims=True) / 127
    assert (np.abs(back - x) <= bound * step).all()
    assert np.abs(np.asarray(values)).max() == 127  # the largest element of each vector


def test_bad_arguments_are_refused():
    args, _ = _case(0, 2, "float32", "float32", LENGTHS)
    with pytest.raises(ValueError, match="backend"):
        ragged_decode_attention(**args, backend="triton")
    with pytest.raises(ValueError, match="pages_per_block"):
        ragged_decode_attention(**args, backend="pallas", pages_per_block=3)
    with pytest.raises(ValueError, match="window"):
        ragged_decode_attention(**args, window=0)
    with pytest.raises(ValueError, match="scales"):
        ragged_decode_attention(**{**args, "k_pages": args["k_pages"].astype(jnp.int8),
                                   "v_pages": args["v_pages"].astype(jnp.int8)})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ragged_decode_attention(**{**args, "q": args["q"][:, :3]})
    with pytest.raises(ValueError, match="page_indices"):
        ragged_decode_attention(**{**args, "page_indices": args["page_indices"][:-1]})


def _triton_kernels(export, step, specs) -> list[str]:
    """The Triton kernels ``step`` lowers to for a CUDA target, by name, without a GPU."""
    triton = "__gpu$xla.gpu.triton"
    exported = export.export(jax.jit(step), platforms=("cuda",),
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])
    module = exported(*[jax.ShapeDtypeStruct(s, d) for s, d in specs]).mlir_module()
    kernels = [line.split('name = "')[1].split('"')[0] for line in module.splitlines()
               if f"custom_call @{triton}" in line]
    return kernels


@pytest.mark.parametrize("q_dtype,page_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                                ("bfloat16", "int8")])
def test_pallas_lowers_to_triton_for_cuda(q_dtype, page_dtype):
    """The kernel lowers to Triton IR for a CUDA target, without a GPU (GQA 4, a window, 4 pages
    a block; head_dim 128 and page_size 16 as the engine uses). Compiling that IR to PTX and
    running it needs a GPU and is not checked here."""
    export = pytest.importorskip("jax.export", reason="jax.export is needed to lower for CUDA")
    qd, pd = jnp.dtype(q_dtype), jnp.dtype(page_dtype)
    quantized = page_dtype == "int8"
    specs = [((3, 8, 128), qd), ((2, 10, 16, 128), pd), ((2, 10, 16, 128), pd), ((3,), jnp.int32),
             ((3, 5), jnp.int32)] + [((2, 10, 16), jnp.bfloat16)] * (2 * quantized)

    def step(q, k, v, lengths, table, *scales):
        kw = dict(zip(["k_scales", "v_scales"], scales))
        return ragged_decode_attention(q, k, v, lengths, table, **kw, window=40, backend="pallas",
                                       pages_per_block=4, interpret=False)

    assert _triton_kernels(export, step, specs) == ["ragged_decode_attention"]


# ---------------------------------------------------------------------------
# ragged_paged_attention: any number of queries per row

# (kv_len, queries) per row: decode rows, a new prompt, chunks after cached tokens, an empty row,
# a prompt of one page exactly, a chunk crossing pages; 3 padding tokens after the last row.
MIX = [(37, 1), (21, 21), (58, 9), (0, 0), (80, 1), (16, 16), (70, 35), (5, 1)]
PAD_TOKENS = 3
V_POISON = 1e6  # a value no query may weigh: any weight on it shows


def _paged_case(seed, kv_heads, page_dtype, mix, window=None, heads=H, head_dim=D):
    """Inputs of one ragged call and the dense float32 ``(q, k, v)`` (``[rows, kv, CAP, d]``) they
    came from. Positions no query may read (past ``kv_len``, before the first query's window)
    hold NaN keys and values of :data:`V_POISON` (int8: scales), and page-table slots outside a
    row's pages name a page of them: a pool never holds a NaN value (``kv_pages`` writes non-finite
    values as 0), so the reference may read a chunk past a row's end, but never weigh it."""
    rng = np.random.default_rng(seed)
    lens = np.array([m[0] for m in mix], np.int32)
    nq = np.array([m[1] for m in mix], np.int32)
    starts = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    rows = len(mix)
    q = rng.standard_normal((starts[-1] + PAD_TOKENS, heads, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((rows, kv_heads, CAP, head_dim)).astype(np.float32) for _ in "kv")
    lo = np.maximum(lens - nq - (CAP if window is None else window) + 1, 0)
    valid = (np.arange(CAP) >= lo[:, None]) & (np.arange(CAP) < lens[:, None])
    home = rng.permutation(rows * P).reshape(rows, P)
    poison = rows * P

    def paged(x, fill):
        x = x.reshape(rows, kv_heads, P, S, *x.shape[3:]).swapaxes(0, 1)
        pages = np.full((kv_heads, poison + 1, *x.shape[3:]), fill, x.dtype)
        pages[:, home.ravel()] = x.reshape(kv_heads, rows * P, *x.shape[3:])
        return pages

    args = {"q": jnp.asarray(q), "kv_lens": jnp.asarray(lens), "query_start": jnp.asarray(starts)}
    mask = valid[:, None, :, None]
    if page_dtype == "int8":
        dense = []
        for name, x in [("k", k), ("v", v)]:
            poison_value = np.nan if name == "k" else V_POISON
            values, scales = (np.asarray(a, np.float32) for a in quantize_kv(jnp.asarray(x)))
            dense.append(np.where(mask, values * scales[..., None], poison_value))
            args[f"{name}_pages"] = jnp.asarray(paged(values, 0), jnp.int8)
            scales = np.where(valid[:, None], scales, poison_value)
            args[f"{name}_scales"] = jnp.asarray(paged(scales, poison_value), jnp.bfloat16)
        k, v = dense
    else:
        k, v = np.where(mask, k, np.nan), np.where(mask, v, V_POISON)
        args["k_pages"], args["v_pages"] = jnp.asarray(paged(k, np.nan)), jnp.asarray(paged(v, V_POISON))
    slot = np.arange(P)
    outside = (slot < (lo // S)[:, None]) | (slot > ((lens - 1) // S)[:, None]) | (lens == 0)[:, None]
    args["page_table"] = jnp.asarray(np.where(outside, poison, home), jnp.int32)
    return args, (q, k, v)


def _dense_ragged(q, k, v, mix, window=None):
    """The definition, query by query and head by head over contiguous K/V, in float64."""
    out = np.zeros(q.shape)
    group, start = q.shape[1] // k.shape[1], 0
    for r, (n, count) in enumerate(mix):
        for i in range(count):
            pos = n - count + i
            lo = max(pos - (CAP if window is None else window) + 1, 0)
            for h in range(q.shape[1]):
                kk, vv = k[r, h // group, lo:pos + 1].astype(np.float64), v[r, h // group, lo:pos + 1]
                s = kk @ q[start + i, h] * q.shape[2] ** -0.5
                p = np.exp(s - s.max())
                out[start + i, h] = p @ vv / p.sum()
        start += count
    return out


# (kv heads (GQA 4 / kv heads), page dtype, queries per block, the kernel's pages per block: None
# its default, 0 the kernel not run): each a compile of its own, the window data.
PAGED_CASES = [(4, "float32", 8, 1), (2, "int8", 8, None), (1, "float32", 64, 0)]


@pytest.mark.parametrize("kv_heads,page_dtype,block_q,ppb", PAGED_CASES)
def test_paged_attention_is_dense_attention(kv_heads, page_dtype, block_q, ppb):
    """Decode rows, new prompts, chunks after cached tokens, an empty row and padding tokens in
    one call, with and without a window: the reference equals dense attention in numpy (one row's
    queries in blocks smaller than the row and larger), and the Pallas kernel (interpret mode)
    the reference."""
    for window in (None, WINDOW):
        args, (q, k, v) = _paged_case(kv_heads, kv_heads, page_dtype, MIX, window)
        want = ragged_paged_attention(**args, window=window, backend="reference", block_q=block_q)
        _assert_close(want, _dense_ragged(q, k, v, MIX, window), 1e-5)
        if ppb != 0:
            got = ragged_paged_attention(**args, window=window, backend="pallas", block_q=block_q,
                                         pages_per_block=ppb)
            _assert_close(got, want, 1e-5)
            assert not np.asarray(got)[-PAD_TOKENS:].any()  # padding tokens: zeros


@needs_native
@pytest.mark.parametrize("page_dtype", ["float32", "int8"])
def test_auto_on_the_cpu_takes_every_rows_last_query_to_the_native_kernel(page_dtype):
    """On a CPU, ``auto`` sends every row's last query (a decode row's only one) to the C++ kernel:
    a decode-only step whole, a step with prompts and chunks its last queries, the rest to the
    reference's blocks. Both equal dense attention on the mix, with and without a window."""
    decode_mix = [(37, 1), (0, 0), (80, 1), (5, 1), (CAP, 1)]
    for mix, decode_only in [(MIX, False), (decode_mix, True)]:
        for window in (None, WINDOW):
            args, (q, k, v) = _paged_case(4, 2, page_dtype, mix, window)
            call = functools.partial(ragged_paged_attention, window=window, block_q=8, decode_only=decode_only)
            assert cpu_decode.TARGET in str(jax.make_jaxpr(lambda a: call(**a))(args))
            got = call(**args)
            _assert_close(got, _dense_ragged(q, k, v, mix, window), 1e-5)
            assert not np.asarray(got)[-PAD_TOKENS:].any()


def test_a_group_over_multiply_max_queries_takes_dots_and_is_dense_attention():
    """The reference takes a row's last queries as multiplies and sums for up to
    MULTIPLY_MAX_QUERIES query heads a KV head (the cases above) and as dots above it: 16 heads
    over one KV head, the same mix, equals dense attention."""
    from hypertron.kernels.ragged_paged_attention import MULTIPLY_MAX_QUERIES

    heads = 2 * MULTIPLY_MAX_QUERIES
    args, (q, k, v) = _paged_case(5, 1, "float32", MIX, heads=heads)
    got = ragged_paged_attention(**args, backend="reference", block_q=8)
    _assert_close(got, _dense_ragged(q, k, v, MIX), 1e-5)


def test_rows_of_a_few_queries_attend_in_the_decode_batch_as_dense_attention(monkeypatch):
    """Speculative decoding's verify rows: rows of up to 5 queries (one, a few, none, five near the
    start of a row, and padding) with ``decode_only`` and ``decode_queries=5``: the reference reads
    each row's pages once for all its queries and equals dense attention, with and without a
    window; so does a mix of prompts and chunks whose rows' last 3 queries go in the batch; where
    Pallas is auto (patched, interpret mode), the one-query decode kernel is not taken and the
    ragged kernel gives the same."""
    mix = [(37, 5), (0, 0), (80, 1), (5, 5), (19, 3)]
    for window in (None, WINDOW):
        args, (q, k, v) = _paged_case(7, 2, "float32", mix, window)
        got = ragged_paged_attention(**args, window=window, decode_only=True, decode_queries=5)
        _assert_close(got, _dense_ragged(q, k, v, mix, window), 1e-5)
        assert not np.asarray(got)[-PAD_TOKENS:].any()
    # A step that prefills beside them: the last 3 queries of every row in the batch, the rest in blocks.
    args, (q, k, v) = _paged_case(8, 2, "float32", MIX, WINDOW)
    _assert_close(ragged_paged_attention(**args, window=WINDOW, block_q=8, decode_queries=3),
                  _dense_ragged(q, k, v, MIX, WINDOW), 1e-5)
    monkeypatch.setitem(ra.AUTO_BACKEND, jax.default_backend(), "pallas")
    args, _ = _paged_case(7, 2, "float32", mix, WINDOW)
    _assert_close(ragged_paged_attention(**args, window=WINDOW, decode_only=True, decode_queries=5), got, 1e-5)


def test_a_verify_row_whose_first_places_are_padding_reads_only_its_own_pages():
    """The engine's layout of a verify step: each row's 5 places, its queries last. A row of 3
    tokens (its first two places at negative positions) beside one over a whole chunk of the
    reference's decode batch (DECODE_CHUNK_TOKENS: the rows' shared read then has a chunk to read) gets dense
    attention over its own pages, and so does the long one (it once read the long row's pages:
    a row was taken for live by its first place only)."""
    from hypertron.kernels.ragged_paged_attention import DECODE_CHUNK_TOKENS

    rng = np.random.default_rng(0)
    page, heads, dim, places = 16, 2, 8, 5
    lens = [DECODE_CHUNK_TOKENS + 44, 3]
    own = -(-lens[0] // page)
    k, v = (rng.standard_normal((1, own + 1, page, dim)).astype(np.float32) for _ in "kv")
    table = np.full((2, own + 1), own, np.int32)
    table[0, :own] = np.arange(own)
    q = rng.standard_normal((2 * places, heads, dim)).astype(np.float32)
    got = np.asarray(ragged_paged_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lens),
                                            jnp.asarray(table), jnp.asarray([0, places, 2 * places], jnp.int32),
                                            backend="reference", decode_only=True, decode_queries=places))
    for r, n in enumerate(lens):
        keys, values = (x[0, table[r]].reshape(-1, dim)[:n] for x in (k, v))
        for i in range(places):
            pos = n - places + i
            if pos < 0:
                continue
            scores = keys[:pos + 1] @ q[r * places + i].T * dim ** -0.5
            weights = np.exp(scores - scores.max(0))
            want = (weights / weights.sum(0)).T @ values[:pos + 1]
            np.testing.assert_allclose(got[r * places + i], want, atol=1e-5)


def test_a_decode_only_step_takes_the_decode_kernel_where_it_is_auto(monkeypatch):
    """Where the decode kernel's table picks Pallas (a GPU; here the CPU, patched, in interpret
    mode), a decode-only call with ``backend="auto"`` runs it: the reference's numbers, a row with
    no query and padding tokens zeros."""
    mix = [(37, 1), (0, 0), (80, 1), (5, 1)]
    args, _ = _paged_case(3, 2, "int8", mix, WINDOW)
    want = ragged_paged_attention(**args, window=WINDOW, backend="reference", decode_only=True)
    monkeypatch.setitem(ra.AUTO_BACKEND, jax.default_backend(), "pallas")
    got = ragged_paged_attention(**args, window=WINDOW, decode_only=True)
    _assert_close(got, want, 1e-5)
    assert not np.asarray(got)[-PAD_TOKENS:].any()


def test_auto_takes_the_reference_where_the_kernels_cannot_take_the_shapes(monkeypatch):
    """head_dim 8 (Triton's dot wants 16; on an H100 the kernel gave attention 7-12 % off): where
    both tables pick Pallas (patched here), ``auto`` runs no Pallas kernel, decode-only or not,
    and an explicit ``pallas`` is refused with the reason."""
    args, _ = _paged_case(3, 2, "float32", [(37, 1), (0, 0), (5, 1)], WINDOW, head_dim=8)
    for table in (ra.AUTO_BACKEND, rpa.AUTO_BACKEND):
        monkeypatch.setitem(table, jax.default_backend(), "pallas")
    for decode_only in (False, True):
        jaxpr = jax.make_jaxpr(lambda a: ragged_paged_attention(**a, window=WINDOW, decode_only=decode_only))(args)
        assert "pallas_call" not in str(jaxpr)
    with pytest.raises(ValueError, match="head_dim >= 16"):
        ragged_paged_attention(**args, backend="pallas")
    args, _ = _paged_case(3, 2, "float32", [(5, 1)], head_dim=12)
    with pytest.raises(ValueError, match="head_dim a power of two, got 12"):
        ragged_paged_attention(**args, backend="pallas")


@pytest.mark.parametrize("q_dtype,page_dtype", [("bfloat16", "bfloat16"), ("bfloat16", "int8")])
def test_paged_pallas_lowers_to_triton_for_cuda(q_dtype, page_dtype):
    """As the decode kernel's: Triton IR for a CUDA target without a GPU (GQA 4, a window, 32
    queries a block over 2 rows; head_dim 128 and page_size 16)."""
    export = pytest.importorskip("jax.export", reason="jax.export is needed to lower for CUDA")
    qd, pd = jnp.dtype(q_dtype), jnp.dtype(page_dtype)
    specs = [((40, 8, 128), qd), ((2, 10, 16, 128), pd), ((2, 10, 16, 128), pd), ((2,), jnp.int32),
             ((2, 5), jnp.int32), ((3,), jnp.int32)] + [((2, 10, 16), jnp.bfloat16)] * (2 * (page_dtype == "int8"))

    def step(q, k, v, kv_lens, table, query_start, *scales):
        kw = dict(zip(["k_scales", "v_scales"], scales))
        return ragged_paged_attention(q, k, v, kv_lens, table, query_start, **kw, window=40,
                                      backend="pallas", block_q=32, interpret=False)

    assert _triton_kernels(export, step, specs) == ["ragged_paged_attention"]


def test_the_references_blocks_follow_the_queries_a_row_has():
    from hypertron.kernels.ragged_paged_attention import reference_block_q

    assert [reference_block_q(n) for n in (None, 1, 64, 65, 100, 129, 256, 512, 2000)] == [64, 64, 64, 64, 128, 128, 256, 256, 256]


def _share_three_pages(args: dict, k, v, mix) -> None:
    """Every row with tokens after the first starts with row 0's first three pages (their keys and
    values in ``k``, ``v`` too): a prefix the prefix cache shares."""
    table = np.asarray(args["page_table"]).copy()
    for r, (n, _) in enumerate(mix):
        if r and n:
            table[r, :3] = table[0, :3]
            k[r, :, :3 * S], v[r, :, :3 * S] = k[0, :, :3 * S], v[0, :, :3 * S]
    args["page_table"] = jnp.asarray(table)


@pytest.mark.parametrize("page_dtype", ["float32", "int8"])
def test_rows_sharing_a_prefix_read_it_once_and_get_dense_attention(page_dtype, monkeypatch):
    """Rows whose tables start with the same pages (a prefix the prefix cache shares), decode rows
    and a chunk's last query among them, one row empty: with chunks of one page the reference reads
    the three shared pages once for all rows (two, then one), and equals dense attention, with and
    without a window; so does the C++ kernel (``native_last``, a CPU's), which reads them once itself."""
    mix = [(60, 1), (49, 1), (80, 1), (0, 0), (52, 4)]
    args, (q, k, v) = _paged_case(7, 2, page_dtype, mix)
    _share_three_pages(args, k, v, mix)
    last = np.asarray(args["kv_lens"]) - 1  # each row's last query's position: the decode batch's
    shared, _ = rpa.shared_prefix(args["page_table"], jnp.asarray(last >= 0), jnp.asarray(last), S)
    assert int(shared) == 3 * S  # the case is what it says: three pages every row with a query shares
    monkeypatch.setattr(rpa, "DECODE_CHUNK_TOKENS", S)  # whole chunks of the shared prefix: 3,
    monkeypatch.setattr(rpa, "DECODE_SHARED_TOKENS", 2 * S)  # one read two at a time, then one alone
    for window in (None, WINDOW):
        for native_last in [False] + [True] * (cpu_decode.unavailable() is None):
            got = rpa.ragged_paged_attention_reference(**args, window=window, block_q=8, native_last=native_last)
            _assert_close(got, _dense_ragged(q, k, v, mix, window), 1e-5)


def test_prompt_rows_sharing_a_prefix_read_it_once_in_blocks_across_rows_and_get_dense_attention(monkeypatch):
    """Chunks of several rows after three pages they share (and decode rows beside them): every
    query but each row's last reads the shared pages first, in blocks of the step's tokens that
    cross rows (4 tokens here), two of the rows' chunks a product and then one, and then its own
    row's pages from where that stopped; equals dense attention, with and without a window."""
    mix = [(60, 1), (55, 7), (49, 1), (0, 0), (52, 4), (80, 30), (51, 3)]
    args, (q, k, v) = _paged_case(8, 2, "float32", mix)
    _share_three_pages(args, k, v, mix)
    counts = np.array([c for _, c in mix])
    first = np.array([n for n, _ in mix]) - counts  # each row's first query's position
    shared, _ = rpa.shared_prefix(args["page_table"], jnp.asarray(counts > 1), jnp.asarray(first), S)
    assert int(shared) == 3 * S  # what every row of several queries shares: the three pages
    monkeypatch.setattr(rpa, "REFERENCE_CHUNK_TOKENS", S)
    monkeypatch.setattr(rpa, "EVERY_BLOCK_Q", 4)
    monkeypatch.setattr(rpa, "EVERY_SHARED_TOKENS", 2 * S)
    for window in (None, WINDOW):
        got = rpa.ragged_paged_attention_reference(**args, window=window, block_q=8)
        _assert_close(got, _dense_ragged(q, k, v, mix, window), 1e-5)
