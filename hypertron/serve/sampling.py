"""Sampling the next token: one sampler for ``hypertron generate`` and the server.

Each row has its own temperature, top-k, top-p and seed; the key of the token at position ``p``
is ``fold_in(key(seed), p)``, so a seeded request gives the same tokens whatever else is in the
batch. Log-probabilities are of the model's distribution (before temperature, top-k and top-p),
as OpenAI's and vLLM's are.

Speculative decoding keeps an n-gram's proposed tokens by :func:`verify_proposal`: each place
draws its token as :func:`sample_rows` would there (the same key: the tokens of a seeded request
are those it gets without speculation), and the proposal is kept while it equals the draws. For a
proposal that is a point mass (an n-gram's) that is the rejection rule: x is kept with probability
p(x), and at the first it is not the token is a draw from p without x. A draft model's proposal
(a distribution q) needs the general rule, :func:`accept` (Leviathan et al. 2023; Chen et al.
2023): draft token ``x_i`` is kept with probability ``min(1, p_i(x) / q_i(x))`` (``p`` after
temperature, top-k and top-p), at the first rejection the token is drawn from ``max(p_i - q_i,
0)`` normalised, and after every draft is kept a bonus token from ``p``; so
each emitted token is distributed as ``p`` at its place. It is not in the engine yet (no draft
model is built).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits_bv: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array) -> jax.Array:
    """Each row's logits with everything outside its top-k (0 = off), then outside the smallest
    prefix whose probability mass reaches its top-p (1.0 = off), set to -inf."""
    v = logits_bv.shape[-1]
    desc = -jnp.sort(-logits_bv, axis=-1)
    k = jnp.where((top_k_b > 0) & (top_k_b < v), top_k_b, v)
    in_k = jnp.arange(v)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    # A token stays if the mass before it is < top_p, so the most likely one always stays.
    keep = in_k & ((jnp.cumsum(probs, axis=-1) - probs) < top_p_b[:, None])
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits_bv < cutoff, -jnp.inf, logits_bv)


def sample_rows(logits_bv, temperature_b, top_k_b, top_p_b, seeds_b, positions_b, *,
                skip_greedy: bool = True) -> jax.Array:
    """Next token per row, each row with its own settings: greedy where ``temperature == 0``,
    else temperature, then top-k (0 = off), then top-p over what is left (1 = off).

    The draw sorts each row's vocabulary. ``skip_greedy``: a conditional on the device skips it
    when no row samples. Not on a GPU (:class:`~hypertron.serve.engine.PagedEngine` passes
    False there): XLA's GPU runtime reads a conditional's predicate back to the host, so the
    thread that launched the step waits for its whole forward pass, and the host's work for the
    next step can no longer overlap this one's (H200, ``llama-1b``, batch 1: a serving-loop turn
    of 5.05 ms with the conditional, 2.83 ms without; docs/benchmarks.md). There every step
    draws, and greedy rows keep their argmax: the same tokens either way."""
    logits = logits_bv.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        scaled = logits / jnp.where(temperature_b > 0, temperature_b, 1.0)[:, None]
        masked = filter_logits(scaled, top_k_b, top_p_b)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds_b, positions_b)
        return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)

    if skip_greedy:
        drawn = jax.lax.cond(jnp.any(temperature_b > 0), sampled, lambda _: greedy, None)
    else:
        drawn = sampled(None)
    return jnp.where(temperature_b > 0, drawn, greedy)


def logprobs(logits_bv, tokens_b, n: int):
    """``(log-probability of tokens_b, top-n ids, their log-probabilities)`` per row."""
    logp = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens_b[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, n)
    return chosen, top_ids.astype(jnp.int32), top_lp


def verify_proposal(logits, temperature_b, top_k_b, top_p_b, seeds_b, positions_b, proposal, count, *,
                    skip_greedy: bool = True):
    """The tokens a row with a proposal emits: ``logits [rows, k + 1, vocab]`` at its last token and
    each proposed one, ``proposal [rows, k]`` (its first ``count [rows]`` real), each row's sampling
    settings and ``positions [rows]`` (where its first new token goes). Each place draws as
    :func:`sample_rows` does at its position; the proposal is kept while it equals the draws.
    Returns ``(tokens [rows, k + 1], emitted [rows])``: the first ``emitted`` (1 to ``count + 1``)
    of the draws are the row's new tokens."""
    rows, places, vocab = logits.shape
    per_place = lambda x: jnp.repeat(x, places)  # noqa: E731
    drawn = sample_rows(logits.reshape(-1, vocab), per_place(temperature_b), per_place(top_k_b), per_place(top_p_b),
                        per_place(seeds_b), (positions_b[:, None] + jnp.arange(places)).reshape(-1),
                        skip_greedy=skip_greedy).reshape(rows, places)
    same = (proposal == drawn[:, :-1]) & (jnp.arange(places - 1) < count[:, None])
    return drawn, jnp.argmin(jnp.concatenate([same, jnp.zeros((rows, 1), bool)], axis=1), axis=1) + 1


def accept(p, q, draft, count, seeds, positions):
    """The tokens a row with a draft model's proposal emits: ``p [rows, k + 1, vocab]`` the
    model's probabilities (after temperature, top-k and top-p) at each draft's place and the one
    after, ``q [rows, k, vocab]`` the draft's, ``draft [rows, k]``, ``count [rows]`` drafted tokens (the rest is padding), ``seeds [rows]`` (uint32) and
    ``positions [rows]`` (the first emitted token's place). Returns ``(tokens [rows, k + 1],
    emitted [rows])``: the first ``emitted`` (1 to ``count + 1``) are the row's new tokens."""
    return jax.vmap(_accept_row)(p, q, draft, count, seeds, positions)


def _accept_row(p, q, draft, count, seed, position):
    k = draft.shape[0]
    key = jax.random.key(seed)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, position + i))(jnp.arange(k + 1))
    u = jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 0)))(keys[:k])
    p_x = jnp.take_along_axis(p[:k], draft[:, None], axis=1)[:, 0]
    q_x = jnp.take_along_axis(q, draft[:, None], axis=1)[:, 0]
    kept = (u * q_x < p_x) & (jnp.arange(k) < count)  # u < p / q, without dividing by a zero q
    at = jnp.argmin(jnp.concatenate([kept, jnp.zeros(1, bool)]))  # the leading drafts kept
    residual = jnp.maximum(p[at] - jnp.where(at < count, q[jnp.minimum(at, k - 1)], 0.0), 0.0)
    residual = jnp.where(residual.sum() > 0, residual, p[at])  # p == q there: any draw from p
    last = jax.random.categorical(jax.random.fold_in(keys[at], 1), jnp.log(residual))
    tokens = jnp.where(jnp.arange(k + 1) < at, jnp.concatenate([draft, jnp.zeros(1, draft.dtype)]), 0)
    return tokens.at[at].set(last.astype(tokens.dtype)), at + 1
