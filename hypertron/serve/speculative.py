"""Speculative decoding's proposers: n-gram lookup over a sequence's own tokens (vLLM's ``ngram``
method, "prompt lookup decoding"), on the host, no JAX; and a draft model's tokens, proposed in the
step on the device (:class:`ModelDrafter`; :func:`hypertron.serve.device_step.step`'s ``draft_cfg``).

For the last ``n`` tokens, ``n`` from ``n_max`` down to ``n_min`` (the longest match wins), the
earliest place where they occurred before proposes up to ``k`` of the tokens that followed it, as
vLLM's proposer does (the earliest has the most tokens after it: in a run of one repeated token,
the latest match is followed by one token, the earliest by all of them; issue 45 had the latest). The
scheduler (:mod:`hypertron.serve.scheduler`) asks it for each speculating sequence it plans a
row for; the step feeds the draft after the row's last token (each a query of the decode part's
attention, over the keys up to it) and keeps what the model agrees with
(:func:`hypertron.serve.sampling.verify_proposal`).

On the host rather than in the step (as issue 45 first had it, over the slots' token history on
the device): a step's shapes are static, so a row whose draft is found on the device would be
compiled, and computed, as ``k + 1`` queries whether or not a draft is found, and on a CPU a
step's time grows with its tokens (16 rows at k = 4: 80 queries for 16 tokens). Found here, a
sequence with no match decodes one token as it would without speculation, and keeps its step
dispatched ahead. vLLM's proposer runs on the host too. One search compares the sequence with its last
token once, then only the places that match it (numpy).
"""

from __future__ import annotations

import numpy as np

# The most tokens one lookup searches back over (the latest ones): a sequence's search stays
# a few tens of microseconds however long it grows.
MAX_LOOKBACK = 8192


def propose(tokens, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` draft tokens to follow ``tokens`` (a sequence, prompt and generated): for ``n``
    from ``n_max`` down to ``n_min``, the first ``j`` with ``tokens[j:j + n]`` equal to the last
    ``n`` tokens and a token after it (``j + n < len(tokens)``); the draft is what follows it. Empty
    where no ``n`` matches."""
    seq = np.asarray(tokens[-MAX_LOOKBACK:], np.int64)
    if len(seq) < n_min + 1:
        return []
    ends = np.flatnonzero(seq[:-1] == seq[-1])  # where an earlier n-gram could end: the last token again
    same = np.ones(len(ends), np.int64)  # how many tokens back from each end match the sequence's last
    alive = np.ones(len(ends), bool)
    for i in range(1, min(n_max, len(seq) - 1)):
        alive &= (ends >= i) & (seq[np.maximum(ends - i, 0)] == seq[-1 - i])
        same += alive
    for n in range(min(n_max, len(seq) - 1), n_min - 1, -1):
        hits = ends[same >= n]
        if len(hits):
            return seq[hits[0] + 1:hits[0] + 1 + k].tolist()
    return []


class Drafter:
    """A scheduler's proposer (``speculative: ngram``) and its counters, as vLLM names them:
    :attr:`drafts` (verify rows run), :attr:`draft_tokens` (tokens they proposed),
    :attr:`accepted` (of those, kept) and :attr:`accepted_per_pos` (kept at each place of a
    draft; ``[0]`` is every draft's first token). A row that emits ``e`` tokens kept ``e - 1``
    drafts, so the tokens emitted are the rows plus :attr:`accepted`."""

    def __init__(self, k: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.drafts = self.draft_tokens = self.accepted = 0
        self.accepted_per_pos = [0] * k

    def propose(self, tokens, limit: int, seq=None) -> list[int]:
        """:func:`propose` of at most ``limit`` (and ``k``) tokens; none for ``limit`` 0. ``seq``,
        the sequence ``tokens`` are of, is the draft model's (:class:`ModelDrafter`)."""
        return propose(tokens, min(self.k, limit), self.n_min, self.n_max) if limit > 0 else []

    def will_propose(self, tokens, limit: int, seq=None) -> bool:
        """Whether a sequence whose row is in flight, ``tokens`` known so far, would propose once it is
        collected (it then sits the next step out, to verify a draft in the one after)."""
        return bool(self.propose(tokens, limit, seq))

    def verified(self, drafted: int, emitted: int) -> None:
        """Count a verify row of ``drafted`` proposed tokens that emitted ``emitted``."""
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted += emitted - 1
        for i in range(emitted - 1):
            self.accepted_per_pos[i] += 1


class ModelDrafter(Drafter):
    """The proposer of ``speculative: draft``: what the draft model proposed on the device, in the
    step that produced the sequence's last token (:attr:`StepResult.proposals
    <hypertron.serve.types.StepResult.proposals>`, kept by the scheduler as
    ``Request.proposed``), while it still follows the sequence's tokens. The counters are
    :class:`Drafter`'s."""

    def __init__(self, k: int):
        super().__init__(k, 1, 1)

    def propose(self, tokens, limit: int, seq=None) -> list[int]:
        if seq is None or limit <= 0 or seq.proposed is None or seq.proposed[0] != len(tokens):
            return []
        return list(seq.proposed[1][:min(self.k, limit)])

    def will_propose(self, tokens, limit: int, seq=None) -> bool:
        return limit > 0  # its row in flight brings a proposal
