"""Speculative decoding's two device functions: n-gram lookup over the token history, and the
rule that keeps a draft's tokens so that what is emitted is distributed as the model's own samples.

Not wired into the engine yet (issue 45 item 3): these are its parts, each held to a reference in
``tests/test_speculative.py``.

:func:`ngram_propose` (prompt lookup, as vLLM's ``ngram`` method): for each row, the latest earlier
place where its last ``n`` tokens occurred, ``n`` from ``n_max`` down to ``n_min`` (the longest
match wins), proposes up to ``k`` of the tokens that followed it. It reads the slots' token
history (``PagedEngine.state["history"]``) on the device, so no token goes to the host for it.

:func:`accept` (Leviathan et al. 2023; Chen et al. 2023): draft token ``x_i`` (drawn from ``q_i``)
is kept with probability ``min(1, p_i(x) / q_i(x))``, ``p_i`` the model's distribution at that
place (after temperature, top-k and top-p); at the first rejection the token is drawn from
``max(p_i - q_i, 0)`` normalised, and after ``k`` acceptances a bonus token from ``p_k``. So each
emitted token is distributed as ``p`` at its place, and with ``q`` a point mass (an n-gram's draft)
a draft token is kept with probability ``p(x)``. A greedy row's ``p`` is the one-hot of its argmax:
drafts are kept while they equal it. Random numbers come from the row's seed and the position
(``fold_in(key(seed), position)``, as :mod:`hypertron.serve.sampling`'s), so a seeded request gets
the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("k", "n_min", "n_max"))
def ngram_propose(history, lengths, *, k: int, n_min: int, n_max: int):
    """``(draft [rows, k], count [rows])`` from ``history [rows, width]`` (row ``r``'s tokens are
    ``history[r, :lengths[r]]``): for ``n`` from ``n_max`` down to ``n_min``, the latest ``j`` with
    ``history[r, j:j + n]`` equal to the last ``n`` tokens and ``j + n < lengths[r]`` (an earlier
    place, with a token after it); the draft is the up to ``k`` tokens from ``j + n`` on, before
    ``lengths[r]``. ``count`` 0 (and a draft of zeros) where no ``n`` matches."""
    rows, width = history.shape
    pos = jnp.arange(width)
    best_j = jnp.full(rows, -1)
    best_n = jnp.zeros(rows, jnp.int32)
    for n in range(n_max, n_min - 1, -1):
        # match[r, j]: history[r, j + i] == history[r, lengths - n + i] for every i < n
        match = (pos[None, :] + n < lengths[:, None]) & (lengths[:, None] >= n + 1)
        for i in range(n):
            suffix = jnp.take_along_axis(history, jnp.maximum(lengths - n + i, 0)[:, None], axis=1)
            shifted = jnp.take_along_axis(history, jnp.minimum(pos + i, width - 1)[None, :].repeat(rows, 0), axis=1)
            match &= shifted == suffix
        j = jnp.max(jnp.where(match, pos[None, :], -1), axis=1)
        take = (best_j < 0) & (j >= 0)
        best_j, best_n = jnp.where(take, j, best_j), jnp.where(take, n, best_n)
    start = best_j + best_n
    count = jnp.where(best_j >= 0, jnp.clip(lengths - start, 0, k), 0)
    idx = jnp.clip(start[:, None] + jnp.arange(k)[None, :], 0, width - 1)
    draft = jnp.where(jnp.arange(k)[None, :] < count[:, None], jnp.take_along_axis(history, idx, axis=1), 0)
    return draft, count


def accept(p, q, draft, count, seeds, positions):
    """The emitted tokens of one speculative step per row: ``p [rows, k + 1, vocab]`` the model's
    probabilities at each draft place and the one after, ``q [rows, k, vocab]`` the draft's (a
    one-hot row for an n-gram's), ``draft [rows, k]``, ``count [rows]`` drafted tokens (the rest is
    padding), ``seeds [rows]`` (uint32) and ``positions [rows]`` (the first emitted token's
    place). Returns ``(tokens [rows, k + 1], emitted [rows])``: the first ``emitted`` (1 to
    ``count + 1``) are the row's new tokens."""
    return jax.vmap(_accept_row)(p, q, draft, count, seeds, positions)


def _accept_row(p, q, draft, count, seed, position):
    k = draft.shape[0]
    key = jax.random.key(seed)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, position + i))(jnp.arange(k + 1))
    u = jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 0)))(keys[:k])
    p_x = jnp.take_along_axis(p[:k], draft[:, None], axis=1)[:, 0]
    q_x = jnp.take_along_axis(q, draft[:, None], axis=1)[:, 0]
    kept = (u * q_x < p_x) & (jnp.arange(k) < count)  # u < p / q, without dividing by a zero q
    first_rejected = jnp.argmin(jnp.concatenate([kept, jnp.zeros(1, bool)]))  # count of leading acceptances
    at = jnp.minimum(first_rejected, k)
    residual = jnp.maximum(p[at] - jnp.where(at < count, q[jnp.minimum(at, k - 1)], 0.0), 0.0)
    residual = jnp.where(residual.sum() > 0, residual, p[at])  # p == q there: any draw from p
    last = jax.random.categorical(jax.random.fold_in(keys[at], 1), jnp.log(residual))
    tokens = jnp.where(jnp.arange(k + 1) < at, jnp.concatenate([draft, jnp.zeros(1, draft.dtype)]), 0)
    tokens = tokens.at[at].set(last.astype(tokens.dtype))
    return tokens, at + 1
