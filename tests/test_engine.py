"""The serving engine: paged KV cache bookkeeping, int8 pages, per-request sampling.

Parity with ``transformers`` greedy generation through the engine (several
requests of different lengths sharing decode steps) is in ``test_hf.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.config import ConfigError, load_config
from hypertron.models import init_params
from hypertron.models.kv_pages import bytes_per_token
from hypertron.config import PRESETS
from hypertron.serve.engine import PagedEngine, decode_logits
from hypertron.serve.sampling import sample_rows
from hypertron.serve.types import SamplingParams

CFG = dataclasses.replace(PRESETS["tiny"], num_layers=2, max_seq_len=64)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


def _run(engine, prompt, sampling, steps, slot=0):
    prefix = engine.prefill(prompt, sampling)
    engine.insert(prefix, slot)
    out = [prefix.first_token]
    for _ in range(steps):
        assert engine.reserve_step() == []
        out.append(int(engine.generate().tokens[slot]))
    return out


def test_pages_follow_the_real_length_and_come_back(params):
    engine = PagedEngine(params, CFG, max_slots=2, page_size=4, num_pages=9)  # 8 usable pages
    assert engine.stats() == {"slots_in_use": 0, "slots_total": 2, "pages_free": 8, "pages_total": 8}
    prefix = engine.prefill(list(range(10, 16)), GREEDY)  # 6 tokens: 2 pages
    engine.insert(prefix, 1)
    assert engine.stats()["pages_free"] == 6 and engine.stats()["slots_in_use"] == 1
    for step in range(3):  # writes positions 6, 7, 8: the third needs a third page
        assert engine.reserve_step() == []
        engine.generate()
        assert engine.stats()["pages_free"] == (6 if step < 2 else 5)
    engine.free(1)
    assert engine.stats() == {"slots_in_use": 0, "slots_total": 2, "pages_free": 8, "pages_total": 8}


def test_an_exhausted_pool_names_the_slots_left_without_a_page(params):
    engine = PagedEngine(params, CFG, max_slots=2, page_size=4, num_pages=4)  # 3 usable pages
    a = engine.prefill([5, 6, 7], GREEDY)
    b = engine.prefill([8, 9, 10, 11, 12, 13, 14], GREEDY)  # 7 tokens: 2 pages
    engine.insert(a, 0)
    engine.insert(b, 1)
    assert not engine.can_prefill(1)  # pages are taken at prefill: none is left for another prompt
    with pytest.raises(RuntimeError, match="ask can_prefill first"):
        engine.prefill([1], GREEDY)
    assert engine.stats()["pages_free"] == 0  # the refused prefill took none
    assert engine.reserve_step() == []  # slot 0 writes position 3 (page 0), slot 1 position 7 (page 1)
    engine.generate()
    assert engine.reserve_step() == [0, 1]  # both cross into a new page; none is free
    engine.free(1)  # pre-empt one: the other goes on
    assert engine.reserve_step() == []
    engine.generate()


def test_a_step_reads_only_the_page_table_columns_the_longest_slot_needs(params):
    engine = PagedEngine(params, CFG, max_slots=2, page_size=4)  # 16 columns per slot
    assert engine._table_width() == 1
    engine.insert(engine.prefill(list(range(10, 17)), GREEDY), 0)  # 7 tokens + this step's: 2 pages
    assert engine._table_width() == 2
    engine.insert(engine.prefill(list(range(20, 29)), GREEDY), 1)  # 9 + 1 tokens: 3 pages
    assert engine._table_width() == 3
    engine.lengths[1] = 36  # 37 tokens: 10 pages, rounded up to 10 (a quarter of 8 is 2)
    assert engine._table_width() == 10
    engine.lengths[1] = 9
    assert engine.reserve_step() == []
    full_logits, _ = decode_logits(params, engine.cache, engine.last_tokens, engine.lengths, engine.page_table,
                                   CFG)
    out = engine.generate()  # over the first 3 columns only
    want = jax.nn.log_softmax(full_logits, axis=-1)[np.arange(2), out.tokens]
    np.testing.assert_allclose(out.logprobs, want, atol=1e-5)
    assert out.tokens.tolist() == np.argmax(full_logits, axis=-1).tolist()


def test_the_same_seed_gives_the_same_tokens_whatever_else_is_in_the_batch(params):
    sampled = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7)
    alone = _run(PagedEngine(params, CFG, max_slots=3, page_size=8), [40, 41, 42], sampled, 6, slot=0)
    engine = PagedEngine(params, CFG, max_slots=3, page_size=8)
    engine.insert(engine.prefill([50, 51, 52, 53, 54], SamplingParams(temperature=0.7, seed=1)), 0)
    together = _run(engine, [40, 41, 42], sampled, 6, slot=2)
    assert together == alone
    other_seed = _run(PagedEngine(params, CFG, max_slots=1, page_size=8), [40, 41, 42],
                      dataclasses.replace(sampled, seed=8), 6)
    assert other_seed != alone


def test_sample_rows_applies_each_rows_settings():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4))
    temperature = jnp.array([0.0, 1.0, 1.0, 1.0])
    top_k = jnp.array([0, 1, 0, 2])
    top_p = jnp.array([1.0, 1.0, 0.4, 1.0])
    seeds = jnp.arange(800, dtype=jnp.uint32).reshape(200, 4)  # 200 draws per row, one compiled call
    draw = jax.jit(jax.vmap(lambda s: sample_rows(logits, temperature, top_k, top_p, s, jnp.zeros(4, jnp.int32))))
    draws = np.asarray(draw(seeds))
    assert (draws[:, 0] == 0).all()  # greedy
    assert (draws[:, 1] == 0).all()  # top-1
    assert (draws[:, 2] == 0).all()  # top-p 0.4: the 0.5 token alone reaches it
    assert set(draws[:, 3]) == {0, 1}  # top-2: both kept tokens drawn, nothing else


def test_bytes_per_cached_token_int8_vs_bf16():
    # head_dim 128 (Llama 3, Mistral) and 256 (Gemma): int8 values + one bf16 scale per token and head.
    for name in ("llama3-8b", "mistral-7b", "gemma-7b"):
        ratio = bytes_per_token(PRESETS[name], jnp.int8) / bytes_per_token(PRESETS[name], jnp.bfloat16)
        assert ratio <= 0.53, (name, ratio)
    # What the engine really allocates, for a model with head_dim 64.
    cfg = dataclasses.replace(CFG, num_heads=2, num_kv_heads=2, head_dim=64)
    params = init_params(cfg, jax.random.key(0))
    nbytes = {d: sum(x.nbytes for x in PagedEngine(params, cfg, max_slots=1, page_size=8,
                                                   kv_cache_dtype=d).cache.values())
              for d in ("int8", "bfloat16")}
    assert nbytes["int8"] / nbytes["bfloat16"] <= 0.53


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny model after 60 steps on the embedded corpus (its logits are no longer flat)."""
    from hypertron.checkpoint import load_params
    from hypertron.train.loop import train

    run = tmp_path_factory.mktemp("kv") / "run"
    cfg = load_config(None, ["model=tiny", "model.num_layers=2", "train.steps=60", "train.global_batch=8",
                             "train.seq_len=64", "train.lr=3e-3", "train.warmup_steps=5", f"run_dir={run}",
                             "checkpoint.every=60"])
    train(cfg)
    return load_params(run)


