"""Speculative decoding's device functions (``hypertron.serve.speculative``) against references:
the n-gram proposer against a loop in numpy on random histories; the acceptance rule against the
distribution it must give (a chi-square test of the emitted tokens against ``p``) and the
acceptance rate it must have (``sum(min(p, q))``; ``p(x)`` for an n-gram's one draft)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.serve.speculative import accept, ngram_propose

# The 0.999 quantile of the chi-square distribution with 5 degrees of freedom (6 tokens): a test
# at p-value 0.001, as scipy.stats.chi2.ppf(0.999, 5) gives it.
CHI2_5_999 = 20.515
DRAWS = 20_000


def _reference_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for j in range(len(tokens) - n - 1, -1, -1):
            if tokens[j:j + n] == suffix:
                return tokens[j + n:j + n + k]
    return []


@pytest.mark.parametrize("k, n_min, n_max", [(4, 2, 5), (1, 1, 3)])
def test_ngram_proposals_equal_a_loop_on_random_histories(k, n_min, n_max):
    rng = np.random.default_rng(k)
    rows, width = 256, 32
    history = rng.integers(0, 3, (rows, width)).astype(np.int32)  # 3 ids: matches are common
    lengths = rng.integers(0, width + 1, rows).astype(np.int32)
    draft, count = jax.device_get(ngram_propose(jnp.asarray(history), jnp.asarray(lengths), k=k, n_min=n_min,
                                                n_max=n_max))
    for r in range(rows):
        want = _reference_ngram(history[r, :lengths[r]].tolist(), k, n_min, n_max)
        assert (int(count[r]), draft[r, :count[r]].tolist()) == (len(want), want), (r, history[r, :lengths[r]])
    assert 0 < (count > 0).mean() < 1


def _chi2(tokens: np.ndarray, p: np.ndarray) -> float:
    seen = np.bincount(tokens, minlength=len(p))
    expected = p * len(tokens)
    return float(((seen - expected) ** 2 / expected).sum())


P = np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
Q = np.array([0.10, 0.20, 0.30, 0.05, 0.25, 0.10])


def _run(p, q, draft, count):
    rows, k = draft.shape
    fn = jax.jit(accept)
    tokens, emitted = fn(jnp.asarray(np.broadcast_to(p, (rows, k + 1, len(p))), jnp.float32),
                         jnp.asarray(np.broadcast_to(q, (rows, k, len(p))) if q.ndim == 1 else q, jnp.float32),
                         jnp.asarray(draft, jnp.int32), jnp.asarray(count, jnp.int32),
                         jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32))
    return np.asarray(tokens), np.asarray(emitted)


def test_emitted_tokens_are_distributed_as_the_model_and_drafts_kept_at_sum_min_p_q():
    """20,000 rows of one step, k = 2 drafts drawn from q: the first emitted token, and the second
    where there is one, pass a chi-square test against p; the first draft is kept at sum(min(p, q))."""
    rng = np.random.default_rng(0)
    draft = rng.choice(len(Q), size=(DRAWS, 2), p=Q)
    tokens, emitted = _run(P, Q, draft, np.full(DRAWS, 2))
    assert _chi2(tokens[:, 0], P) < CHI2_5_999
    second = emitted >= 2
    assert _chi2(tokens[second, 1], P) < CHI2_5_999
    kept = (emitted >= 2).mean()
    assert abs(kept - np.minimum(P, Q).sum()) < 5 * np.sqrt(kept * (1 - kept) / DRAWS)
    assert set(np.unique(emitted)) == {1, 2, 3}
    assert np.array_equal(tokens[emitted >= 2, 0], draft[emitted >= 2, 0])  # a kept draft is emitted as drafted


def test_an_ngram_draft_is_kept_at_p_of_it_and_a_greedy_row_keeps_drafts_equal_to_its_argmax():
    draft = np.full((DRAWS, 1), 2)
    tokens, emitted = _run(P, np.eye(len(P))[2], draft, np.ones(DRAWS, np.int32))
    kept = (emitted == 2).mean()
    assert abs(kept - P[2]) < 5 * np.sqrt(kept * (1 - kept) / DRAWS)
    assert _chi2(tokens[:, 0], P) < CHI2_5_999
    greedy = np.eye(len(P))[0]
    drafts = np.array([[0, 0, 3], [0, 4, 0], [5, 0, 0], [0, 0, 0]])
    tokens, emitted = _run(greedy, np.eye(len(P))[drafts], drafts, np.array([3, 3, 3, 2]))
    assert emitted.tolist() == [3, 2, 1, 3] and (tokens[np.arange(4), emitted - 1] == 0).all()
    assert not tokens[3, :3].any()  # two drafts kept, then the bonus: the argmax again
