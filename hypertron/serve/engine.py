"""The serving engine: one jitted step runs a scheduler's plan over the paged KV cache.

A step (:func:`step`) takes the tokens of many sequences in one flat row: first one decode token
per running sequence, then the prefill chunks (a whole short prompt, several of them, or a
chunk of a long one), and runs the model once over all of them, so the weights are read once
per step whatever its mix (:class:`hypertron.models.PagedCache` says how each part attends).
Each token's keys and values go straight into its sequence's pages. Logits are computed only
where a token is sampled (the decode rows and the last chunk of a prompt), unless prompt
log-probabilities were asked for; each row samples with its own temperature, top-k, top-p and
seed, and log-probabilities (of the model's distribution, before temperature, top-k and top-p,
as OpenAI's and vLLM's are; with the top ``max_top_logprobs``) are computed only in steps where
some request asked for them: a second compiled variant, not one per request.

A decode row's input is the token its slot sampled last, and that never leaves the device:
``last_tokens [max_slots + 1]`` is updated in place by each step (the extra entry takes the
writes of rows that sample nothing). So the host can dispatch step n + 1 before step n's
tokens reach it (:meth:`PagedEngine.dispatch` returns at once; :meth:`PagedEngine.collect`
waits), and steps run in the order they were dispatched: the cache and ``last_tokens`` are
donated to each step and threaded through.

Shapes are bucketed so that compiles stay few (:func:`bucket`: powers of two up to 8, then under
25 % padding): decode rows (so a step decodes about the live sequences, not ``max_slots``),
prefill tokens, and the page table's columns (the pages of the step's longest sequence, so its
attention cost follows the real lengths, not ``max_seq_len``); prefill rows to a power of two.
Sampling is repeatable: the key of the token at position ``p`` is ``fold_in(key(seed), p)``,
whatever else is in the step.

The pages, slots and requests themselves are the scheduler's (:mod:`hypertron.serve.scheduler`);
this module only runs plans.
"""

from __future__ import annotations

import dataclasses
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
from hypertron.serve.types import StepPlan, StepResult

# ---------------------------------------------------------------------------
# The device step


@functools.partial(jax.jit, donate_argnums=(1, 2),
                   static_argnames=("cfg", "top_n", "num_decode", "cold", "want_logprobs", "prompt_logprobs"))
def step(params, cache, last_tokens, batch: dict, *, cfg: ModelConfig, top_n: int, num_decode: int, cold: bool,
         want_logprobs: bool, prompt_logprobs: bool):
    """One engine step over the flat batch :meth:`PagedEngine.dispatch` builds.

    ``batch``: decode tokens ``dec_slot`` / ``dec_pos [num_decode]`` (their input is
    ``last_tokens[dec_slot]``); prefill tokens ``pre_tokens`` / ``pre_pos`` / ``pre_row`` /
    ``pre_valid [P]``; per row (decode rows, then prefill rows) ``table [rows, width]``,
    ``lengths`` (tokens after this step; 0: padding), ``out_idx`` (the flat index whose logits
    sample the row), ``out_slot`` (where the sample goes in ``last_tokens``; ``max_slots``: nowhere),
    ``temperature``, ``top_k``, ``top_p``, ``seed``, ``sample_pos``; with ``prompt_logprobs``,
    ``targets [P]``. Returns ``(cache, last_tokens, out)``, ``out`` holding ``tokens [rows]`` and,
    when asked, ``logprobs``, ``top_ids``, ``top_logprobs`` and ``prompt`` (the same three for
    every prefill token's target).
    """
    b, nd = batch, num_decode
    n_pre, n_rows = b["pre_tokens"].shape[0], b["lengths"].shape[0]
    tokens = jnp.concatenate([last_tokens[b["dec_slot"]], b["pre_tokens"]])
    positions = jnp.concatenate([b["dec_pos"], b["pre_pos"]])
    token_rows = jnp.concatenate([jnp.arange(nd, dtype=jnp.int32), nd + b["pre_row"]])
    token_valid = jnp.concatenate([b["lengths"][:nd] > 0, b["pre_valid"]])
    segments = jnp.where(token_valid, token_rows + 1, 0)  # padding is segment 0 (the MoE skips it)
    paged = PagedCache(cache, b["table"], b["lengths"], token_rows, token_valid, num_decode=nd, cold=cold)
    at = b["out_idx"]
    if prompt_logprobs:
        at = jnp.concatenate([at, nd + jnp.arange(n_pre, dtype=jnp.int32)])
    logits, paged = forward(params, tokens[None], cfg, positions=positions[None], segment_ids=segments[None],
                            cache=paged, logits_at=at[None])
    row_logits = logits[0, :n_rows]
    nxt = sample_rows(row_logits, b["temperature"], b["top_k"], b["top_p"], b["seed"], b["sample_pos"])
    out = {"tokens": nxt}
    if want_logprobs:
        out["logprobs"], out["top_ids"], out["top_logprobs"] = logprobs(row_logits, nxt, top_n)
    if prompt_logprobs:
        out["prompt"] = logprobs(logits[0, n_rows:], jnp.maximum(b["targets"], 0), top_n)
    return paged.pages, last_tokens.at[b["out_slot"]].set(nxt), out


