"""Which form of an fp8 matmul XLA's GPU compiler runs as a cuBLAS Lt fp8 GEMM.

    python bench/fp8_probe.py     # one JSON line per (XLA flags, form): f8 GEMMs, f8 ops left, ms

At ``PROBE_N`` (default 8192) cubed, bf16 operands with per-tensor e4m3 scales, forward only:
``qdq`` (hypertron's ``fp8.qdq`` on each operand, then a bf16 einsum: quantise-dequantise, the
pattern XLA's GEMM rewriter is documented to fold), ``qdq_bf16_divide`` (the same, dividing in
bf16 as Flax's fp8 ops do), ``qdq_f32_dequant`` (dequantised in float32), and ``fp8_operands``
(the einsum of the e4m3 values, scales applied to its float32 result: what ``hypertron.quant.fp8``
does since 2026-11-26), beside a plain bf16 matmul. Each XLA flag set in its own process (XLA
reads ``XLA_FLAGS`` once): the default and ``--xla_allow_excess_precision=false``. The median
of 10 synced calls after one. Figures: docs/benchmarks.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

FLAGS = ["", "--xla_allow_excess_precision=false"]


def child() -> None:
    import jax
    import jax.numpy as jnp

    from gmm import time_fn  # bench/gmm.py: the median of synced calls after a warm-up
    from hypertron.quant import fp8

    e4 = fp8.E4M3
    m = fp8.fmt_max(e4)
    amax = lambda a: jnp.max(jnp.abs(a)).astype(jnp.float32)
    scale = lambda a: jnp.where(amax(a) > 0, amax(a) / m, 1.0)

    def bf16_divide(a, s):
        s = s.astype(a.dtype)
        return jnp.clip(a / s, -m, m).astype(e4).astype(a.dtype) * s

    def f32_dequant(a, s):
        return (jnp.clip(a.astype(jnp.float32) / s, -m, m).astype(e4).astype(jnp.float32) * s).astype(a.dtype)

    def qdq_form(q):
        return lambda x, w: jnp.einsum("ik,kj->ij", q(x, scale(x)), q(w, scale(w)), preferred_element_type=jnp.bfloat16)

    def fp8_operands(x, w):
        sx, sw = scale(x), scale(w)
        y = jnp.einsum("ik,kj->ij", fp8.quantize(x, e4, sx), fp8.quantize(w, e4, sw), preferred_element_type=jnp.float32)
        return (y * (sx * sw)).astype(jnp.bfloat16)

    forms = {"qdq": qdq_form(lambda a, s: fp8.qdq(a, e4, s)), "qdq_bf16_divide": qdq_form(bf16_divide),
             "qdq_f32_dequant": qdq_form(f32_dequant), "fp8_operands": fp8_operands,
             "bf16": lambda x, w: x @ w}
    n = int(os.environ.get("PROBE_N", "8192"))
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(kx, (n, n), jnp.bfloat16), jax.random.normal(kw, (n, n), jnp.bfloat16)
    for name, f in forms.items():
        fn = jax.jit(f)
        hlo = fn.lower(x, w).compile().as_text()
        print(json.dumps({"flags": os.environ.get("XLA_FLAGS", ""), "form": name, "n": n,
                          "f8_gemms": hlo.count("__cublas$lt$matmul$f8"), "f8e4m3_ops": hlo.count("f8e4m3fn"),
                          "ms": round(time_fn(fn, (x, w), 10) * 1e3, 3)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["child"]:
        child()
    else:
        for flags in FLAGS:
            env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
            subprocess.run([sys.executable, __file__, "child"], env=env, timeout=300, check=False)
