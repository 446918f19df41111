"""``hypertron generate``: continue a few prompts through the serving engine.

The same paged engine, sampler and prompt buckets as the server (:mod:`hypertron.serve.engine`),
driven to completion for a fixed batch: every prompt gets a slot, is prefilled (its keys and
values straight into its pages), then all decode together until each has its tokens or an
end-of-sequence id. What ``generate`` prints is what the server would stream for the same prompt
and settings.
"""

from __future__ import annotations

from collections.abc import Iterable

from hypertron.config import ModelConfig
from hypertron.serve.engine import PagedEngine
from hypertron.serve.types import SamplingParams


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
    page_size: int = 16,
) -> list[list[int]]:
    """Continue each prompt (a list of token ids) by up to ``max_new_tokens`` tokens.

    Prompt ``i`` samples with seed ``seed + i`` (greedy when ``temperature == 0``). Returns the
    new tokens of each prompt, each ending at the first of ``eos_ids`` in it (included).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > cfg.max_seq_len:
        raise ValueError(f"prompt + max_new_tokens = {longest} tokens exceeds max_seq_len={cfg.max_seq_len}")
    # Just the pages these sequences can fill (+1 for the null page), not max_seq_len each.
    pages = sum(-(-(len(p) + max_new_tokens + 1) // page_size) for p in prompts) + 1
    engine = PagedEngine(params, cfg, max_slots=len(prompts), page_size=page_size, num_pages=pages,
                         max_top_logprobs=1)
    stops = frozenset(eos_ids)
    out: list[list[int]] = [[] for _ in prompts]
    live = set()

    def take(slot: int, token: int) -> None:
        out[slot].append(token)
        if token in stops or len(out[slot]) == max_new_tokens:
            engine.free(slot)
            live.discard(slot)

    for slot, prompt in enumerate(prompts):
        sampling = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                  seed=seed + slot)
        prefix = engine.prefill(list(prompt), sampling)
        engine.insert(prefix, slot)
        live.add(slot)
        take(slot, prefix.first_token)
    while live:
        short = engine.reserve_step()
        assert not short, "the page pool was sized for every token"
        tokens = engine.generate().tokens
        for slot in sorted(live):
            take(slot, int(tokens[slot]))
    return out
