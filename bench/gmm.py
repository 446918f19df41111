"""Grouped matmul throughput per backend, against one dense matmul of the same FLOPs.

    python bench/gmm.py [--m 4096] [--k 512] [--n 1024] [--groups 8 16 32 64]
                        [--backends grouped ragged_dot] [--dtype float32] [--tm 128]

For each group count and each split of the ``m`` rows (``even``: m/G each;
``skewed``: Zipf-like, half the rows in the first few groups, some groups empty),
times the jitted forward (``fwd``) and forward + gradients wrt lhs and rhs
(``fwd+bwd``) of :func:`hypertron.kernels.gmm.gmm`, and reports TFLOP/s counting
the useful FLOPs only (2mkn forward, 6mkn with backward). ``dense`` is one
``[m, k] x [k, n]`` matmul (and its gradients): the ceiling to compare with.
Default backends: ``pallas`` and ``ragged_dot`` on an accelerator, ``grouped`` and
``ragged_dot`` on CPU (the Pallas kernel runs in interpret mode there: correctness
only, ask for it with ``--backends pallas`` on tiny shapes).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def split_rows(m: int, groups: int, how: str) -> np.ndarray:
    """Group sizes summing to ``m``: ``even`` or ``skewed`` (Zipf-like, zeros at the tail)."""
    if how == "even":
        sizes = np.full(groups, m // groups)
    else:
        weights = 1.0 / np.arange(1, groups + 1) ** 1.2
        weights[-max(1, groups // 8):] = 0.0  # some experts get no tokens
        sizes = np.floor(weights / weights.sum() * m).astype(np.int64)
    sizes[0] += m - sizes.sum()
    return sizes.astype(np.int32)


def time_fn(fn, args, iters: int) -> float:
    """Median seconds per call of the jitted ``fn``, each call synced, after a warm-up call.

    The median, not the mean: on a shared CPU one slow call should not move the figure.
    """
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure(m, k, n, groups_list, splits, backends, dtype, iters, *, tiling=None, backward=True):
    """Rows ``(backend, G, split, fwd s, fwd+bwd s)``, one dense matmul of the same FLOPs first.

    A backend that fails (a kernel that does not compile here) gets ``None`` times and a note on
    stderr instead of stopping the run.
    """
    from hypertron.kernels.gmm import gmm

    keys = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(keys[0], (m, k), dtype)
    dout = jax.random.normal(keys[2], (m, n), dtype)

    def fwd_bwd(f):
        def step(x, w):  # the output is returned too, or XLA drops the forward
            out, vjp = jax.vjp(f, x, w)
            return out, vjp(dout)
        return jax.jit(step)

    def timed(f, args):
        t_fwd = time_fn(jax.jit(f), args, iters)
        return t_fwd, (time_fn(fwd_bwd(f), args, iters) if backward else None)

    dense = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype)
    w_kn = jax.random.normal(keys[1], (k, n), dtype) / np.sqrt(k)
    rows = [("dense", "-", "-", *timed(dense, (lhs, w_kn)))]
    for groups in groups_list:
        rhs = jax.random.normal(keys[1], (groups, k, n), dtype) / np.sqrt(k)
        for how in splits:
            sizes = jnp.asarray(split_rows(m, groups, how))
            for backend in backends:
                f = lambda x, w, b=backend, s=sizes: gmm(x, w, s, backend=b, tiling=tiling)
                try:
                    t_fwd, t_bwd = timed(f, (lhs, rhs))
                except Exception as e:  # noqa: BLE001  (report and go on)
                    print(f"  ... {backend} G={groups} {how}: failed: {type(e).__name__}: {e}", file=sys.stderr)
                    t_fwd = t_bwd = None
                rows.append((backend, groups, how, t_fwd, t_bwd))
                if t_fwd is not None:
                    print(f"  ... {backend} G={groups} {how}: {t_fwd * 1e3:.1f} ms", file=sys.stderr)
    return rows


def print_rows(rows: list, flops: int, dense: tuple | None = None) -> None:
    """The table of :func:`measure`'s rows: forward and forward+backward (3x the forward's FLOPs)
    milliseconds and TFLOP/s per backend, group count and split; with ``dense`` (the dense backend's
    row) also each time as a percentage of the dense one. A failed backend says so (its error is on stderr)."""
    vs_dense = f" {'% dense':>7}" if dense else ""
    percent = lambda base, t: f" {100 * base / t:>6.0f}%" if base else ""
    print(f"{'backend':<11} {'G':>3} {'split':<7} {'fwd ms':>8} {'TFLOP/s':>8}{vs_dense} "
          f"{'fwd+bwd ms':>10} {'TFLOP/s':>8}{vs_dense}")
    for backend, groups, how, t_fwd, t_bwd in rows:
        if t_fwd is None:
            print(f"{backend:<11} {groups:>3} {how:<7} failed (see stderr)")
            continue
        fwd = f"{t_fwd * 1e3:>8.2f} {flops / t_fwd / 1e12:>8.4f}{percent(dense and dense[3], t_fwd)}"
        bwd = "" if t_bwd is None else (f" {t_bwd * 1e3:>10.2f} {3 * flops / t_bwd / 1e12:>8.4f}"
                                        f"{percent(dense and dense[4], t_bwd)}")
        print(f"{backend:<11} {groups:>3} {how:<7} {fwd}{bwd}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--groups", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--splits", nargs="+", default=["even", "skewed"], choices=["even", "skewed"])
    p.add_argument("--backends", nargs="+", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tm", type=int, default=None, help="row tile (tiling[0]); default per backend")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    args = p.parse_args(argv)

    from hypertron.kernels.gmm import DEFAULT_TILING, resolve_backend

    on_cpu = jax.default_backend() == "cpu"
    backends = args.backends or (["grouped", "ragged_dot"] if on_cpu else ["pallas", "ragged_dot"])
    m, k, n = args.m, args.k, args.n
    tiling = (args.tm, *DEFAULT_TILING[1:]) if args.tm else None
    rows = measure(m, k, n, args.groups, args.splits, backends, jnp.dtype(args.dtype), args.iters,
                   tiling=tiling, backward=not args.no_backward)

    flops = 2 * m * k * n
    dev = jax.devices()[0]
    print(f"grouped matmul  m={m} k={k} n={n}  {args.dtype}  ({flops / 1e9:.2f} GFLOP forward)")
    print_rows(rows, flops)
    print(f"auto backend here: {resolve_backend('auto')}; tiling: "
          f"{'tm=' + str(args.tm) if args.tm else f'defaults (pallas {DEFAULT_TILING})'}")
    print(f"device: {jax.device_count()} x {getattr(dev, 'device_kind', dev.platform)} "
          f"({platform.processor() or platform.machine()})")
    print(f"versions: python {platform.python_version()}, jax {jax.__version__}")
    print("command: python bench/gmm.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