def _teacher_forced_logprobs(params, cfg, kv_dtype, tokens, prompt_len):
    engine = PagedEngine(params, cfg, max_slots=1, page_size=8, kv_cache_dtype=kv_dtype)
    engine.insert(engine.prefill(tokens[:prompt_len], GREEDY), 0)
    step = jax.jit(decode_logits, static_argnames="cfg")
    out = []
    for t in tokens[prompt_len:]:
        engine.reserve_step()
        logits, engine.cache = step(params, engine.cache, jnp.array([t], jnp.int32), jnp.asarray(engine.lengths),
                                    jnp.asarray(engine.page_table), cfg=cfg)
        engine.lengths = engine.lengths + 1
        out.append(jax.nn.log_softmax(logits[0]))
    return np.stack(out)


@pytest.mark.gpu
def test_int8_kv_cache_stays_close_to_bf16_on_a_trained_model(trained):
    cfg, params = trained
    text = b"def main(argv):\n    for name in sorted(argv):\n        print(name)\n    return 0\n"
    tokens = [b + 3 for b in text]
    ref = _teacher_forced_logprobs(params, cfg.model, "float32", tokens, 8)
    bf16 = _teacher_forced_logprobs(params, cfg.model, "bfloat16", tokens, 8)
    int8 = _teacher_forced_logprobs(params, cfg.model, "int8", tokens, 8)
    assert np.mean(np.exp(ref).max(-1)) > 0.2  # trained: the model is fairly sure of its next byte
    # Stated tolerance: over the whole vocabulary at every position, int8 pages put no
    # log-probability more than 0.05 nats from bf16 pages' (measured: 0.014; bf16 vs float32: 0.003).
    assert np.abs(int8 - bf16).max() < 0.05
    assert np.abs(bf16 - ref).max() < 0.02
    assert (int8.argmax(-1) == bf16.argmax(-1)).mean() > 0.95


