"""The serving engine: prefill, insert, generate and free over a paged KV cache (JetStream's API).

Device side, three jitted steps:

* :func:`prefill` runs one prompt (right-padded to a power-of-two bucket, so the
  number of compiled programs stays logarithmic in the prompt length) through the
  model with a contiguous cache, and samples its first token;
* :func:`insert` writes the prompt's K/V into the pages given to it;
* :func:`generate` is one decode step for every slot at once: each slot feeds its
  last token, writes its K/V into its pages, attends over its own pages only
  (:func:`hypertron.kernels.ragged_attention.ragged_decode_attention`) and samples
  its next token with its own temperature, top-k, top-p and seed.

The cache is donated to :func:`insert` and :func:`generate`, so it is updated in
place. Log-probabilities are of the model's distribution (before temperature,
top-k and top-p), as OpenAI's and vLLM's are; each step also returns the top
``max_top_logprobs``.

Host side, :class:`PagedEngine` keeps the slots and the page pool: a sequence
takes a page each time it crosses a page boundary and returns them all when it
ends, so cache memory follows the real lengths. Each step gets only the page-table
columns the longest live sequence needs (rounded up to a few sizes), so its attention cost
follows the real lengths too. Pages, slots and their small
per-slot arrays (page table, lengths, last tokens, sampling settings) live on the
host and travel with each step (a few KB); the cache never leaves the device.
Sampling is repeatable: the key of the token at position ``p`` is
``fold_in(key(seed), p)``, whatever else is in the batch.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config import ModelConfig
from hypertron.config.validation import check_engine_settings
from hypertron.models import forward_cached, forward_paged, init_cache, resolve_dtype
from hypertron.models.kv_pages import NULL_PAGE, init_pages, layer_page_table, pages_per_layer, write_tokens
from hypertron.serve.generate import filter_logits
from hypertron.serve.types import Prefix, SamplingParams, StepOutput, TokenLogprobs

MIN_BUCKET = 16


# ---------------------------------------------------------------------------
# Device steps


def sample_rows(logits_bv, temperature_b, top_k_b, top_p_b, seeds_b, positions_b) -> jax.Array:
    """Next token per row, each row with its own settings: greedy where ``temperature == 0``,
    else temperature, then top-k (0 = off), then top-p over what is left (1 = off)."""
    logits = logits_bv.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        scaled = logits / jnp.where(temperature_b > 0, temperature_b, 1.0)[:, None]
        masked = filter_logits(scaled, top_k_b, top_p_b)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds_b, positions_b)
        return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(temperature_b > 0), sampled, lambda _: greedy, None)
    return jnp.where(temperature_b > 0, drawn, greedy)


def _logprobs(logits_bv, tokens_b, n: int):
    logp = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens_b[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, n)
    return chosen, top_ids.astype(jnp.int32), top_lp


@functools.partial(jax.jit, static_argnames=("cfg", "top_n", "prompt_logprobs"))
def prefill(params, tokens_t, true_length, sampling_row, *, cfg: ModelConfig, top_n: int,
            prompt_logprobs: bool = False):
    """One prompt ``tokens_t [T]`` (right-padded; ``true_length`` real) -> its K/V and first token.

    ``sampling_row``: ``(temperature, top_k, top_p, seed)`` scalars. Returns ``(kv, first,
    first_logprobs, prompt)`` with ``kv = {"k", "v"} [layers, T, kv_heads, head_dim]`` and
    ``prompt`` the log-probabilities of tokens 1.. given the tokens before them (or None).
    """
    t = tokens_t.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    logits_1tv, cache = forward_cached(params, tokens_t[None], positions, init_cache(cfg, 1, t), cfg)
    last_v = jax.lax.dynamic_index_in_dim(logits_1tv[0], true_length - 1, keepdims=False)
    temperature, top_k, top_p, seed = sampling_row
    first = sample_rows(last_v[None], temperature[None], top_k[None], top_p[None], seed[None],
                        true_length[None])
    first_lp = _logprobs(last_v[None], first, top_n)
    prompt = _logprobs(logits_1tv[0, :-1], tokens_t[1:], top_n) if prompt_logprobs else None
    kv = {"k": cache["k"][:, 0], "v": cache["v"][:, 0]}
    return kv, first[0], jax.tree.map(lambda x: x[0], first_lp), prompt


@functools.partial(jax.jit, donate_argnums=0)
def insert(cache, kv, page_row, true_length):
    """Write a prefilled prompt's K/V (``[layers, T, ...]``) into the pages of ``page_row``.

    One scatter for all layers: layer ``l`` is row ``l`` of the batch, with its own page table.
    """
    layers, t = kv["k"].shape[:2]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (layers, t))
    tables = layer_page_table(page_row[None], jnp.arange(layers)[:, None], pages_per_layer(cache, layers))
    return write_tokens(cache, kv["k"], kv["v"], positions, tables, positions < true_length)


@functools.partial(jax.jit, static_argnames=("cfg", "top_n"), donate_argnums=1)
def generate(params, cache, tokens_b, lengths_b, page_table_bp, sampling, *, cfg: ModelConfig, top_n: int):
    """One decode step for every slot; ``lengths_b`` are the tokens cached (-1: empty slot).

    ``sampling``: ``(temperature, top_k, top_p, seed)`` arrays ``[slots]``. Returns
    ``(cache, next tokens, their log-probabilities, top ids, top log-probabilities)``.
    """
    logits_bv, cache = forward_paged(params, tokens_b, cache, page_table_bp, lengths_b, cfg)
    temperature, top_k, top_p, seed = sampling
    nxt = sample_rows(logits_bv, temperature, top_k, top_p, seed, lengths_b + 1)
    return (cache, nxt, *_logprobs(logits_bv, nxt, top_n))


# ---------------------------------------------------------------------------
# Host side: slots and pages


def _bucket(n: int, limit: int) -> int:
    return min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), max(limit, n))


class PagedEngine:
    """Slots and KV pages around the jitted steps; implements :class:`hypertron.serve.types.Engine`."""

    def __init__(self, params, cfg: ModelConfig, *, max_slots: int = 8, page_size: int = 16,
                 num_pages: int | None = None, kv_cache_dtype: str = "auto", max_top_logprobs: int = 20,
                 eos_ids: frozenset[int] = frozenset()):
        check_engine_settings(max_slots=max_slots, page_size=page_size, num_pages=num_pages,
                              kv_cache_dtype=kv_cache_dtype)
        self.params, self.cfg = params, cfg
        self.max_slots, self.page_size = max_slots, page_size
        self.max_seq_len, self.max_top_logprobs, self.eos_ids = cfg.max_seq_len, max_top_logprobs, frozenset(eos_ids)
        self.pages_per_seq = math.ceil(cfg.max_seq_len / page_size)
        num_pages = max_slots * self.pages_per_seq + 1 if num_pages is None else num_pages
        self.kv_dtype = resolve_dtype(cfg.dtype) if kv_cache_dtype == "auto" else jnp.dtype(kv_cache_dtype)
        self.cache = init_pages(cfg, num_pages, page_size, self.kv_dtype)
        self.num_pages = num_pages
        self._free_pages = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() hands out 1, 2, ...
        self._slot_pages: list[list[int]] = [[] for _ in range(max_slots)]
        self.page_table = np.full((max_slots, self.pages_per_seq), NULL_PAGE, np.int32)
        self.lengths = np.full(max_slots, -1, np.int32)  # tokens cached; -1: free slot
        self.last_tokens = np.zeros(max_slots, np.int32)
        self.temperature = np.zeros(max_slots, np.float32)
        self.top_k = np.zeros(max_slots, np.int32)
        self.top_p = np.ones(max_slots, np.float32)
        self.seeds = np.zeros(max_slots, np.uint32)

    # -- the Engine protocol

    def prefill(self, tokens: list[int], sampling: SamplingParams, want_prompt_logprobs: bool = False) -> Prefix:
        n = len(tokens)
        if not 0 < n < self.max_seq_len:
            raise ValueError(f"a prompt needs 1 to {self.max_seq_len - 1} tokens, got {n}")
        padded = np.zeros(_bucket(n, self.pages_per_seq * self.page_size), np.int32)
        padded[:n] = tokens
        row = _sampling_row(sampling)
        kv, first, first_lp, prompt = prefill(self.params, padded, np.int32(n), row, cfg=self.cfg,
                                              top_n=self.max_top_logprobs, prompt_logprobs=want_prompt_logprobs)
        first, first_lp = jax.device_get((first, first_lp))
        prompt_lps = None
        if prompt is not None:
            chosen, ids, lps = jax.device_get(prompt)
            prompt_lps = [_token_logprobs(chosen[i], ids[i], lps[i]) for i in range(n - 1)]
        return Prefix(list(tokens), sampling, int(first), _token_logprobs(*first_lp), prompt_lps,
                      {"kv": kv, "length": n})

    def can_insert(self, prefix: Prefix) -> bool:
        # Room for the prompt and the first decode step's write.
        return bool(self._free_slots()) and len(self._free_pages) >= self._pages_for(prefix.kv["length"] + 1)

    def insert(self, prefix: Prefix, slot: int) -> None:
        if self.lengths[slot] >= 0:
            raise ValueError(f"slot {slot} is in use")
        n = prefix.kv["length"]
        need = self._pages_for(n)
        if len(self._free_pages) < need:
            raise RuntimeError(f"{need} KV pages needed, {len(self._free_pages)} free")
        self._slot_pages[slot] = [self._free_pages.pop() for _ in range(need)]
        self.page_table[slot] = NULL_PAGE
        self.page_table[slot, :need] = self._slot_pages[slot]
        self.cache = insert(self.cache, prefix.kv["kv"], self.page_table[slot], np.int32(n))
        s = prefix.sampling
        self.lengths[slot], self.last_tokens[slot] = n, prefix.first_token
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = s.temperature, s.top_k, s.top_p
        self.seeds[slot] = np.uint32((s.seed or 0) & 0xFFFFFFFF)

    def reserve_step(self) -> list[int]:
        short = []
        for slot in np.flatnonzero(self.lengths >= 0):
            page = int(self.lengths[slot]) // self.page_size  # where this step writes
            if page >= self.pages_per_seq:
                raise RuntimeError(f"slot {slot} is at max_seq_len={self.max_seq_len}; it should have been freed")
            if page < len(self._slot_pages[slot]):
                continue
            if not self._free_pages:
                short.append(int(slot))
                continue
            self._slot_pages[slot].append(self._free_pages.pop())
            self.page_table[slot, page] = self._slot_pages[slot][-1]
        return short

    def generate(self) -> StepOutput:
        active = self.lengths >= 0
        sampling = (self.temperature, self.top_k, self.top_p, self.seeds)
        self.cache, *out = generate(self.params, self.cache, self.last_tokens, self.lengths,
                                    self.page_table[:, :self._table_width()], sampling, cfg=self.cfg,
                                    top_n=self.max_top_logprobs)
        tokens, logprobs, top_ids, top_lps = jax.device_get(out)
        self.last_tokens = np.where(active, tokens, 0).astype(np.int32)
        self.lengths = np.where(active, self.lengths + 1, -1).astype(np.int32)
        return StepOutput(tokens, logprobs, top_ids, top_lps)

    def free(self, slot: int) -> None:
        self._free_pages.extend(reversed(self._slot_pages[slot]))
        self._slot_pages[slot] = []
        self.page_table[slot] = NULL_PAGE
        self.lengths[slot] = -1

    def stats(self) -> dict[str, int]:
        return {"slots_in_use": int(np.sum(self.lengths >= 0)), "slots_total": self.max_slots,
                "pages_free": len(self._free_pages), "pages_total": self.num_pages - 1}

    # -- helpers

    def _free_slots(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(self.lengths < 0)]

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _table_width(self) -> int:
        """Page-table columns this step needs: enough for the longest slot after its write,
        rounded up to one of four steps per power of two (at most 25 % more than needed, and
        about 4 log2(pages_per_seq) compiled steps). Attention reads (the reference gathers)
        only these columns, so a step's cost follows the longest live sequence, not
        ``max_seq_len``."""
        longest = int(self.lengths.max()) + 1  # tokens after this step's write; 0 when all free
        return min(_round_up_quarter_octave(self._pages_for(max(longest, 1))), self.pages_per_seq)


def _round_up_quarter_octave(n: int) -> int:
    """``n`` rounded up to a multiple of a quarter of the power of two below it (1..8 exact)."""
    step = max(1, (1 << (n.bit_length() - 1)) // 4)
    return -(-n // step) * step


def _sampling_row(s: SamplingParams):
    return (np.float32(s.temperature), np.int32(s.top_k), np.float32(s.top_p),
            np.uint32((s.seed or 0) & 0xFFFFFFFF))


def _token_logprobs(chosen, ids, lps) -> TokenLogprobs:
    return TokenLogprobs(float(chosen), tuple(int(i) for i in ids), tuple(float(x) for x in lps))


def load_engine(checkpoint: str | Path, *, max_slots: int = 8, page_size: int = 16, num_pages: int | None = None,
                kv_cache_dtype: str = "auto", quantize: str = "none"):
    """``(engine, tokenizer, model_name)`` for a run directory (trained or converted from HF); the
    engine stops a sequence at any of the tokenizer's ``eos_ids``."""
    from hypertron.serve.model import load_model, served_name

    model, params, tok = load_model(checkpoint, quantize)
    engine = PagedEngine(params, model, max_slots=max_slots, page_size=page_size, num_pages=num_pages,
                         kv_cache_dtype=kv_cache_dtype, eos_ids=tok.eos_ids)
    return engine, tok, served_name(checkpoint)
