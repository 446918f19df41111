"""Simple batched generation with a KV cache: prefill once, then one jitted decode loop.

This is the plain generator behind ``hypertron generate`` and the parity tests;
the continuous-batching engine with a paged cache is a separate module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config import ModelConfig, choices
from hypertron.config.schema import WeightQuantization
from hypertron.models import cast_params, forward_cached, init_cache, quantize_params


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


def sample(logits_bv: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Next token ids [b] from logits [b, v]: greedy when ``temperature == 0``,
    else temperature, then top-k (0 = off), then nucleus top-p (1.0 = off)."""
    if temperature == 0.0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits = logits_bv.astype(jnp.float32) / temperature
    if 0 < top_k < logits.shape[-1] or top_p < 1.0:
        b = logits.shape[0]
        logits = filter_logits(logits, jnp.full((b,), top_k), jnp.full((b,), top_p, jnp.float32))
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "temperature", "top_k", "top_p"))
def _generate(params, tokens_bt, lengths_b, key, *, cfg, max_new_tokens, temperature, top_k, top_p):
    b, t = tokens_bt.shape
    cache = init_cache(cfg, b, t + max_new_tokens)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits_btv, cache = forward_cached(params, tokens_bt, positions, cache, cfg)
    last_bv = jnp.take_along_axis(logits_btv, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
    key, sub = jax.random.split(key)
    first = sample(last_bv, sub, temperature, top_k, top_p)

    def step(carry, _):
        cache, tok_b, pos_b, key = carry
        logits, cache = forward_cached(params, tok_b[:, None], pos_b[:, None], cache, cfg)
        key, sub = jax.random.split(key)
        nxt = sample(logits[:, 0], sub, temperature, top_k, top_p)
        return (cache, nxt, pos_b + 1, key), nxt

    _, rest = jax.lax.scan(step, (cache, first, lengths_b, key), None, length=max_new_tokens - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)  # [b, max_new_tokens]


def inference_config(cfg: ModelConfig) -> ModelConfig:
    """The model config generation and serving run: a model trained with quantised matmuls
    (``model.quantization``) computes in its compute dtype here, as fp8-trained models are
    usually served; weight quantisation for serving is ``--quantize``."""
    return dataclasses.replace(cfg, quantization="none")


def prepare_params(params, cfg: ModelConfig, quantize: str = "none"):
    """Parameters as generation uses them, cast once here rather than in every step: for ``"none"``
    the matmul and embedding weights in the compute dtype (``cfg.dtype``: bf16 on an accelerator),
    norms and the MoE router in float32 (:func:`hypertron.models.cast_params`); for ``"int8"`` every
    matmul weight int8 with per-output-channel scales (:func:`hypertron.models.quantize_params`,
    from the full-precision weights), about a quarter of float32's bytes."""
    if quantize == "none":
        return cast_params(params, cfg)
    if quantize == "int8":
        return cast_params(quantize_params(params, cfg), cfg)
    raise ValueError(f"quantize={quantize!r}: expected one of {', '.join(choices(WeightQuantization))}")


def _bucket(n: int, multiple: int = 16) -> int:
    """Round prompt lengths up so different prompts share compiled programs."""
    return max(multiple, -(-n // multiple) * multiple)


def generate(
    params,
    cfg: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_ids: Iterable[int] = (),
) -> list[list[int]]:
    """Continue each prompt (a list of token ids) by up to ``max_new_tokens`` tokens.

    Prompts of different lengths are batched together (right-padded). Returns
    the new tokens of each prompt, each cut after the first of ``eos_ids`` in it.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    lengths = np.array([len(p) for p in prompts], np.int32)
    t = _bucket(int(lengths.max()))
    if t + max_new_tokens > cfg.max_seq_len:
        t = int(lengths.max())
    tokens = np.zeros((len(prompts), t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    out = _generate(
        params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(seed), cfg=cfg,
        max_new_tokens=max_new_tokens, temperature=float(temperature), top_k=int(top_k),
        top_p=float(top_p),
    )
    stops, result = set(eos_ids), []
    for row in np.asarray(out).tolist():
        end = next((i for i, t in enumerate(row) if t in stops), None)
        result.append(row if end is None else row[: end + 1])
    return result
