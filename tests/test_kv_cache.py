"""The KV caches of ``hypertron.models.kv_cache``: one forward for training, generation and serving.

A paged cache's attention over queries of several tokens (a chunk of a prompt after a cached
prefix) equals attention without any cache, for random page tables, GQA and a sliding window,
with float and int8 pages; a cold prompt's prefill in the engine goes through the attention
function training uses and allocates no contiguous cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.config import PRESETS
from hypertron.models import ContiguousCache, PagedCache, forward, init_cache, init_params
from hypertron.models.kv_pages import init_pages

BASE = dataclasses.replace(PRESETS["tiny"], num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=64,
                           mlp_dim=96, max_seq_len=64)


def _pages_with_nan(cfg, num_pages, page_size, dtype):
    """A pool whose every entry is NaN (or a large int8 with NaN scales): a read of anything not
    written by this sequence poisons the output."""
    pages = init_pages(cfg, num_pages, page_size, dtype)
    if jnp.dtype(dtype) == jnp.int8:
        return {k: (jnp.full_like(v, jnp.nan) if "scales" in k else jnp.full_like(v, 100)) for k, v in pages.items()}
    return {k: jnp.full_like(v, jnp.nan) for k, v in pages.items()}


@pytest.mark.parametrize("window,kv_dtype,tol", [(None, "float32", 1e-5), (6, "float32", 1e-5), (None, "int8", 5e-2)])
def test_a_chunk_after_a_cached_prefix_equals_attention_without_a_cache(window, kv_dtype, tol):
    cfg = dataclasses.replace(BASE, sliding_window=window)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(1)
    b, prefix, chunk, page_size, per_seq = 3, 11, 7, 4, 8
    num_pages = b * per_seq + 1
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, prefix + chunk)), jnp.int32)
    # Random, disjoint page tables over the pool (page 0 is the null page).
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages))[: b * per_seq].reshape(b, per_seq), jnp.int32)
    pages = _pages_with_nan(cfg, num_pages, page_size, kv_dtype)

    cold = PagedCache(pages, table, jnp.full((b,), prefix, jnp.int32), cold=True)
    _, cache = forward(params, tokens[:, :prefix], cfg, cache=cold)
    warm = PagedCache(cache.pages, table, jnp.full((b,), prefix + chunk, jnp.int32))
    positions = jnp.broadcast_to(jnp.arange(prefix, prefix + chunk, dtype=jnp.int32), (b, chunk))
    logits, _ = forward(params, tokens[:, prefix:], cfg, positions=positions, cache=warm)

    want = forward(params, tokens, cfg)[:, prefix:]
    assert np.isfinite(np.asarray(logits)).all()
    err = float(jnp.linalg.norm(logits - want) / jnp.linalg.norm(want))
    assert err < tol, err
    # The contiguous cache gives the same, prefix then chunk.
    contiguous = init_cache(cfg, b, 32)
    _, contiguous = forward(params, tokens[:, :prefix], cfg, cache=contiguous)
    again, _ = forward(params, tokens[:, prefix:], cfg, positions=positions, cache=contiguous)
    np.testing.assert_allclose(again, want, rtol=1e-5, atol=1e-5)
    assert isinstance(contiguous, ContiguousCache)


def test_a_cold_prefill_uses_the_training_attention_and_no_contiguous_cache(monkeypatch):
    import hypertron.models.kv_cache as kv_cache
    from hypertron.serve.engine import PagedEngine
    from hypertron.serve.types import SamplingParams

    calls = []
    training_attention = kv_cache.self_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return training_attention(*args, **kwargs)

    def no_contiguous(*args, **kwargs):
        raise AssertionError("the serving path allocated a contiguous cache")

    monkeypatch.setattr(kv_cache, "self_attention", spy)
    monkeypatch.setattr(kv_cache.ContiguousCache, "init", no_contiguous)
    cfg = dataclasses.replace(BASE, num_layers=1, max_seq_len=48)  # a shape no other test compiles
    params = init_params(cfg, jax.random.key(2))
    engine = PagedEngine(params, cfg, max_slots=1, page_size=8)
    prompt = [5, 9, 33, 17, 2, 40, 41]
    prefix = engine.prefill(prompt, SamplingParams(temperature=0.0))
    assert calls == [(1, 16, cfg.num_heads, cfg.head_dim)]  # the prompt, padded to its bucket
    # What it wrote into the pages is what decoding reads: the next steps equal the full forward.
    engine.insert(prefix, 0)
    seq = prompt + [prefix.first_token]
    for _ in range(3):
        engine.reserve_step()
        seq.append(int(engine.generate().tokens[0]))
    full = forward(params, jnp.asarray([seq]), cfg)[0]
    assert seq[len(prompt):] == [int(t) for t in jnp.argmax(full[len(prompt) - 1:-1], -1)]
