"""The slots' sequences held on the device (``PagedEngine.state``): what a step uploads, and that
the device's lengths, page tables and token histories are what the host knows.

Greedy parity with the full forward and with ``transformers`` through the same engine is in
``test_engine.py`` and ``test_hf.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from serving import scheduler_for  # tests/

from hypertron.config import PRESETS, EngineConfig
from hypertron.models import init_params
from hypertron.models.kv_pages import NULL_PAGE
from hypertron.serve import engine as engine_module
from hypertron.serve.engine import PagedEngine, Shape
from hypertron.serve.scheduler import Request
from hypertron.serve.types import Row, SamplingParams, StepPlan

CFG = dataclasses.replace(PRESETS["tiny"], num_layers=1, embed_dim=32, mlp_dim=64, max_seq_len=512)
GREEDY = SamplingParams(temperature=0.0, seed=0, max_tokens=8)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


def _count_uploads(engine, monkeypatch) -> list[int]:
    """Spy on what the engine hands the device from the host: the numbers in the numpy arrays
    passed to each call of a compiled step (one int32 array) or of ``write_deltas`` go to the
    list returned."""
    sent, executable, deltas = [], engine._executable, engine_module.write_deltas

    def numbers(*trees) -> int:
        return sum(x.size for x in jax.tree.leaves(trees) if isinstance(x, np.ndarray))

    def spy_executable(exact, keys=0):
        shape, fn = executable(exact, keys)

        def counted(params, cache, state, batch, *draft):
            assert numbers(params, cache, state, *draft) == 0  # the model, pool and state stay on the device
            assert isinstance(batch, np.ndarray) and batch.dtype == np.int32  # one copy a step (step_batch)
            sent.append(numbers(batch))
            return fn(params, cache, state, batch, *draft)

        return shape, counted

    def spy_deltas(state, pages, tokens):
        sent.append(numbers(pages, tokens))
        return deltas(state, pages, tokens)

    monkeypatch.setattr(engine, "_executable", spy_executable)
    monkeypatch.setattr(engine_module, "write_deltas", spy_deltas)
    return sent


def test_a_64_row_decode_step_at_width_128_uploads_numbers_per_row_not_per_page(params, monkeypatch):
    """64 decode rows of 509 tokens in pages of 4 (128 columns each): the first step sends every
    slot's 128 pages (the admission's cost, once); the next step, no row crossing a page, sends a
    handful of numbers a row, under 16 a row where the table alone was 64 x 128 before."""
    rows, width = 64, 128
    engine = PagedEngine(params, CFG, EngineConfig(max_slots=rows, page_size=4, num_pages=257, compile="lazy"))
    assert engine.pages_per_seq == width
    sent = _count_uploads(engine, monkeypatch)
    pages = [tuple(1 + (s * width + c) % 256 for c in range(width)) for s in range(rows)]
    per_step = []
    for start in (507, 508):
        plan = StepPlan.of(start, tuple(Row(s, s, start, (), pages[s], GREEDY) for s in range(rows)), ())
        assert engine.shape(plan).num_decode == rows
        engine.run(plan)
        per_step.append(sum(sent))
        sent.clear()
    assert per_step[0] >= rows * width * 3  # (slot, column, page) for every entry, once
    assert per_step[1] < rows * 16 < rows * width
    table = np.asarray(engine.state["table"])
    assert table[:rows].tolist() == [list(p) for p in pages] and (table[rows] == NULL_PAGE).all()
    assert np.asarray(engine.state["seq_lens"])[:rows].tolist() == [509] * rows


def test_the_device_holds_each_slots_length_pages_and_tokens_as_the_host_knows_them(params, monkeypatch):
    """Two slots, prefills mixed with decodes (16 tokens a step), prefix caching on: a third
    request takes the slot of one that ended (its table row rewritten) and finds the first page of
    the first request's prompt cached (its tokens written into its history, not computed). After
    every step each running slot's ``seq_lens``, page-table row and token history equal the
    host's, the tokens sampled on the device included. Every step runs padded to one compiled
    shape (one compile; padding rows and tokens write nowhere that counts)."""
    engine = PagedEngine(params, CFG, EngineConfig(max_slots=2, page_size=8, num_pages=12, compile="background"))
    monkeypatch.setattr(engine, "_enqueue", lambda shape: None)
    engine._compile(Shape(num_decode=2, prefill_rows=2, prefill_tokens=16))
    sched = scheduler_for(engine, max_num_batched_tokens=16, max_prefill_rows=2)
    rng = np.random.default_rng(0)
    first, short = rng.integers(3, CFG.vocab_size, 13).tolist(), rng.integers(3, CFG.vocab_size, 6).tolist()
    seqs = [Request(0, first, GREEDY), Request(1, short, dataclasses.replace(GREEDY, max_tokens=2)),
            Request(2, first[:9] + rng.integers(3, CFG.vocab_size, 4).tolist(), GREEDY)]
    for seq in seqs[:2]:
        sched.add(seq)
    slots, checked = {}, 0
    for n in range(40):
        if n == 3:
            sched.add(seqs[2])
        plan = sched.schedule()
        if plan is None:
            break
        sched.update(plan, engine.run(plan))
        state = jax.device_get(engine.state)
        for seq in sched.running.values():
            slots.setdefault(seq.id, seq.slot)
            known = seq.computed if seq.computed < len(seq.fill) else len(seq.prompt) + len(seq.generated)
            assert state["history"][seq.slot, :known].tolist() == (seq.prompt + seq.generated)[:known]
            assert state["seq_lens"][seq.slot] == seq.computed
            row = state["table"][seq.slot]
            assert row[:len(seq.pages)].tolist() == seq.pages and (row[len(seq.pages):] == NULL_PAGE).all()
            checked += 1
    assert not sched.has_work and checked > 10
    assert slots[2] == slots[1] and seqs[2].cached_tokens == 8  # the ended one's slot; a page found cached
    assert any(r.decodes and r.prefills for r in sched.records) and len(engine.compiled_shapes) == 1
    assert all(len(s.generated) == s.sampling.max_tokens for s in seqs)


def test_a_steps_inputs_travel_in_one_int32_array_and_come_back_as_written():
    from hypertron.serve.step_batch import StepBatch, unpack

    sb = StepBatch(rows=3, tokens=5, targets=True, nowhere=7)
    f = sb.fields
    f["pre_tokens"][:] = [5, 6, 7, 8, 9]
    f["pre_valid"][:3] = 1
    f["targets"][:] = [-1, 2, 3, 4, 5]
    f["temperature"][:] = [0.0, 0.7, 1.5]
    f["top_p"][1] = 0.25
    f["seed"][:] = [0, 2**32 - 1, 12345]
    f["slot"][0] = 2
    out = jax.jit(lambda a: unpack(a, 3, 5, True))(sb.array)
    assert sb.array.dtype == np.int32 and sb.array.size == 5 * 5 + 3 * 10
    assert np.asarray(out["pre_valid"]).tolist() == [True] * 3 + [False] * 2
    assert np.asarray(out["temperature"]).tolist() == np.float32([0.0, 0.7, 1.5]).tolist()
    assert np.asarray(out["top_p"]).tolist() == np.float32([1.0, 0.25, 1.0]).tolist()
    assert out["seed"].dtype == np.uint32 and np.asarray(out["seed"]).tolist() == [0, 2**32 - 1, 12345]
    assert np.asarray(out["slot"]).tolist() == [2, 7, 7] and np.asarray(out["out_slot"]).tolist() == [7, 7, 7]
    assert np.asarray(out["targets"]).tolist() == [-1, 2, 3, 4, 5]
    assert np.asarray(out["pre_tokens"]).tolist() == [5, 6, 7, 8, 9]