def test_engine_settings_are_checked(params):
    with pytest.raises(ConfigError, match="kv_cache_dtype=fp8"):
        PagedEngine(params, CFG, kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="page_size=6"):
        PagedEngine(params, CFG, page_size=6)
    engine = PagedEngine(params, CFG, max_slots=1)
    with pytest.raises(ValueError, match="1 to 63 tokens"):
        engine.prefill(list(range(3, 67)), GREEDY)


def test_a_bf16_run_is_served_with_bf16_weights_cast_once_at_load(tmp_path):
    """A run with float32 master weights and bf16 compute, loaded for serving: every matmul and
    embedding weight on the device is bf16 (counted in bytes), norms and the MoE router float32 (the
    model computes them in float32). Its logits over a teacher-forced continuation equal our float32
    model on the same bf16-rounded weights within 2e-2 relative (measured on CPU: 6.4e-3), and its greedy
    tokens equal that reference's."""
    from hypertron.checkpoint import save_params
    from hypertron.config import Config, TrainConfig
    from hypertron.models import declare, forward
    from hypertron.models.params import leaves_with_paths
    from hypertron.serve.engine import load_engine

    model = dataclasses.replace(PRESETS["tiny-moe"], num_layers=2, max_seq_len=64, dtype="bfloat16")
    cfg = Config(run_dir=str(tmp_path / "run"), model=model, train=TrainConfig(seq_len=32))
    master = init_params(model, jax.random.key(3))
    save_params(tmp_path / "run", cfg, master)
    engine, _, _ = load_engine(tmp_path / "run", max_slots=1, page_size=8)

    def at(tree, path):
        for key in path:
            tree = tree[key]
        return tree

    low = full = 0
    for path, spec in leaves_with_paths(declare(model)):
        w = at(engine.params, path)
        assert w.dtype == (jnp.bfloat16 if spec.quantize else jnp.float32), path
        assert isinstance(w, jax.Array), path  # on the device, not numpy waiting to be copied each step
        if spec.quantize:
            low += w.nbytes
        full += w.size * 4
    assert {p[-1] for p, s in leaves_with_paths(declare(model)) if not s.quantize} >= {"router", "attn_norm"}
    assert low > 0.9 * full / 2 and sum(x.nbytes for x in jax.tree.leaves(engine.params)) < 0.55 * full

    # The reference: float32 compute on the bf16-rounded weights.
    ref_cfg = dataclasses.replace(model, dtype="float32")
    rounded = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), engine.params)
    prompt = [5, 17, 33, 101, 7]
    prefix = engine.prefill(prompt, GREEDY)
    engine.insert(prefix, 0)
    tokens = [prefix.first_token]
    for _ in range(7):
        engine.reserve_step()
        tokens.append(int(engine.generate().tokens[0]))
    seq = jnp.asarray([prompt + tokens])
    ref_logits = forward(rounded, seq, ref_cfg)[0, len(prompt) - 1:-1]
    ours = forward(engine.params, seq, engine.cfg)[0, len(prompt) - 1:-1].astype(jnp.float32)
    rel = float(jnp.linalg.norm(ours - ref_logits) / jnp.linalg.norm(ref_logits))
    assert rel < 2e-2, rel
    assert tokens == [int(t) for t in jnp.argmax(ref_logits, -1)]
