"""``bench/serve.py --profile``: the serving loop without HTTP, and where its turns' time goes.

For each batch size B: a :class:`~hypertron.serve.engine.PagedEngine` readied as ``hypertron
serve`` readies it (:func:`hypertron.serve.readying.orchestrate`: a step's cost measured, the
largest shape compiled in the background, compiles in the background), its
:class:`~hypertron.serve.orchestrator.Orchestrator` started, and rounds of B requests submitted at
once from one event loop (``--context`` random tokens each, new ones every round, so the prefix
cache finds nothing; ``--steps`` tokens out, greedy, EOS ignored), each round's streams read to
their end. Two warm-up rounds, then up to 4 more while the last one compiled a step shape, then one
measured round (inside ``jax.profiler.trace(--trace)`` when given); after each warm-up round the
background compiles it queued are let finish. Reported: output tokens/s of
that round, the loop's turns and their mean, and each phase's mean a turn
(``hypertron_step_phase_seconds``, docs/serving.md "Where a step's time goes"), from the
orchestrator's own metrics. The tokenizer is a stand-in (one letter a token): detokenising costs
next to nothing here, and nothing is streamed; ``bench/serve_http.py`` prints the same breakdown
for the server under HTTP.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

EXTRA_WARMUPS = 4
COLUMNS = [("batch", ">5"), ("tokens/s", ">9,.0f"), ("turns", ">6"), ("ms/turn", ">8.2f")]


class Letters:
    """What the serving loop needs of a tokenizer (a Generation's detokeniser): one letter a token."""

    @staticmethod
    def decode(ids) -> str:
        return "".join(chr(65 + int(i) % 26) for i in ids)


def _times(orch) -> dict[str, float]:
    from hypertron.serve.metrics import STEP_PHASES

    get = orch.metrics.registry.get_sample_value
    out = {p: get("hypertron_step_phase_seconds_sum", {"phase": p}) or 0.0 for p in STEP_PHASES}
    return {**out, "turns": get("hypertron_step_seconds_count") or 0.0, "seconds": get("hypertron_step_seconds_sum") or 0.0}


async def _read_all(orch, prompts: np.ndarray, sampling) -> int:
    gens = [orch.submit(p.tolist(), sampling) for p in prompts]

    async def read(g) -> int:
        return sum([len(c.token_ids) async for c in g])

    return sum(await asyncio.gather(*map(read, gens)))


def profile_batch(params, cfg, batch: int, context: int, steps: int, page_size: int, kv_dtype: str,
                  budget: int, trace: str | None, scan_layers: bool = False, slots: int | None = None) -> dict:
    """The figures of one batch size (see the module docstring). ``slots``: the engine's (and pages
    for every one of them), as a server's ``--max-slots`` (default: ``batch``)."""
    import jax

    from hypertron.config import ServeConfig
    from hypertron.serve.engine import PagedEngine
    from hypertron.serve.readying import orchestrate
    from hypertron.serve.types import SamplingParams

    slots = max(batch, slots or batch)
    pages = slots * -(-(context + steps + 1) // page_size) + 1
    serve = ServeConfig(max_slots=slots, page_size=page_size, num_pages=pages, kv_cache_dtype=kv_dtype,
                        max_num_batched_tokens=max(budget, batch))
    engine = PagedEngine(params, cfg, serve.engine, scan_layers=scan_layers)
    orch = orchestrate(engine, Letters(), serve).start()
    rng = np.random.default_rng(batch)
    greedy = SamplingParams(temperature=0.0, seed=0, max_tokens=steps, ignore_eos=True)

    def round_() -> tuple[int, float]:
        prompts = rng.integers(3, cfg.vocab_size, (batch, context))
        start = time.perf_counter()
        tokens = asyncio.run(_read_all(orch, prompts, greedy))
        return tokens, time.perf_counter() - start

    def settle() -> None:  # the compiles a round queued, done
        while engine.queued_compiles:
            time.sleep(0.05)

    try:
        for _ in range(2):
            round_()
        settle()
        for _ in range(EXTRA_WARMUPS):
            before = dict(engine.compiles)
            round_()
            settle()
            if engine.compiles["sync"] + engine.compiles["background"] == before["sync"] + before["background"]:
                break
        compiles = dict(engine.compiles)
        before = _times(orch)
        if trace:
            with jax.profiler.trace(trace):
                tokens, seconds = round_()
        else:
            tokens, seconds = round_()
        after = _times(orch)
    finally:
        orch.stop()
    turns = after["turns"] - before["turns"]
    per_turn = {k: 1e3 * (after[k] - before[k]) / max(turns, 1) for k in after if k != "turns"}
    return {"batch": batch, "tokens_s": tokens / seconds, "turns": int(turns), "ms_turn": per_turn.pop("seconds"),
            "phases": per_turn, "compiles": {k: engine.compiles[k] - compiles[k] for k in compiles}}


def print_profile(rows: list[dict]) -> None:
    from table import print_table  # bench/table.py

    from hypertron.serve.metrics import STEP_PHASES

    columns = COLUMNS + [(p, ">8.3f") for p in STEP_PHASES]
    print("serving loop, no HTTP: each phase in ms a turn (hypertron_step_phase_seconds)")
    print_table(columns, [(r["batch"], r["tokens_s"], r["turns"], r["ms_turn"], *(r["phases"][p] for p in STEP_PHASES))
                          for r in rows])
    for r in rows:
        k = r["compiles"]
        print(f"batch {r['batch']}: measured round: {k['sync']} compiles waited for, {k['background']} in the "
              f"background, {k['padded']} steps run padded")
