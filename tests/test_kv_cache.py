"""The KV caches of ``hypertron.models.kv_cache``: one forward for training, generation and serving.

A paged step's attention (decode tokens and chunks of prompts after cached prefixes, flat in
one row) equals attention without any cache, for random page tables, GQA and a sliding window,
with float and int8 pages, and so does the contiguous reference (``tests/support/contiguous_cache.py``);
the engine attends every row of a step (decode rows and whole prompts) in one call of the ragged
paged attention per layer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.contiguous_cache import ContiguousCache, init_cache  # tests/support

from hypertron.config import PRESETS, EngineConfig
from hypertron.models import PagedCache, forward, init_params
from hypertron.models.kv_pages import init_pages

BASE = dataclasses.replace(PRESETS["tiny"], num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=64,
                           mlp_dim=96, max_seq_len=64)


def _pages_with_nan(cfg, num_pages, page_size, dtype):
    """A pool whose every key is NaN and every value 1e6 (int8: 100 with NaN / 1e4 scales; a pool
    never holds a NaN value, ``write_tokens`` writes none): anything not written by this sequence
    that is read poisons the output, or weighed shows."""
    pages = init_pages(cfg, num_pages, page_size, dtype)
    poison = {"k": jnp.nan, "v": 1e6 if jnp.dtype(dtype) != jnp.int8 else 1e4}
    if jnp.dtype(dtype) == jnp.int8:
        return {k: (jnp.full_like(v, poison[k[0]]) if "scales" in k else jnp.full_like(v, 100)) for k, v in pages.items()}
    return {k: jnp.full_like(v, poison[k[0]]) for k, v in pages.items()}


def _step(params, cfg, pages, tokens_n, positions_n, rows_n, table, lengths):
    query_start = np.searchsorted(rows_n, np.arange(len(lengths) + 1))  # rows_n sorted: each row's first
    cache = PagedCache(pages, table, jnp.asarray(lengths, jnp.int32), jnp.asarray(query_start, jnp.int32),
                       jnp.asarray(rows_n, jnp.int32), jnp.ones(len(tokens_n), bool))
    return forward(params, jnp.asarray([tokens_n], jnp.int32), cfg, positions=jnp.asarray([positions_n], jnp.int32),
                   cache=cache)


@pytest.mark.slow
@pytest.mark.parametrize("window,kv_dtype,tol", [(None, "float32", 1e-5), (6, "float32", 1e-5), (None, "int8", 5e-2)])
def test_a_mixed_step_after_cached_prefixes_equals_attention_without_a_cache(window, kv_dtype, tol):
    """Three sequences' prefixes prefilled in one step; then one step in which the
    first decodes a token and the other two each take a chunk after their cached prefix (flat, in
    one row): the logits equal the model's without any cache, with random page tables over a pool
    whose every unwritten key is NaN and value 1e6."""
    cfg = dataclasses.replace(BASE, sliding_window=window)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(1)
    b, prefix, chunk, page_size, per_seq = 3, 11, 7, 4, 8
    num_pages = b * per_seq + 1
    tokens = rng.integers(3, cfg.vocab_size, (b, prefix + chunk))
    # Random, disjoint page tables over the pool (page 0 is the null page).
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages))[: b * per_seq].reshape(b, per_seq), jnp.int32)
    pages = _pages_with_nan(cfg, num_pages, page_size, kv_dtype)

    rows = np.repeat(np.arange(b), prefix)
    cache = _step(params, cfg, pages, tokens[:, :prefix].reshape(-1), np.tile(np.arange(prefix), b), rows, table,
                  [prefix] * b).cache
    flat = [tokens[0, prefix]] + list(tokens[1:, prefix:].reshape(-1))
    positions = [prefix] + list(np.tile(np.arange(prefix, prefix + chunk), b - 1))
    rows = [0] + list(np.repeat(np.arange(1, b), chunk))
    logits = _step(params, cfg, cache.pages, flat, positions, rows, table,
                   [prefix + 1] + [prefix + chunk] * (b - 1)).logits

    full = forward(params, jnp.asarray(tokens), cfg).logits
    want = jnp.concatenate([full[0, prefix:prefix + 1], full[1:, prefix:].reshape(-1, cfg.vocab_size)])
    assert np.isfinite(np.asarray(logits)).all()
    err = float(jnp.linalg.norm(logits[0] - want) / jnp.linalg.norm(want))
    assert err < tol, err
    # The contiguous cache gives the same, prefix then chunk.
    contiguous = init_cache(cfg, b, 32)
    contiguous = forward(params, jnp.asarray(tokens[:, :prefix]), cfg, cache=contiguous).cache
    positions = jnp.broadcast_to(jnp.arange(prefix, prefix + chunk, dtype=jnp.int32), (b, chunk))
    again = forward(params, jnp.asarray(tokens[:, prefix:]), cfg, positions=positions, cache=contiguous).logits
    np.testing.assert_allclose(again, full[:, prefix:], rtol=1e-5, atol=1e-5)
    assert isinstance(contiguous, ContiguousCache)


@pytest.mark.slow
def test_the_engine_attends_every_row_of_a_step_in_one_call_per_layer(monkeypatch):
    import hypertron.models.kv_cache as kv_cache
    from serving import run  # tests/

    from hypertron.serve.engine import PagedEngine
    from hypertron.serve.types import SamplingParams

    calls = []
    ragged = kv_cache.ragged_paged_attention

    def spy(*args, **kwargs):
        calls.append((args[0].shape, args[5].shape))  # queries, query_start
        return ragged(*args, **kwargs)

    monkeypatch.setattr(kv_cache, "ragged_paged_attention", spy)
    cfg = dataclasses.replace(BASE, num_layers=1, max_seq_len=48)  # a shape no other test compiles
    params = init_params(cfg, jax.random.key(2))
    engine = PagedEngine(params, cfg, EngineConfig(max_slots=2, page_size=8, compile="lazy"))
    prompts = [[5, 9, 33, 17, 2, 40, 41], [7, 8, 9, 10]]
    seqs, _, _ = run(engine, prompts, [SamplingParams(temperature=0.0, seed=0, max_tokens=4)] * 2)
    # Both prompts in one step (11 tokens padded to 16, the least, 2 rows), then decode steps of 2
    # rows: one call in each compiled step (one decode shape, the rows' lengths no dimension of it).
    assert calls == [((16, cfg.num_heads, cfg.head_dim), (3,)), ((2, cfg.num_heads, cfg.head_dim), (3,))]
    assert len(engine.compiled_shapes) == 2
    # What it wrote into the pages is what decoding reads: the next steps equal the full forward.
    for prompt, seq in zip(prompts, seqs):
        full = forward(params, jnp.asarray([prompt + seq.generated]), cfg).logits[0]
        assert seq.generated == [int(t) for t in jnp.argmax(full[len(prompt) - 1:-1], -1)]


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_value_that_is_not_finite_is_written_as_zero(dtype):
    """``write_tokens`` writes V's NaN and infinities as 0 (keys as they are): a pool never holds a
    NaN value, which the reference attention relies on when it reads past a row's end."""
    from hypertron.models.kv_pages import write_tokens

    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=1, num_kv_heads=2, head_dim=4)
    pages = init_pages(cfg, 3, 4, jnp.dtype(dtype))
    k = jnp.full((1, 2, 2, 4), jnp.nan).at[0, 1].set(1.0)
    v = jnp.array([[[[jnp.nan, jnp.inf, -jnp.inf, 2.0]] * 2, [[1.0, 1.0, 1.0, 1.0]] * 2]])
    out = write_tokens(pages, k, v, jnp.array([[0, 1]]), jnp.array([[1]]), jnp.array([[True, True]]))
    read = out["v_pages"][:, 1, :2].astype(jnp.float32)
    if dtype == "int8":
        read = read * out["v_scales"][:, 1, :2, None].astype(jnp.float32)
    np.testing.assert_allclose(read[:, 0], [[0, 0, 0, 2.0]] * 2, atol=2e-2)
    np.testing.assert_allclose(read[:, 1], [[1.0] * 4] * 2, atol=1e-2)
    if dtype == "float32":
        assert np.isnan(np.asarray(out["k_pages"][:, 1, 0])).all()
