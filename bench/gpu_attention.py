"""The GPU campaign's attention rows (``bench/gpu_campaign.py`` T2): the ragged decode kernel, one
mixed serving step through ``ragged_paged_attention`` and cuDNN, and the shapes cuDNN's fused
attention takes. Each row function takes the tier's ``Ctx`` (``bench/gpu_measure.py``) and returns
its fields."""

from __future__ import annotations

from gpu_measure import measured_peaks  # bench/gpu_measure.py: the measured ceilings


RAGGED_FIELDS = ("backend", "batch", "max_context", "heads", "kv_heads", "head_dim", "page_size", "ms", "kv_bytes",
                 "bw_fraction_measured")


def ragged_row(backend: str):
    """The decode-attention kernel alone: ``batch`` sequences of lengths between half the context
    and all of it, bf16 pages; bytes = the K and V of every token attended to."""

    def run(ctx):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from gmm import time_fn  # bench/gmm.py
        from hypertron.kernels.ragged_attention import ragged_decode_attention

        b, ctx_len, h, kv, hd, ps = ctx.s.ragged
        rng = np.random.default_rng(0)
        lengths = rng.integers(ctx_len // 2, ctx_len + 1, b).astype(np.int32)
        per_seq = -(-ctx_len // ps)
        table = rng.permutation(b * per_seq).reshape(b, per_seq).astype(np.int32)
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (b, h, hd), jnp.bfloat16)
        k_pages = jax.random.normal(keys[1], (kv, b * per_seq, ps, hd), jnp.bfloat16)
        v_pages = jax.random.normal(keys[2], (kv, b * per_seq, ps, hd), jnp.bfloat16)
        f = jax.jit(lambda q, k, v, ln, t: ragged_decode_attention(q, k, v, ln, t, backend=backend))
        t = time_fn(f, (q, k_pages, v_pages, jnp.asarray(lengths), jnp.asarray(table)), ctx.s.iters)
        kv_bytes = int(lengths.sum()) * kv * hd * 2 * 2
        return {"backend": backend, "batch": b, "max_context": ctx_len, "heads": h, "kv_heads": kv, "head_dim": hd,
                "page_size": ps, "ms": t * 1e3, "kv_bytes": kv_bytes,
                "bw_fraction_measured": kv_bytes / t / measured_peaks(ctx)["bw"]}
    return run


PAGED_FIELDS = ("backend", "kv", "decode_rows", "chunk", "context", "heads", "kv_heads", "head_dim", "page_size",
                "ms", "rel_err", "vs_reference")


def _paged_case(ctx, kv: str):
    """The mixed step's inputs, made once per KV format: ``decode_rows`` rows of one query and one
    row of ``chunk`` queries, each row ``context`` tokens long, its pages scattered at random."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hypertron.kernels.ragged_attention import quantize_kv

    key = f"paged_{kv}"
    if key not in ctx.keep:
        d, chunk, context, h, kvh, hd, ps = ctx.s.paged
        rows, per_row = d + 1, -(-context // ps)
        rng = np.random.default_rng(0)
        table = 1 + rng.permutation(rows * per_row).reshape(rows, per_row).astype(np.int32)  # page 0: null
        keys = jax.random.split(jax.random.key(1), 3)
        q = jax.random.normal(keys[0], (d + chunk, h, hd), jnp.bfloat16)
        k, v = (jax.random.normal(kk, (kvh, rows * per_row + 1, ps, hd), jnp.bfloat16) for kk in keys[1:])
        scales = {}
        if kv == "int8":
            (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
            scales = {"k_scales": ks, "v_scales": vs}
        kv_lens = jnp.full((rows,), context, jnp.int32)
        query_start = jnp.asarray(np.r_[np.arange(rows), d + chunk], jnp.int32)
        ctx.keep[key] = (q, k, v, kv_lens, jnp.asarray(table), query_start, scales)
    return ctx.keep[key]


def _cudnn_paged(q, k_pages, v_pages, kv_lens, table, query_start, *, decode_rows, k_scales=None, v_scales=None,
                 implementation="cudnn"):
    """The same step through cuDNN's fused attention: each row's pages gathered into a dense
    [rows, context] K and V (int8 pages dequantised in the gather), the decode rows as one batch
    (each query twice: cuDNN wants an even length) with their KV lengths, the chunk with an explicit
    bottom-right causal mask (cuDNN's causal flag aligns top-left). ``implementation="xla"`` in
    smoke mode (no cuDNN on a CPU)."""
    import jax
    import jax.numpy as jnp

    def dense(pages, scales):
        x = pages[:, table].astype(jnp.bfloat16)  # [kv, rows, pages, page, hd]
        if scales is not None:
            x = x * scales[:, table][..., None].astype(jnp.bfloat16)
        kv, rows, n, ps, hd = x.shape
        return x.transpose(1, 2, 3, 0, 4).reshape(rows, n * ps, kv, hd)

    k, v = dense(k_pages, k_scales), dense(v_pages, v_scales)
    qd = jnp.repeat(q[:decode_rows, None], 2, axis=1)  # [rows, 2, heads, hd]
    out_d = jax.nn.dot_product_attention(qd, k[:decode_rows], v[:decode_rows],
                                         key_value_seq_lengths=kv_lens[:decode_rows],
                                         implementation=implementation)[:, 0]
    qc = q[decode_rows:][None]
    chunk, context = qc.shape[1], k.shape[1]
    mask = (jnp.arange(context)[None, :] <= (context - chunk + jnp.arange(chunk))[:, None])[None, None]
    out_c = jax.nn.dot_product_attention(qc, k[decode_rows:], v[decode_rows:], mask=mask,
                                         implementation=implementation)[0]
    return jnp.concatenate([out_d, out_c])


def paged_row(backend: str, kv: str):
    """One mixed serving step's attention at ``llama-1b``'s heads (issue 38): ``ragged_paged_attention``
    by ``backend`` ("pallas", "reference") or the dense cuDNN path (``_cudnn_paged``), bf16 or int8
    pages. ``rel_err``: against the reference backend on float32 queries and pages; ``vs_reference``:
    the reference row's time over this one's (> 1: faster), once that row has run."""

    def run(ctx):
        import functools

        import jax
        import jax.numpy as jnp

        from gmm import time_fn  # bench/gmm.py
        from hypertron.kernels.ragged_paged_attention import ragged_paged_attention

        d, chunk, context, h, kvh, hd, ps = ctx.s.paged
        q, k, v, kv_lens, table, query_start, scales = _paged_case(ctx, kv)
        if backend == "cudnn":
            f = jax.jit(functools.partial(_cudnn_paged, decode_rows=d,
                                          implementation="xla" if ctx.smoke else "cudnn"))
        else:
            f = jax.jit(functools.partial(ragged_paged_attention, backend=backend))
        args = (q, k, v, kv_lens, table, query_start)
        t = time_fn(lambda *a: f(*a, **scales), args, ctx.s.iters)
        got = f(*args, **scales).astype(jnp.float32)
        f32 = (lambda x: x.astype(jnp.float32)) if kv == "bfloat16" else (lambda x: x)
        want = jax.jit(functools.partial(ragged_paged_attention, backend="reference"))(
            q.astype(jnp.float32), f32(k), f32(v), kv_lens, table, query_start, **scales)
        rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        ctx.keep.setdefault("paged_ms", {})[(backend, kv)] = t * 1e3
        ref = ctx.keep["paged_ms"].get(("reference", kv))
        return {"backend": backend, "kv": kv, "decode_rows": d, "chunk": chunk, "context": context, "heads": h,
                "kv_heads": kvh, "head_dim": hd, "page_size": ps, "ms": t * 1e3, "rel_err": rel,
                "vs_reference": ref / (t * 1e3) if ref else None}
    return run


CUDNN_FIELDS = ("cases", "accepted", "refused", "rule_wrong")


def cudnn_grid_row(ctx):
    """Which shapes cuDNN's fused attention takes (issue 37), against ``cudnn_supported``: each case
    of :attr:`Sizes.cudnn_grid` (and float32 once) compiled and run, causal, forward and gradients,
    GQA 4 query heads on 2 KV heads. ``rule_wrong``: the cases where the rule and cuDNN disagree."""
    import dataclasses as dc

    import jax
    import jax.numpy as jnp

    from hypertron.config import load_config
    from hypertron.models.attention import cudnn_supported

    base = load_config(None, ["model=tiny"]).model
    dtypes, dims, seqs = ctx.s.cudnn_grid
    cases = [(dt, hd, n) for dt in dtypes for hd in dims for n in seqs] + [("float32", dims[0], seqs[0])]
    accepted, refused, wrong = [], [], []
    for dt, hd, n in cases:
        keys = jax.random.split(jax.random.key(hd * n), 3)
        q = jax.random.normal(keys[0], (1, n, 4, hd), dt)
        k, v = (jax.random.normal(kk, (1, n, 2, hd), dt) for kk in keys[1:])

        def loss(q, k, v):
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            return jnp.sum(out.astype(jnp.float32) ** 2)

        name = f"{dt} hd{hd} seq{n}"
        try:
            jax.block_until_ready(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v))
            ok, why = True, ""
            accepted.append(name)
        except Exception as e:  # noqa: BLE001  (a refusal is the finding)
            ok, why = False, (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
            refused.append(f"{name}: {why}")
        rule = cudnn_supported(dc.replace(base, head_dim=hd), jnp.dtype(dt), n)
        if rule != ok:
            wrong.append(f"{name}: rule {rule}, cuDNN {ok}")
    return {"cases": len(cases), "accepted": accepted, "refused": refused, "rule_wrong": wrong}
