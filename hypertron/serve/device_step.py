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
from hypertron.serve.sampling import logprobs, sample_rows, verify_proposal
from hypertron.serve.shapes import Shape
from hypertron.serve.step_batch import unpack



@functools.partial(jax.jit, donate_argnums=(1, 2, 5),
                   static_argnames=("cfg", "top_n", "num_decode", "prefill_rows", "prefill_tokens",
                                    "want_logprobs", "prompt_logprobs", "skip_greedy", "lora", "guided", "verify",
                                    "mesh", "draft_cfg", "draft_k"))
def step(params, cache, state, packed, draft_params=None, draft_cache=None, *, cfg: ModelConfig, top_n: int,
         num_decode: int, prefill_rows: int, prefill_tokens: int, want_logprobs: bool, prompt_logprobs: bool,
         skip_greedy: bool = True, lora: bool = False, guided: bool = False, verify: int = 0,
         mesh: Mesh | None = None, draft_cfg: ModelConfig | None = None, draft_k: int = 0):
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
    ``verify`` (speculative decoding): a decode row feeds its last token and then ``draft`` tokens
    of ``proposal [rows, verify]`` (:attr:`~hypertron.serve.types.Row.proposal`; ``lengths`` counts
    them), in the last of its ``verify + 1`` places, ``out_idx`` its first query's flat index
    (all of a decode row's queries attend together, its pages read once); the step samples after each and keeps
    what :func:`~hypertron.serve.sampling.verify_proposal` keeps: ``tokens [rows, verify + 1]`` and
    ``emitted [rows]`` (1 for a row without a proposal, whose sample is as in a step without
    ``verify``), the log-probabilities ``[rows, verify + 1 (, N)]``; the slot then holds
    ``lengths - draft + emitted - 1`` positions.
    ``skip_greedy``: :func:`sample_rows`'s (False on a GPU); ``lora``: a LoRA row; ``mesh``: the
    engine's. ``draft_cfg``: a draft model's ``draft_params`` propose ``out["proposal"] [rows,
    draft_k]`` (:func:`_draft_proposals`), and the step returns ``((cache, draft_cache), state, out)``.
    """
    b = unpack(packed, num_decode + prefill_rows, prefill_tokens, prompt_logprobs, proposal=verify)
    n_pre, n_rows = b["pre_tokens"].shape[0], b["lengths"].shape[0]
    slot, lengths, nd, per = b["slot"], b["lengths"], num_decode, verify + 1
    dec_tokens, dec_pos, dec_valid = _decode_queries(state, b, nd, verify)
    tokens = jnp.concatenate([dec_tokens.reshape(-1), b["pre_tokens"]])
    positions = jnp.concatenate([jnp.maximum(dec_pos, 0).reshape(-1), b["pre_pos"]])
    # Each row's tokens start where the previous row's end: a decode row has `per` (padding rows too,
    # over no keys), a prefill row its valid tokens.
    nq = nd * per
    token_rows = jnp.concatenate([jnp.repeat(jnp.arange(nd, dtype=jnp.int32), per), nd + b["pre_row"]])
    token_valid = jnp.concatenate([dec_valid.reshape(-1), b["pre_valid"]])
    segments = jnp.where(token_valid, token_rows + 1, 0)  # padding is segment 0 (the MoE skips it)
    counts = jnp.concatenate([jnp.full(nd, per, jnp.int32), jax.ops.segment_sum(
        b["pre_valid"].astype(jnp.int32), b["pre_row"], num_segments=n_rows - nd)])
    query_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts)])
    paged = functools.partial(PagedCache, page_table=state["table"][slot], lengths=lengths, query_start=query_start,
                              token_rows=token_rows, token_valid=token_valid, decode_only=n_pre == 0,
                              queries_per_row=Shape(nd, prefill_rows, n_pre).queries_per_row, decode_queries=per)
    at = b["out_idx"]  # a decode row's first query (its last token), a prefill row's last token
    if verify:  # each row's verify + 1 queries (past its proposal, and a prefill row's: its last, again)
        at = (at[:, None] + jnp.minimum(jnp.arange(per), b["draft"][:, None])).reshape(-1)
    if prompt_logprobs:
        at = jnp.concatenate([at, nq + jnp.arange(n_pre, dtype=jnp.int32)])
    split = contextlib.nullcontext if mesh is None else functools.partial(use_rules, mesh, DEFAULT_RULES, pin=False)
    with adapter_tokens(b["adapter"][token_rows][None] - 1) if lora else contextlib.nullcontext(), split():
        fwd = forward(params, tokens[None], cfg, positions=positions[None], segment_ids=segments[None],
                      cache=paged(cache), logits_at=at[None])
    logits, pages = fwd.logits, fwd.cache.pages
    row_logits = logits[0, :n_rows * (verify + 1)]
    first = row_logits if not verify else row_logits.reshape(n_rows, verify + 1, -1)[:, 0]
    if verify:  # each row's first draw is what it samples without a proposal
        out = dict(zip(("tokens", "emitted"), _verified(row_logits, b, verify, skip_greedy)))
    else:
        out = {"tokens": sample_rows(first, b["temperature"], b["top_k"], b["top_p"], b["seed"], lengths,
                                     skip_greedy=skip_greedy)}
    if guided:  # guided rows sample in sample_masked, from these (their out_slot is nowhere here)
        out["logits"] = first
    if want_logprobs:
        lps = logprobs(row_logits, out["tokens"].reshape(-1), top_n)
        out["logprobs"], out["top_ids"], out["top_logprobs"] = (x.reshape(out["tokens"].shape + x.shape[1:])
                                                                for x in lps)
    if prompt_logprobs:
        out["prompt"] = logprobs(logits[0, n_rows * (verify + 1):], jnp.maximum(b["targets"], 0), top_n)
    if draft_cfg is not None:
        with split():  # a second context of the rules: one is entered once
            pages = (pages, _draft_proposals(draft_params, paged(draft_cache), draft_cfg, draft_k, state, b, out,
                                             (tokens[None], positions[None], segments[None]), cfg.vocab_size))
    state = _written(state, b, out, nd)
    return pages, state, out


def _draft_proposals(params, cache: PagedCache, cfg: ModelConfig, k: int, state: dict, b: dict, out: dict, inputs,
                     vocab: int):
    """A draft model's pages, its proposals put in ``out["proposal"] [rows, k]``: ``inputs``, the
    step's ``(tokens, positions, segment_ids)``, through it into ``cache`` (its own pool, read
    through the step's page table, so that it holds what the served model's does), then its ``k``
    greedy tokens after each row's last new token (the last of its ``out["emitted"]``; rows that
    sampled nothing here propose nothing), one decode step of the draft at a time, each writing its
    input's keys and values into the draft's pages at its position (pages not given to the
    sequence yet read as the null page: a draft past them is worse, never wrong). Greedy drafts are
    a point mass, which is what :func:`~hypertron.serve.sampling.verify_proposal` keeps them
    against (as vLLM v1 drafts). Only ids under ``vocab``, the served model's, are proposed (a
    draft's vocabulary may be padded wider)."""
    tokens, positions, segments = inputs
    pages = forward(params, tokens, cfg, positions=positions, segment_ids=segments, cache=cache,
                    logits_at=jnp.zeros((1, 1), jnp.int32)).cache.pages
    n_rows, nowhere = b["lengths"].shape[0], state["last_tokens"].shape[0] - 1
    new = out["tokens"].reshape(n_rows, -1)
    emitted = out.get("emitted", jnp.ones(n_rows, jnp.int32))
    table = state["table"][b["slot"]]
    capacity = table.shape[1] * pages["k_pages"].shape[2]
    rows = jnp.arange(n_rows, dtype=jnp.int32)
    sampled = b["out_slot"] != nowhere

    def one(carry, _):
        pages, token, pos = carry
        valid = sampled & (pos < capacity)
        cache = PagedCache(pages, table, jnp.where(valid, pos + 1, 0), jnp.arange(n_rows + 1, dtype=jnp.int32), rows,
                           valid, decode_only=True)
        fwd = forward(params, token[None], cfg, positions=jnp.minimum(pos, capacity - 1)[None],
                      segment_ids=jnp.where(valid, rows + 1, 0)[None], cache=cache, logits_at=rows[None])
        nxt = jnp.argmax(fwd.logits[0, :, :vocab], axis=-1).astype(jnp.int32)
        return (fwd.cache.pages, nxt, pos + 1), nxt

    start = new[rows, emitted - 1], b["lengths"] - b["draft"] + emitted - 1  # the last new token, its position
    (pages, _, _), proposal = jax.lax.scan(one, (pages, *start), None, length=k)
    out["proposal"] = proposal.T
    return pages


