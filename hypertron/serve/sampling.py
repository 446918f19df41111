"""Sampling the next token: one sampler for ``hypertron generate`` and the server.

Each row has its own temperature, top-k, top-p and seed; the key of the token at position ``p``
is ``fold_in(key(seed), p)``, so a seeded request gives the same tokens whatever else is in the
batch. Log-probabilities are of the model's distribution (before temperature, top-k and top-p),
as OpenAI's and vLLM's are.
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