# ---------------------------------------------------------------------------
# Host side


@dataclasses.dataclass
class _Pending:
    """A dispatched step: its plan, where its rows sit in the padded batch, and its outputs
    (device arrays, on their way to the host)."""

    plan: StepPlan
    num_decode: int
    prefill_offsets: list[int]
    out: dict


class PagedEngine:
    """Runs :class:`~hypertron.serve.types.StepPlan` s over a page pool; implements
    :class:`hypertron.serve.types.Engine`.

    ``num_pages``: the pool, page 0 included (it is the null page, never handed out); default
    enough for every slot at ``max_seq_len``.
    """

    def __init__(self, params, cfg: ModelConfig, *, max_slots: int = 8, page_size: int = 16,
                 num_pages: int | None = None, kv_cache_dtype: str = "auto", max_top_logprobs: int = 20,
                 eos_ids: frozenset[int] = frozenset()):
        check_engine_settings(max_slots=max_slots, page_size=page_size, num_pages=num_pages,
                              kv_cache_dtype=kv_cache_dtype)
        self.params, self.cfg = params, cfg
        self.max_slots, self.page_size = max_slots, page_size
        self.max_seq_len, self.max_top_logprobs, self.eos_ids = cfg.max_seq_len, max_top_logprobs, frozenset(eos_ids)
        self.pages_per_seq = math.ceil(cfg.max_seq_len / page_size)
        total = max_slots * self.pages_per_seq + 1 if num_pages is None else num_pages
        self.num_pages = total - 1
        self.kv_dtype = resolve_dtype(cfg.dtype) if kv_cache_dtype == "auto" else jnp.dtype(kv_cache_dtype)
        self.cache = init_pages(cfg, total, page_size, self.kv_dtype)
        self.last_tokens = jnp.zeros(max_slots + 1, jnp.int32)

    def dispatch(self, plan: StepPlan) -> _Pending:
        batch, nd, offsets, cold = self._batch(plan)
        self.cache, self.last_tokens, out = step(
            self.params, self.cache, self.last_tokens, batch, cfg=self.cfg, top_n=self.max_top_logprobs,
            num_decode=nd, cold=cold, want_logprobs=plan.logprobs, prompt_logprobs=plan.prompt_logprobs)
        for x in jax.tree.leaves(out):
            x.copy_to_host_async()
        return _Pending(plan, nd, offsets, out)

    def collect(self, pending: _Pending) -> StepResult:
        out = jax.device_get(pending.out)
        plan, nd = pending.plan, pending.num_decode
        rows = list(range(len(plan.decodes))) + [nd + j for j in range(len(plan.prefills))]
        pick = lambda x: None if x is None else x[rows]  # noqa: E731
        prompt = None
        if "prompt" in out:
            chosen, ids, lps = out["prompt"]
            prompt = [None if row.prompt_targets is None else
                      (chosen[o:o + len(row.tokens)], ids[o:o + len(row.tokens)], lps[o:o + len(row.tokens)])
                      for row, o in zip(plan.prefills, pending.prefill_offsets)]
        return StepResult(out["tokens"][rows], pick(out.get("logprobs")), pick(out.get("top_ids")),
                          pick(out.get("top_logprobs")), prompt)

    def run(self, plan: StepPlan) -> StepResult:
        """:meth:`dispatch` then :meth:`collect`: one step, synchronously."""
        return self.collect(self.dispatch(plan))

    def _batch(self, plan: StepPlan) -> tuple[dict, int, list[int], bool]:
        """The padded arrays of ``plan`` (see :func:`step`), its decode rows, where each prefill
        row's tokens start, and whether every prefill row starts its sequence."""
        dec, pre = plan.decodes, plan.prefills
        nd = min(bucket(len(dec)), self.max_slots) if dec else 0
        nr = 1 << (len(pre) - 1).bit_length() if pre else 0
        n_pad = bucket(sum(len(r.tokens) for r in pre)) if pre else 0
        rows = nd + nr
        width = min(bucket(max(-(-r.end // self.page_size) for r in plan.rows)), self.pages_per_seq)
        i32 = lambda n, fill=0: np.full(n, fill, np.int32)  # noqa: E731
        b = {"dec_slot": i32(nd, self.max_slots), "dec_pos": i32(nd),
             "pre_tokens": i32(n_pad), "pre_pos": i32(n_pad), "pre_row": i32(n_pad),
             "pre_valid": np.zeros(n_pad, bool), "table": np.full((rows, width), NULL_PAGE, np.int32),
             "lengths": i32(rows), "out_idx": i32(rows), "out_slot": i32(rows, self.max_slots),
             "temperature": np.zeros(rows, np.float32), "top_k": i32(rows), "top_p": np.ones(rows, np.float32),
             "seed": np.zeros(rows, np.uint32), "sample_pos": i32(rows)}
        if plan.prompt_logprobs:
            b["targets"] = i32(n_pad)
        offsets = []
        flat = nd
        for i, row in enumerate(dec):
            b["dec_slot"][i], b["dec_pos"][i] = row.slot, row.start
            self._row(b, i, row, i)
        off = 0
        for j, row in enumerate(pre):
            n, sl = len(row.tokens), slice(off, off + len(row.tokens))
            b["pre_tokens"][sl], b["pre_row"][sl], b["pre_valid"][sl] = row.tokens, j, True
            b["pre_pos"][sl] = np.arange(row.start, row.end)
            if row.prompt_targets is not None:
                b["targets"][sl] = row.prompt_targets
            self._row(b, nd + j, row, flat + off + n - 1)
            offsets.append(off)
            off += n
        return b, nd, offsets, all(r.start == 0 for r in pre)

    def _row(self, b: dict, i: int, row, out_idx: int) -> None:
        width = b["table"].shape[1]
        pages = row.pages[:width]
        b["table"][i, :len(pages)] = pages
        b["lengths"][i], b["out_idx"][i] = row.end, out_idx
        if row.sample:
            b["out_slot"][i] = row.slot
        s = row.sampling
        b["temperature"][i], b["top_k"][i], b["top_p"][i] = s.temperature, s.top_k, s.top_p
        b["seed"][i], b["sample_pos"][i] = np.uint32((s.seed or 0) & 0xFFFFFFFF), row.end


def bucket(n: int) -> int:
    """The padded size of ``n`` rows, tokens or pages: a power of two up to 8, then a multiple of a
    quarter of the power of two below it (10, 12, 14, 16, 20, ...: under 25 % padding), so that
    about 4 sizes per doubling get compiled."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    step = (1 << (n.bit_length() - 1)) // 4
    return -(-n // step) * step


def load_engine(checkpoint: str | Path, *, max_slots: int = 8, page_size: int = 16, num_pages: int | None = None,
                kv_cache_dtype: str = "auto", quantize: str = "none"):
    """``(engine, tokenizer, model_name)`` for a run directory (trained or converted from HF); the
    engine's ``eos_ids`` are the tokenizer's."""
    from hypertron.serve.model import load_model, served_name

    model, params, tok = load_model(checkpoint, quantize)
    engine = PagedEngine(params, model, max_slots=max_slots, page_size=page_size, num_pages=num_pages,
                         kv_cache_dtype=kv_cache_dtype, eos_ids=tok.eos_ids)
    return engine, tok, served_name(checkpoint)