def _written(state: dict, b: dict, out: dict, nd: int) -> dict:
    """``state`` after a step: its prefill tokens and each row's new tokens (the first
    ``out["emitted"]``, or its one) in the history, its last in ``last_tokens``, and where each
    slot now stands in ``seq_lens``."""
    n_rows, nowhere = b["lengths"].shape[0], state["last_tokens"].shape[0] - 1
    pre_slot = jnp.where(b["pre_valid"], b["slot"][nd + b["pre_row"]], nowhere)
    history = state["history"].at[pre_slot, b["pre_pos"]].set(b["pre_tokens"], mode="drop")
    new = out["tokens"].reshape(n_rows, -1)
    emitted = out.get("emitted", jnp.ones(n_rows, jnp.int32))
    start = b["lengths"] - b["draft"]  # where the first goes
    at = jnp.where(jnp.arange(new.shape[1]) < emitted[:, None], start[:, None] + jnp.arange(new.shape[1]),
                   history.shape[1])  # past the end: dropped
    return {"seq_lens": state["seq_lens"].at[b["slot"]].set(start + emitted - 1), "table": state["table"],
            "last_tokens": state["last_tokens"].at[b["out_slot"]].set(new[jnp.arange(n_rows), emitted - 1]),
            "history": history.at[b["out_slot"][:, None], at].set(new, mode="drop")}


