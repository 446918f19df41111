"""``hypertron generate``: continue a few prompts through the serving engine.

The same scheduler, engine, sampler and buckets as the server (:mod:`hypertron.serve.scheduler`,
:mod:`hypertron.serve.engine`), run step by step until every prompt has its tokens or an
end-of-sequence id. What ``generate`` prints is what the server would stream for the same prompt
and settings.
"""

from __future__ import annotations

from collections.abc import Iterable

from hypertron.config import EngineConfig, ModelConfig, SchedulerConfig
from hypertron.serve.engine import PagedEngine
from hypertron.serve.scheduler import Output, Request, Scheduler, run_until_done
from hypertron.serve.types import SamplingError, SamplingParams, check_token_ids


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
    page_size: int = EngineConfig.page_size,
    max_num_batched_tokens: int | None = None,
) -> list[list[int]]:
    """Continue each prompt (a list of token ids) by up to ``max_new_tokens`` tokens.

    Prompt ``i`` samples with seed ``seed + i`` (greedy when ``temperature == 0``). Returns the
    new tokens of each prompt, each ending at the first of ``eos_ids`` in it (included).
    Raises :class:`~hypertron.serve.types.SamplingError` (naming the field) for a value the
    engine cannot hold (:class:`SamplingParams`), or a prompt + ``max_new_tokens`` over ``max_seq_len``.
    ``max_num_batched_tokens``: tokens per step (default: every prompt in one step).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > cfg.max_seq_len:
        raise SamplingError("prompt", f"'prompt' ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                                      f"model's max_seq_len={cfg.max_seq_len}")
    samplings = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed + i) for i in range(len(prompts))]
    for p, s in zip(prompts, samplings):  # the server's checks: SamplingError names the field
        check_token_ids(p, cfg.vocab_size, "prompt")
        s.check(vocab_size=cfg.vocab_size, max_top_logprobs=1)
    # Just the pages these sequences can fill (+1 for the null page), not max_seq_len each.
    pages = sum(-(-(len(p) + max_new_tokens + 1) // page_size) for p in prompts) + 1
    engine = PagedEngine(params, cfg, EngineConfig(max_slots=len(prompts), page_size=page_size, num_pages=pages,
                                                   max_top_logprobs=1, compile="lazy"))
    budget = max_num_batched_tokens or max(sum(len(p) for p in prompts), len(prompts))
    scheduler = Scheduler(engine, SchedulerConfig(max_num_batched_tokens=budget, max_prefill_rows=len(prompts)))
    seqs = [Request(i, list(p), s) for i, (p, s) in enumerate(zip(prompts, samplings))]
    for seq in seqs:
        scheduler.add(seq)
    stops = frozenset(eos_ids)

    def on_output(out: Output) -> None:
        if out.token in stops:
            scheduler.abort(out.seq)

    run_until_done(engine, scheduler, on_output)
    return [seq.generated for seq in seqs]
