"""Grouped matmul (megablox-style) for dropless Mixture-of-Experts.

The rows of ``lhs [m, k]`` are the tokens routed to the experts, already sorted by
expert; ``group_sizes [G]`` says how many rows each expert got. Group ``g`` is
multiplied by its own weight ``rhs[g] [k, n]``::

    out[starts[g]:ends[g]] = lhs[starts[g]:ends[g]] @ rhs[g]          out [m, n]

with ``ends = cumsum(group_sizes)`` and ``starts = ends - group_sizes``. Rows past
``sum(group_sizes)`` (capacity padding) give zeros; groups of size 0 are allowed.
:func:`tgmm` is the transposed product, the weight gradient:
``out[g] = lhs[starts[g]:ends[g]]^T @ dout[starts[g]:ends[g]]`` (``[G, k, n]``).

Backends (``backend=``):

``"pallas"``
    A Pallas kernel. The grid tiles the output in ``(tm, tn)`` blocks; each program
    loops over the groups that its ``tm`` rows overlap (per-tile metadata computed
    from ``group_sizes``: first group and group count, as in megablox's
    ``make_group_metadata``), so a tile that straddles a group boundary is visited
    once per group, each visit masked to that group's rows; inside a visit it loops
    over ``k`` in ``tk`` steps, accumulating in float32. Unlike megablox (TPU, which
    enumerates the visits in the grid with scalar prefetch and relies on a sequential
    grid), every output tile here is written once by one program, so programs may
    run in parallel as they do on a GPU. :func:`tgmm` has one program per
    ``(g, k tile, n tile)`` looping over the ``tm`` row tiles of group ``g``.
    Gradients: ``dlhs = gmm(dout, rhs^T)`` (the same kernel reading ``rhs``
    transposed, no copy), ``drhs = tgmm(lhs, dout)``, through ``jax.custom_vjp``.
``"ragged_dot"``
    ``jax.lax.ragged_dot`` and its built-in gradient (``ragged_dot_general``). On
    CPU, XLA expands it to a masked dense product over all groups: G times the work
    and a ``[G, m, k]`` temporary.
``"grouped"``
    Plain JAX for CPU: one ``while`` loop over ``tm``-row chunks, each chunk starting
    at its group's first row (only a group's last chunk is partly masked), each a
    ``[tm, k] x [k, n]`` dot with that group's weight written in place. About
    ``m + G * tm`` rows of work instead of ``G * m``, and no large temporaries;
    ``tm`` follows the mean group size. ``custom_vjp`` with the same decomposition
    as ``"pallas"``.
``"reference"``
    Mask per group, one einsum. G times the work; the oracle for tests.
``"auto"``
    ``AUTO_BACKEND[jax.default_backend()]``; see that table for the measurements.

All backends accumulate in float32 and return ``preferred_element_type`` (default:
``lhs.dtype``); operands of different dtypes are promoted first. Gradients in the
custom-VJP backends are computed in the operands' dtype from ``dout`` cast to it.

Verified (CPU, JAX 0.10.2, ``tests/test_gmm.py``): every backend's output and both
gradients against the reference, float32 and bfloat16, with the Pallas kernels in
interpret mode; and that the three kernel calls (forward, dlhs, drhs) lower to Triton
IR for a CUDA target (``jax.export`` with ``platforms=("cuda",)``, no GPU needed).
On a GPU (2026-11-25, one H100, and 2026-11-26, one H200, JAX 0.11.2): the tests pass compiled
for it at their 16-wide tiles; at Mixtral's size :data:`DEFAULT_TILING` runs at twice the speed
of ``ragged_dot`` (see :data:`AUTO_BACKEND`).
The kernel is written for the Triton lowering (named in ``compiler_params``: JAX
0.10.2 would otherwise pick Mosaic GPU): power-of-two load shapes, no
data-dependent shapes, dynamic loop bounds and ``pl.ds`` offsets only, one writer
per output block, dots of at least 16x16x16 unless ``tiling`` asks for less. It is
not written for Mosaic TPU (it reads whole operands from unblocked refs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from hypertron.config.schema import GmmBackend, choices
from hypertron.kernels.backends import TRITON, auto_backend, interpret_default, whole

BACKENDS = choices(GmmBackend)  # model.moe.gmm_backend

# (tm, tk, tn). What Triton asked for in shared memory (227 KiB a block on Hopper), JAX 0.11.2:
# H100 (2026-11-25) 320 KiB at (128, 128, 128), 256 and 448 KiB at tm 64 and 256; H200
# (2026-11-26) 288 KiB at (128, 64, 128), 240 KiB at (128, 32, 128), and (256, 64, 64) failed too.
# No simple formula fits those (Triton picks its pipeline depth per tile). (128, 64, 64) and
# (64, 64, 64) compile; at Mixtral's size (128, 64, 64) is the faster, 18.3 against 30.4 ms forward
# (docs/benchmarks.md t2.gmm, t3.gmm).
DEFAULT_TILING = (128, 64, 64)
# Bounds on the chunk rows of the "grouped" CPU path (see _grouped_tm, measured).
GROUPED_TM_RANGE = (16, 128)

# Chosen from bench/gmm.py (docs/kernels.md). CPU (2 cores, JAX 0.10.2): "grouped"
# beat "ragged_dot" in every case measured, m=256..4096, G=8..64, even and skewed,
# float32 and bfloat16: 2.2-41x forward, 2.8-24x forward+backward. GPU (H200, JAX
# 0.11.2, 2026-11-26, docs/benchmarks.md t2.gmm; Mixtral's size, bf16, 8 experts even):
# "pallas" at DEFAULT_TILING 18.3 ms forward and 69.3 ms forward + backward (29 % and
# 27 % of one dense matmul of the same FLOPs), "ragged_dot" 36.2 and 137.0 ms (15 %
# and 14 %; 15 % and 12 % on an H100 the day before): "pallas" beats it both ways.
AUTO_BACKEND = {"cpu": "grouped", "gpu": "pallas", "cuda": "pallas",
                "rocm": "ragged_dot", "tpu": "ragged_dot"}


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static (hashable) settings of one call."""

    backend: str
    tiling: tuple[int, int, int] | None  # None: the backend's default
    out_dtype: np.dtype
    interpret: bool


