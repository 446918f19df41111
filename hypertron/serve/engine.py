"""The serving engine: prefill, insert, generate and free over a paged KV cache (JetStream's API).

Device side, two jitted steps:

* :func:`prefill` runs one prompt (right-padded to a power-of-two bucket, so the
  number of compiled programs stays logarithmic in the prompt length) through the
  model, writing its K/V straight into the pages taken for it and attending as
  training does (cuDNN flash attention on GPU), and samples its first token;
  :meth:`PagedEngine.insert` then hands those pages to a slot (no device work);
* :func:`generate` is one decode step for every slot at once: each slot feeds its
  last token, writes its K/V into its pages, attends over its own pages only
  (:func:`hypertron.kernels.ragged_attention.ragged_decode_attention`) and samples
  its next token with its own temperature, top-k, top-p and seed.

The cache is donated to :func:`prefill` and :func:`generate`, so it is updated in
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
from hypertron.models import PagedCache, forward, resolve_dtype
from hypertron.models.kv_pages import NULL_PAGE, init_pages
from hypertron.serve.sampling import logprobs, sample_rows
from hypertron.serve.types import Prefix, SamplingParams, StepOutput, TokenLogprobs

MIN_BUCKET = 16


# ---------------------------------------------------------------------------
# Device steps


@functools.partial(jax.jit, static_argnames=("cfg", "top_n", "prompt_logprobs"), donate_argnums=1)
def prefill(params, cache, tokens_t, true_length, page_row, sampling_row, *, cfg: ModelConfig, top_n: int,
            prompt_logprobs: bool = False):
    """One prompt ``tokens_t [T]`` (right-padded; ``true_length`` real) through the model: its
    keys and values go straight into the pages of ``page_row`` (layer 0's numbering), and it
    attends as training does (a cold prompt: :class:`~hypertron.models.PagedCache`).

    ``sampling_row``: ``(temperature, top_k, top_p, seed)`` scalars. Returns ``(cache, first,
    first_logprobs, prompt)``, ``prompt`` the log-probabilities of tokens 1.. given the tokens
    before them (or None).
    """
    paged = PagedCache(cache, page_row[None], true_length[None], cold=True)
    logits_1tv, paged = forward(params, tokens_t[None], cfg, cache=paged)
    last_v = jax.lax.dynamic_index_in_dim(logits_1tv[0], true_length - 1, keepdims=False)
    temperature, top_k, top_p, seed = sampling_row
    first = sample_rows(last_v[None], temperature[None], top_k[None], top_p[None], seed[None],
                        true_length[None])
    first_lp = logprobs(last_v[None], first, top_n)
    prompt = logprobs(logits_1tv[0, :-1], tokens_t[1:], top_n) if prompt_logprobs else None
    return paged.pages, first[0], jax.tree.map(lambda x: x[0], first_lp), prompt


@functools.partial(jax.jit, static_argnames=("cfg", "top_n"), donate_argnums=1)
def generate(params, cache, tokens_b, lengths_b, page_table_bp, sampling, *, cfg: ModelConfig, top_n: int):
    """One decode step for every slot; ``lengths_b`` are the tokens cached (-1: empty slot).

    Token ``tokens_b[i]`` sits at position ``lengths_b[i]``; its K/V are written there and it
    attends to the ``lengths_b[i] + 1`` tokens of its pages (an empty slot reads nothing and
    writes to the null page). ``sampling``: ``(temperature, top_k, top_p, seed)`` arrays
    ``[slots]``. Returns ``(cache, next tokens, their log-probabilities, top ids, top
    log-probabilities)``.
    """
    logits_bv, cache = decode_logits(params, cache, tokens_b, lengths_b, page_table_bp, cfg)
    temperature, top_k, top_p, seed = sampling
    nxt = sample_rows(logits_bv, temperature, top_k, top_p, seed, lengths_b + 1)
    return (cache, nxt, *logprobs(logits_bv, nxt, top_n))


def decode_logits(params, cache, tokens_b, lengths_b, page_table_bp, cfg: ModelConfig):
    """``(logits [b, vocab], cache)`` of one decode step, as :func:`generate` runs it (not jitted)."""
    lengths_b = jnp.asarray(lengths_b)
    paged = PagedCache(cache, jnp.asarray(page_table_bp), jnp.where(lengths_b >= 0, lengths_b + 1, 0))
    logits_b1v, paged = forward(params, jnp.asarray(tokens_b)[:, None], cfg,
                                positions=jnp.maximum(lengths_b, 0)[:, None], cache=paged)
    return logits_b1v[:, 0], paged.pages


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

    def can_prefill(self, num_tokens: int) -> bool:
        """Whether pages are free for a prompt of ``num_tokens`` and its first decode write."""
        return len(self._free_pages) >= self._pages_for(num_tokens + 1)

    def prefill(self, tokens: list[int], sampling: SamplingParams, want_prompt_logprobs: bool = False) -> Prefix:
        n = len(tokens)
        if not 0 < n < self.max_seq_len:
            raise ValueError(f"a prompt needs 1 to {self.max_seq_len - 1} tokens, got {n}")
        if not self.can_prefill(n):
            raise RuntimeError(f"{self._pages_for(n + 1)} KV pages needed, {len(self._free_pages)} free "
                               "(ask can_prefill first)")
        pages = [self._free_pages.pop() for _ in range(self._pages_for(n))]
        page_row = np.full(self.pages_per_seq, NULL_PAGE, np.int32)
        page_row[:len(pages)] = pages
        padded = np.zeros(_bucket(n, self.pages_per_seq * self.page_size), np.int32)
        padded[:n] = tokens
        try:
            self.cache, first, first_lp, prompt = prefill(
                self.params, self.cache, padded, np.int32(n), page_row, _sampling_row(sampling), cfg=self.cfg,
                top_n=self.max_top_logprobs, prompt_logprobs=want_prompt_logprobs)
            first, first_lp = jax.device_get((first, first_lp))
        except BaseException:
            self._free_pages.extend(reversed(pages))
            raise
        prompt_lps = None
        if prompt is not None:
            chosen, ids, lps = jax.device_get(prompt)
            prompt_lps = [_token_logprobs(chosen[i], ids[i], lps[i]) for i in range(n - 1)]
        return Prefix(list(tokens), sampling, int(first), _token_logprobs(*first_lp), prompt_lps,
                      {"pages": pages, "length": n})

    def can_insert(self, prefix: Prefix) -> bool:
        return bool(self._free_slots())  # its pages were taken at prefill

    def insert(self, prefix: Prefix, slot: int) -> None:
        if self.lengths[slot] >= 0:
            raise ValueError(f"slot {slot} is in use")
        if not prefix.kv["pages"] and prefix.kv["length"]:
            raise ValueError("this prefix was inserted or released already")
        n, pages = prefix.kv["length"], prefix.kv["pages"]
        self._slot_pages[slot], prefix.kv["pages"] = pages, []
        self.page_table[slot] = NULL_PAGE
        self.page_table[slot, :len(pages)] = pages
        s = prefix.sampling
        self.lengths[slot], self.last_tokens[slot] = n, prefix.first_token
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = s.temperature, s.top_k, s.top_p
        self.seeds[slot] = np.uint32((s.seed or 0) & 0xFFFFFFFF)

    def release(self, prefix: Prefix) -> None:
        """Give back the pages of a prefix that will not be inserted."""
        self._free_pages.extend(reversed(prefix.kv["pages"]))
        prefix.kv["pages"] = []

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
        tokens, lps, top_ids, top_lps = jax.device_get(out)
        self.last_tokens = np.where(active, tokens, 0).astype(np.int32)
        self.lengths = np.where(active, self.lengths + 1, -1).astype(np.int32)
        return StepOutput(tokens, lps, top_ids, top_lps)

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