def _decode_queries(state: dict, b: dict, nd: int, verify: int):
    """``(tokens, positions, valid) [nd, verify + 1]`` of the step's decode rows: each row's last
    token (on the device) at ``lengths - 1 - draft``, then its proposal's, in the last of its
    ``verify + 1`` places (padding before them: a row's tokens stay contiguous, and its last query
    is its last place)."""
    lengths, draft, per = b["lengths"][:nd], b["draft"][:nd], verify + 1
    index = jnp.arange(per) - (per - 1 - draft)[:, None]  # in the row: 0 its last token; < 0 padding
    valid = (lengths[:, None] > 0) & (index >= 0)
    positions = (lengths - 1 - draft)[:, None] + index
    tokens = jnp.broadcast_to(state["last_tokens"][b["slot"][:nd]][:, None], index.shape)
    if verify:
        proposed = jnp.take_along_axis(b["proposal"][:nd], jnp.clip(index - 1, 0, verify - 1), axis=1)
        tokens = jnp.where(index > 0, proposed, tokens)
    return tokens, positions, valid


def _verified(row_logits, b: dict, verify: int, skip_greedy: bool):
    """``(tokens [rows, verify + 1], emitted [rows])`` of a step with proposals
    (:func:`~hypertron.serve.sampling.verify_proposal`; a row without one emits its first draw,
    the token it would sample in a step without them)."""
    n_rows, draft = b["lengths"].shape[0], b["draft"]
    tokens, emitted = verify_proposal(row_logits.reshape(n_rows, verify + 1, -1), b["temperature"], b["top_k"],
                                      b["top_p"], b["seed"], b["lengths"] - draft, b["proposal"], draft,
                                      skip_greedy=skip_greedy)
    return tokens, jnp.where(draft > 0, emitted, 1)


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