# ---------------------------------------------------------------------------
# Public API


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, backend: str = "auto",
        tiling: tuple[int, int, int] | None = None, preferred_element_type=None,
        interpret: bool | None = None) -> jax.Array:
    """Grouped matmul: ``out[rows of g] = lhs[rows of g] @ rhs[g]``.

    Args:
      lhs: ``[m, k]``, rows sorted by group.
      rhs: ``[G, k, n]``, one weight per group.
      group_sizes: ``[G]`` integers, ``sum(group_sizes) <= m``; rows past the sum give 0.
      backend: one of :data:`BACKENDS`.
      tiling: ``(tm, tk, tn)``, powers of two ("pallas"; "grouped" uses ``tm``).
        Tiles larger than a (padded) dimension are shrunk to it.
      preferred_element_type: output dtype (default ``lhs.dtype``); accumulation is
        float32 whatever this is.
      interpret: run the Pallas kernel in interpret mode; default: on CPU only.

    Returns:
      ``[m, n]``. Differentiable in ``lhs`` and ``rhs`` for every backend.
    """
    group_sizes = jnp.asarray(group_sizes)
    _check_shapes(lhs, rhs, group_sizes)
    cfg = _config(backend, tiling, _out_dtype(preferred_element_type, lhs), interpret)
    return _gmm_jit(lhs, rhs, group_sizes, cfg)


def tgmm(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, backend: str = "auto",
         tiling: tuple[int, int, int] | None = None, preferred_element_type=None,
         interpret: bool | None = None) -> jax.Array:
    """Transposed grouped matmul: ``out[g] = lhs[rows of g]^T @ dout[rows of g]``.

    ``lhs [m, k]``, ``dout [m, n]``, ``group_sizes [G]`` -> ``[G, k, n]`` (zeros for
    empty groups; rows past ``sum(group_sizes)`` are ignored). This is the weight
    gradient of :func:`gmm`. Arguments as in :func:`gmm`. Not differentiable for
    the "pallas" and "grouped" backends.
    """
    group_sizes = jnp.asarray(group_sizes)
    if lhs.ndim != 2 or dout.ndim != 2 or dout.shape[0] != lhs.shape[0]:
        raise ValueError(f"tgmm wants lhs [m, k] and dout [m, n], got {lhs.shape} and {dout.shape}")
    if group_sizes.ndim != 1 or group_sizes.shape[0] < 1:
        raise ValueError(f"group_sizes must be [G] with G >= 1, got {group_sizes.shape}")
    cfg = _config(backend, tiling, _out_dtype(preferred_element_type, lhs), interpret)
    return _tgmm_jit(lhs, dout, group_sizes, cfg)


