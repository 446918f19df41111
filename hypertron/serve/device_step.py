"""The serving engine's step on the device, and the slots' sequences it reads and writes.

:func:`step` runs one :class:`~hypertron.serve.types.StepPlan` as
:class:`~hypertron.serve.engine.PagedEngine` packs it (:class:`~hypertron.serve.step_batch.StepBatch`):
every row's tokens through the model at once over the paged KV cache, then each row's sample.
:func:`init_state` makes the slots' sequences on the device (lengths, page table, last token,
token history: see :mod:`hypertron.serve.engine`); :func:`write_deltas` writes what the host
changed in them before a step. Moved out of ``engine.py`` (2026-11-28) so that the host's side
and the device's each fit a module.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from hypertron.config import ModelConfig
from hypertron.models import PagedCache, forward
from hypertron.models.kv_pages import NULL_PAGE
from hypertron.parallel.rules import DEFAULT_RULES, use_rules
from hypertron.quant.lora import adapter_tokens
from hypertron.serve.sampling import logprobs, sample_rows
from hypertron.serve.shapes import Shape
from hypertron.serve.step_batch import unpack



@functools.partial(jax.jit, donate_argnums=(1, 2),
                   static_argnames=("cfg", "top_n", "num_decode", "prefill_rows", "prefill_tokens",
                                    "want_logprobs", "prompt_logprobs", "skip_greedy", "lora", "guided", "mesh"))
def step(params, cache, state, packed, *, cfg: ModelConfig, top_n: int, num_decode: int, prefill_rows: int,
         prefill_tokens: int, want_logprobs: bool, prompt_logprobs: bool, skip_greedy: bool = True,
         lora: bool = False, guided: bool = False, mesh: Mesh | None = None):
    """One engine step over the flat batch :meth:`PagedEngine.dispatch` builds.

    ``state``: the slots' sequences (:func:`init_state`). ``packed``: a
    :class:`~hypertron.serve.step_batch.StepBatch`'s array, holding the prefill tokens
    ``pre_tokens`` / ``pre_pos`` / ``pre_row`` / ``pre_valid [P]``; per row (decode rows, then
    prefill rows) ``slot`` (``max_slots``: padding), ``lengths`` (tokens after this step; 0:
    padding; a decode row's input is ``last_tokens[slot]`` at ``lengths - 1``; the sample's key is
    at ``lengths``), ``out_idx`` (the flat index whose logits sample the row), ``out_slot`` (where
    the sample goes; ``max_slots``: nowhere), ``temperature``, ``top_k``, ``top_p``, ``seed``;
    with ``prompt_logprobs``, ``targets [P]``. Each row reads its slot's page-table row. Returns
    ``(cache, state, out)``, ``out`` holding ``tokens [rows]`` and, when asked, ``logprobs``,
    ``top_ids``, ``top_logprobs`` and ``prompt`` (the same three for every prefill token's
    target); with ``guided``, ``logits [rows, vocab]`` too, left on the device for
    :func:`sample_masked` (a guided row's ``out_slot`` is nowhere: its sample is that function's).
    ``skip_greedy``: :func:`sample_rows`'s (False on a GPU); ``lora``: a LoRA row; ``mesh``: the
    engine's (shard_map'ed layers).
    """
    b, nd = unpack(packed, num_decode + prefill_rows, prefill_tokens, prompt_logprobs), num_decode
    n_pre, n_rows, nowhere = b["pre_tokens"].shape[0], b["lengths"].shape[0], state["last_tokens"].shape[0] - 1
    slot, lengths = b["slot"], b["lengths"]
    tokens = jnp.concatenate([state["last_tokens"][slot[:nd]], b["pre_tokens"]])
    positions = jnp.concatenate([jnp.maximum(lengths[:nd] - 1, 0), b["pre_pos"]])
    token_rows = jnp.concatenate([jnp.arange(nd, dtype=jnp.int32), nd + b["pre_row"]])
    token_valid = jnp.concatenate([lengths[:nd] > 0, b["pre_valid"]])
    segments = jnp.where(token_valid, token_rows + 1, 0)  # padding is segment 0 (the MoE skips it)
    # Each row's tokens start where the previous row's end: a decode row has one (padding rows too,
    # over no keys), a prefill row its valid tokens.
    counts = jnp.concatenate([jnp.ones(nd, jnp.int32), jax.ops.segment_sum(
        b["pre_valid"].astype(jnp.int32), b["pre_row"], num_segments=n_rows - nd)])
    query_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts)])
    paged = PagedCache(cache, state["table"][slot], lengths, query_start, token_rows, token_valid,
                       decode_only=n_pre == 0, queries_per_row=Shape(nd, prefill_rows, n_pre).queries_per_row)
    at = b["out_idx"]
    if prompt_logprobs:
        at = jnp.concatenate([at, nd + jnp.arange(n_pre, dtype=jnp.int32)])
    split = contextlib.nullcontext() if mesh is None else use_rules(mesh, DEFAULT_RULES, pin=False)
    with adapter_tokens(b["adapter"][token_rows][None] - 1) if lora else contextlib.nullcontext(), split:
        fwd = forward(params, tokens[None], cfg, positions=positions[None], segment_ids=segments[None], cache=paged,
                      logits_at=at[None])
    logits, paged = fwd.logits, fwd.cache
    row_logits = logits[0, :n_rows]
    nxt = sample_rows(row_logits, b["temperature"], b["top_k"], b["top_p"], b["seed"], lengths,
                      skip_greedy=skip_greedy)
    out = {"tokens": nxt}
    if guided:  # guided rows sample in sample_masked, from these (their out_slot is nowhere here)
        out["logits"] = row_logits
    if want_logprobs:
        out["logprobs"], out["top_ids"], out["top_logprobs"] = logprobs(row_logits, nxt, top_n)
    if prompt_logprobs:
        out["prompt"] = logprobs(logits[0, n_rows:], jnp.maximum(b["targets"], 0), top_n)
    pre_slot = jnp.where(b["pre_valid"], slot[nd + b["pre_row"]], nowhere)
    history = state["history"].at[pre_slot, b["pre_pos"]].set(b["pre_tokens"], mode="drop")
    state = {"seq_lens": state["seq_lens"].at[slot].set(lengths), "table": state["table"],
             "last_tokens": state["last_tokens"].at[b["out_slot"]].set(nxt),
             "history": history.at[b["out_slot"], lengths].set(nxt, mode="drop")}
    return paged.pages, state, out


def mask_words(cfg: ModelConfig) -> int:
    """The int32 words of a guided row's bitmask: a bit for each of the model's ids."""
    return -(-cfg.vocab_size // 32)


def allowed(mask, vocab: int) -> jax.Array:
    """``mask [rows, words]`` (bit ``i % 32`` of word ``i // 32`` set: id ``i`` allowed) as booleans
    ``[rows, vocab]``."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab] > 0


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("words", "top_n", "want_logprobs", "skip_greedy"))
def sample_masked(state, logits, packed, *, words: int, top_n: int, want_logprobs: bool, skip_greedy: bool = True):
    """The samples of a step's guided rows, once their grammars' masks are known: ``logits [rows,
    vocab]`` (:func:`step`'s, guided variant), ``packed`` a :class:`~hypertron.serve.step_batch.
    StepBatch` of no tokens with ``mask [rows, words]``, its rows' ``out_slot`` (``max_slots``: not
    guided), ``lengths``, ``temperature``, ``top_k``, ``top_p``, ``seed`` as :func:`step` reads
    them. Each guided row samples among what its mask allows (:func:`allowed`), with the key of its
    position, as :func:`step` would; its token goes into ``last_tokens`` and ``history`` as there.
    Log-probabilities are the model's. Returns ``(state, out)``, ``out`` as :func:`step`'s."""
    rows = logits.shape[0]
    b = unpack(packed, rows, 0, False, words)
    masked = jnp.where(allowed(b["mask"], logits.shape[-1]), logits, -jnp.inf)
    nxt = sample_rows(masked, b["temperature"], b["top_k"], b["top_p"], b["seed"], b["lengths"],
                      skip_greedy=skip_greedy)
    out = {"tokens": nxt}
    if want_logprobs:
        out["logprobs"], out["top_ids"], out["top_logprobs"] = logprobs(logits, nxt, top_n)
    state = {**state, "last_tokens": state["last_tokens"].at[b["out_slot"]].set(nxt),
             "history": state["history"].at[b["out_slot"], b["lengths"]].set(nxt, mode="drop")}
    return state, out


def init_state(max_slots: int, pages_per_seq: int, max_seq_len: int) -> dict:
    """The slots' sequences on the device, empty (see the module docstring); entry ``max_slots``
    takes the writes that go nowhere."""
    n = max_slots + 1
    return {"seq_lens": jnp.zeros(n, jnp.int32), "table": jnp.full((n, pages_per_seq), NULL_PAGE, jnp.int32),
            "last_tokens": jnp.zeros(n, jnp.int32), "history": jnp.zeros((n, max_seq_len), jnp.int32)}


@functools.partial(jax.jit, donate_argnums=0)
def write_deltas(state: dict, pages, tokens) -> dict:
    """``state`` with ``pages [K, 3]`` (slot, column, page id) written into the page table and
    ``tokens [T, 3]`` (slot, position, token) into the history; padding entries write slot
    ``max_slots``'s column 0 with the null page (and its position 0)."""
    table = state["table"].at[pages[:, 0], pages[:, 1]].set(pages[:, 2], mode="drop")
    history = state["history"].at[tokens[:, 0], tokens[:, 1]].set(tokens[:, 2], mode="drop")
    return {**state, "table": table, "history": history}