def gmm_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                  preferred_element_type=None) -> jax.Array:
    """:func:`gmm` by masking ``lhs`` once per group and one einsum: ``[m, n]``."""
    return _masked_einsum("gmk,gkn->mn", lhs, rhs, group_sizes, preferred_element_type)


def tgmm_reference(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *,
                   preferred_element_type=None) -> jax.Array:
    """:func:`tgmm` by masking ``lhs`` once per group and one einsum: ``[G, k, n]``."""
    return _masked_einsum("gmk,mn->gkn", lhs, dout, group_sizes, preferred_element_type)


def _masked_einsum(subscripts: str, lhs: jax.Array, other: jax.Array, group_sizes: jax.Array,
                   preferred_element_type) -> jax.Array:
    """``lhs`` [m, k] masked once per group (``gmk``), contracted with ``other`` by ``subscripts`` in
    float32, in the output dtype of :func:`gmm`."""
    out_dtype = _out_dtype(preferred_element_type, lhs)
    lhs_gmk = _mask_per_group(lhs, group_sizes)
    return jnp.einsum(subscripts, lhs_gmk, other, preferred_element_type=jnp.float32).astype(out_dtype)


def resolve_backend(backend: str = "auto") -> str:
    """The backend ``backend`` stands for on the default platform ("auto" resolved)."""
    if backend not in BACKENDS:
        raise ValueError(f"gmm backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return auto_backend(AUTO_BACKEND, "ragged_dot")


# ---------------------------------------------------------------------------
# Group metadata


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """First row and one-past-last row of each group, int32 ``[G]`` each (clipped to ``m``)."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def tile_groups(starts: jax.Array, ends: jax.Array, num_tiles: int,
                tm: int) -> tuple[jax.Array, jax.Array]:
    """For each ``tm``-row tile: its first overlapping group and how many groups to visit.

    Both int32 ``[num_tiles]``. A tile past ``sum(group_sizes)`` visits 0 groups; the
    visit count includes empty groups between the first and the last (masked to
    nothing), and sums to at most ``num_tiles + G - 1``.
    """
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * tm
    last_row = jnp.minimum(tile_start + tm, ends[-1]) - 1
    first = jnp.searchsorted(ends, tile_start, side="right").astype(jnp.int32)
    last = jnp.searchsorted(ends, last_row, side="right").astype(jnp.int32)
    count = jnp.where(last_row >= tile_start, last - first + 1, 0).astype(jnp.int32)
    return first, count


def _mask_per_group(lhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``lhs [m, k]`` -> ``[G, m, k]``, row ``r`` kept only in its own group's slice."""
    m, G = lhs.shape[0], group_sizes.shape[0]
    _, ends = group_bounds(group_sizes, m)
    group_of_row = jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")
    in_group_gm = group_of_row[None, :] == jnp.arange(G)[:, None]
    return jnp.where(in_group_gm[:, :, None], lhs[None], jnp.zeros((), lhs.dtype))


# ---------------------------------------------------------------------------
# Pallas kernels


def _gmm_kernel(first_ref, count_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref, *,
                tm: int, tk: int, tn: int, k_tiles: int, transpose_rhs: bool):
    """One ``(tm, tn)`` output tile: sum over its groups of masked ``lhs_tile @ rhs[g]``."""
    i, j = pl.program_id(0), pl.program_id(1)
    rows = i * tm + jnp.arange(tm, dtype=jnp.int32)[:, None]  # [tm, 1]
    # rhs tile is [tk, tn], or [tn, tk] read from the [G, n, k] layout for dlhs.
    contract = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

    def visit_group(step, acc):
        g = first_ref[i] + step

        def k_step(kk, part):
            x = lhs_ref[pl.ds(i * tm, tm), pl.ds(kk * tk, tk)]
            if transpose_rhs:
                w = rhs_ref[g, pl.ds(j * tn, tn), pl.ds(kk * tk, tk)]
            else:
                w = rhs_ref[g, pl.ds(kk * tk, tk), pl.ds(j * tn, tn)]
            return part + lax.dot_general(x, w, contract, preferred_element_type=jnp.float32)

        part = lax.fori_loop(0, k_tiles, k_step, jnp.zeros((tm, tn), jnp.float32))
        in_group = (rows >= starts_ref[g]) & (rows < ends_ref[g])
        # Masking the product (not lhs) also keeps garbage in other rows out.
        return acc + jnp.where(in_group, part, 0.0)

    acc = lax.fori_loop(0, count_ref[i], visit_group, jnp.zeros((tm, tn), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _tgmm_kernel(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, *, tm: int, tk: int, tn: int):
    """One ``(tk, tn)`` tile of ``out[g]``: sum over g's row tiles of ``lhs^T @ dout``."""
    g, a, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = starts_ref[g], ends_ref[g]
    first_tile = lax.div(start, tm)
    end_tile = jnp.where(end > start, lax.div(end + tm - 1, tm), first_tile)

    def row_tile(t, acc):
        rows = t * tm + jnp.arange(tm, dtype=jnp.int32)[:, None]  # [tm, 1]
        in_group = (rows >= start) & (rows < end)
        x = lhs_ref[pl.ds(t * tm, tm), pl.ds(a * tk, tk)]
        dy = dout_ref[pl.ds(t * tm, tm), pl.ds(b * tn, tn)]
        # Both operands masked: 0 * inf in another group's row would still be NaN.
        x = jnp.where(in_group, x, jnp.zeros_like(x))
        dy = jnp.where(in_group, dy, jnp.zeros_like(dy))
        return acc + lax.dot_general(x, dy, (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(first_tile, end_tile, row_tile, jnp.zeros((tk, tn), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _pallas_gmm(lhs, rhs, group_sizes, cfg: _Config, transpose_rhs: bool):
    """``[m, k] x [G, k, n]`` (or ``[G, n, k]`` read transposed) -> ``[m, n]`` by the kernel."""
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tk, tn = _fit(cfg.tiling or DEFAULT_TILING, (m, k, n))
    lhs_p = _pad(lhs, (tm, tk))
    rhs_p = _pad(rhs, (1, tn, tk) if transpose_rhs else (1, tk, tn))
    m_p, k_p = lhs_p.shape
    n_p = -(-n // tn) * tn
    starts, ends = group_bounds(group_sizes, m)
    first, count = tile_groups(starts, ends, m_p // tm, tm)
    kernel = functools.partial(_gmm_kernel, tm=tm, tk=tk, tn=tn, k_tiles=k_p // tk,
                               transpose_rhs=transpose_rhs)
    operands = (first, count, starts, ends, lhs_p, rhs_p)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_p, n_p), cfg.out_dtype),
        grid=(m_p // tm, n_p // tn),
        in_specs=[whole(x) for x in operands],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        interpret=cfg.interpret,
        compiler_params=TRITON,
        name="gmm",
    )(*operands)
    return out[:m, :n]


def _pallas_tgmm(lhs, dout, group_sizes, cfg: _Config):
    """``[m, k]^T x [m, n]`` per group -> ``[G, k, n]`` by the kernel."""
    (m, k), n, G = lhs.shape, dout.shape[1], group_sizes.shape[0]
    tm, tk, tn = _fit(cfg.tiling or DEFAULT_TILING, (m, k, n))
    lhs_p, dout_p = _pad(lhs, (tm, tk)), _pad(dout, (tm, tn))
    k_p, n_p = lhs_p.shape[1], dout_p.shape[1]
    starts, ends = group_bounds(group_sizes, m)
    operands = (starts, ends, lhs_p, dout_p)
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm, tk=tk, tn=tn),
        out_shape=jax.ShapeDtypeStruct((G, k_p, n_p), cfg.out_dtype),
        grid=(G, k_p // tk, n_p // tn),
        in_specs=[whole(x) for x in operands],
        out_specs=pl.BlockSpec((None, tk, tn), lambda g, a, b: (g, a, b)),
        interpret=cfg.interpret,
        compiler_params=TRITON,
        name="tgmm",
    )(*operands)
    return out[:, :k, :n]


# ---------------------------------------------------------------------------
# "grouped": chunks of each group in plain JAX loops, for CPU


def _grouped_gmm(lhs, rhs, group_sizes, cfg: _Config, transpose_rhs: bool):
    """``[m, k] x [G, k, n]`` (or ``[G, n, k]`` read transposed) -> ``[m, n]``, chunk by chunk.

    One loop over all chunks of all groups; a chunk is ``tm`` rows from its group's
    start, so only a group's last chunk is partly masked (unlike the kernel's fixed
    row tiles, which also split at every group boundary).
    """
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm = _grouped_tm(cfg, m, rhs.shape[0])
    # tm spare rows, so that a chunk starting before row m never reads past the end.
    lhs_p = jnp.pad(lhs, ((0, tm), (0, 0)))
    starts, ends = group_bounds(group_sizes, m)
    chunk_group, chunk_row, num_chunks = _chunks(starts, ends, m, tm)
    contract = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

    def chunk(c, out_pn):
        g, row = chunk_group[c], chunk_row[c]
        x_tk = lax.dynamic_slice_in_dim(lhs_p, row, tm)
        w = lax.dynamic_index_in_dim(rhs, g, keepdims=False)
        y_tn = lax.dot_general(x_tk, w, contract, preferred_element_type=jnp.float32)
        rows = row + jnp.arange(tm, dtype=jnp.int32)[:, None]  # [tm, 1]
        # Rows past the group's end keep what is there (zeros, or the next group's rows
        # written later): a read-modify-write, fine in a sequential loop.
        old_tn = lax.dynamic_slice_in_dim(out_pn, row, tm)
        new_tn = jnp.where(rows < ends[g], y_tn.astype(out_pn.dtype), old_tn)
        return lax.dynamic_update_slice_in_dim(out_pn, new_tn, row, 0)

    out_pn = lax.fori_loop(0, num_chunks, chunk, jnp.zeros((m + tm, n), cfg.out_dtype))
    return out_pn[:m]


def _grouped_tgmm(lhs, dout, group_sizes, cfg: _Config):
    """``[m, k]^T x [m, n]`` per group -> ``[G, k, n]``, ``tm`` rows at a time from its start."""
    (m, k), n, G = lhs.shape, dout.shape[1], group_sizes.shape[0]
    tm = _grouped_tm(cfg, m, G)
    lhs_p, dout_p = jnp.pad(lhs, ((0, tm), (0, 0))), jnp.pad(dout, ((0, tm), (0, 0)))
    starts, ends = group_bounds(group_sizes, m)

    def one_group(bounds):
        start, end = bounds

        def chunk(c, acc_kn):
            row = start + c * tm
            in_group = row + jnp.arange(tm, dtype=jnp.int32)[:, None] < end  # [tm, 1]
            # Both operands masked: 0 * inf in another group's row would still be NaN.
            x = jnp.where(in_group, lax.dynamic_slice_in_dim(lhs_p, row, tm), 0)
            dy = jnp.where(in_group, lax.dynamic_slice_in_dim(dout_p, row, tm), 0)
            return acc_kn + lax.dot_general(x, dy, (((0,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)

        num = (end - start + tm - 1) // tm
        acc_kn = lax.fori_loop(0, num, chunk, jnp.zeros((k, n), jnp.float32))
        return acc_kn.astype(cfg.out_dtype)

    return lax.map(one_group, (starts, ends))  # [G, k, n]


def _chunks(starts: jax.Array, ends: jax.Array, m: int,
            tm: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Group and first row of every ``tm``-row chunk of every group, in row order; their count.

    ``[m // tm + G]`` int32 each: a static bound, since group ``g`` has at most
    ``sizes[g] / tm + 1`` chunks; entries past the count are unused.
    """
    per_group = (ends - starts + tm - 1) // tm
    chunk_end = jnp.cumsum(per_group)
    c = jnp.arange(m // tm + ends.shape[0], dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(chunk_end, c, side="right"), ends.shape[0] - 1)
    row = starts[group] + (c - (chunk_end - per_group)[group]) * tm
    return group.astype(jnp.int32), row.astype(jnp.int32), chunk_end[-1]


def _grouped_tm(cfg: _Config, m: int, groups: int) -> int:
    """The chunk rows of "grouped": ``tiling[0]`` if given, else the mean group size
    rounded down to a power of two, within :data:`GROUPED_TM_RANGE`.

    Larger chunks make faster CPU dots, up to about 128 rows; a group wastes up to
    ``tm - 1`` masked rows. On a 2-core CPU (m=4096, k=512, n=1024) a sweep of tm
    in 32..512 had 128 best for G=8 and 64 best for G=64 (docs/kernels.md).
    """
    if cfg.tiling is not None:
        return cfg.tiling[0]
    mean_rows = max(1, m // groups)
    return int(np.clip(1 << (mean_rows.bit_length() - 1), *GROUPED_TM_RANGE))


# ---------------------------------------------------------------------------
# Gradients and dispatch


def _with_grouped_vjp(forward: Callable, transposed: Callable) -> Callable:
    """``forward`` made differentiable.

    ``dlhs = forward(dout, rhs read transposed)`` and ``drhs = transposed(lhs, dout)``.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def f(lhs, rhs, group_sizes, cfg):
        return forward(lhs, rhs, group_sizes, cfg, False)

    def f_fwd(lhs, rhs, group_sizes, cfg):
        return f(lhs, rhs, group_sizes, cfg), (lhs, rhs, group_sizes)

    # Jitted, so that a backward pass run outside jit is not dispatched op by op.
    @functools.partial(jax.jit, static_argnums=0)
    def f_bwd(cfg, residuals, dout):
        lhs, rhs, group_sizes = residuals
        dout = dout.astype(lhs.dtype)
        dlhs = forward(dout, rhs, group_sizes, dataclasses.replace(cfg, out_dtype=lhs.dtype), True)
        drhs = transposed(lhs, dout, group_sizes, dataclasses.replace(cfg, out_dtype=rhs.dtype))
        return dlhs, drhs, None

    f.defvjp(f_fwd, f_bwd)
    return f


def _ragged_dot(lhs, rhs, group_sizes, cfg: _Config):
    out = lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(cfg.out_dtype)


def _ragged_tdot(lhs, dout, group_sizes, cfg: _Config):
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=(0,), rhs_group_dimensions=())
    out = lax.ragged_dot_general(lhs, dout, group_sizes, dims, preferred_element_type=jnp.float32)
    return out.astype(cfg.out_dtype)


_GMM = {
    "pallas": _with_grouped_vjp(_pallas_gmm, _pallas_tgmm),
    "grouped": _with_grouped_vjp(_grouped_gmm, _grouped_tgmm),
    "ragged_dot": _ragged_dot,
    "reference": lambda lhs, rhs, gs, cfg: gmm_reference(lhs, rhs, gs,
                                                         preferred_element_type=cfg.out_dtype),
}
_TGMM = {
    "pallas": _pallas_tgmm,
    "grouped": _grouped_tgmm,
    "ragged_dot": _ragged_tdot,
    "reference": lambda lhs, dout, gs, cfg: tgmm_reference(lhs, dout, gs,
                                                           preferred_element_type=cfg.out_dtype),
}


@functools.partial(jax.jit, static_argnums=3)
def _gmm_jit(lhs, rhs, group_sizes, cfg: _Config):
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    return _GMM[cfg.backend](lhs.astype(dtype), rhs.astype(dtype),
                             group_sizes.astype(jnp.int32), cfg)


@functools.partial(jax.jit, static_argnums=3)
def _tgmm_jit(lhs, dout, group_sizes, cfg: _Config):
    dtype = jnp.promote_types(lhs.dtype, dout.dtype)
    return _TGMM[cfg.backend](lhs.astype(dtype), dout.astype(dtype),
                              group_sizes.astype(jnp.int32), cfg)


def _config(backend, tiling, out_dtype, interpret) -> _Config:
    backend = resolve_backend(backend)
    if tiling is not None:
        tiling = tuple(int(t) for t in tiling)
        if len(tiling) != 3 or any(t < 1 or t & (t - 1) for t in tiling):
            raise ValueError(f"gmm tiling must be three powers of two (tm, tk, tn), got {tiling}")
    return _Config(backend, tiling, np.dtype(out_dtype), interpret_default(interpret))


def _check_shapes(lhs, rhs, group_sizes) -> None:
    if lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"gmm wants lhs [m, k] and rhs [G, k, n], got {lhs.shape} and {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],) or rhs.shape[0] < 1:
        raise ValueError(f"group_sizes must be [G] = [{rhs.shape[0]}] (G >= 1), "
                         f"got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, got {group_sizes.dtype}")


def _out_dtype(preferred_element_type, lhs) -> np.dtype:
    # `is None`, not `or`: older numpy made dtypes without fields falsy.
    return np.dtype(lhs.dtype if preferred_element_type is None else preferred_element_type)


def _fit(tiling, dims) -> tuple[int, ...]:
    """Each tile shrunk to the next power of two of its dimension (tiles stay powers of two)."""
    # Never below 16 through shrinking: Triton dots want at least 16x16x16.
    return tuple(min(t, max(16, pl.next_power_of_2(d))) for t, d in zip(tiling, dims))


def _pad(x: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
    """Zero-pad the trailing dimensions of ``x`` up to multiples of ``multiples``."""
    lead = x.ndim - len(multiples)
    pads = [(0, 0)] * lead + [(0, -d % t) for d, t in zip(x.shape[lead:], multiples)]
    return x if not any(hi for _, hi in pads) else jnp.pad(x, pads)
