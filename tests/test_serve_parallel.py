"""A tensor- and expert-parallel serving engine (``--tensor N --expert M``) on the suite's 8 CPU
devices: the weights and KV pages split by training's rules give the one-device engine's tokens and
log-probabilities, through chunked prefill and mixed steps, greedy and seeded sampling."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest
from serving import padded_engine, run  # tests/serving.py

from hypertron.config import ConfigError, EngineConfig, load_config
from hypertron.models import init_params
from hypertron.serve.engine import PagedEngine, Shape
from hypertron.serve.types import DraftModel, SamplingParams

CONFIG = EngineConfig(max_slots=4, page_size=8, num_pages=64, max_top_logprobs=5, compile="lazy")
PROMPTS = [list(np.random.default_rng(i).integers(3, 500, 10 + 7 * i)) for i in range(3)]
# One compiled step holds every plan of these prompts (each runs padded to it): 4 decode rows, 4
# prefill rows of 16 tokens in all, with log-probabilities.
SHAPES = [Shape(num_decode=4, prefill_rows=4, prefill_tokens=16, logprobs=True)]


def _model(preset: str, *more: str):
    cfg = load_config(None, [f"model={preset}", "model.vocab_size=512", *more]).model
    return cfg, init_params(cfg, jax.random.key(0))


def _serve(params, cfg, tensor: int, temperature: float, expert: int = 1):
    """Each prompt's tokens and their top-5 log-probabilities, the second prompt sampled at
    ``temperature`` (seeded), the others greedy; 16 tokens a step, so prompts are prefilled in
    chunks beside other rows' decodes."""
    engine = padded_engine(params, cfg, dataclasses.replace(CONFIG, tensor=tensor, expert=expert), SHAPES)
    sampling = [SamplingParams(temperature=temperature * (i % 2), seed=7 + i, max_tokens=8, ignore_eos=True,
                               logprobs=5) for i in range(len(PROMPTS))]
    _, outs, _ = run(engine, PROMPTS, sampling, max_num_batched_tokens=16)
    tokens = [[o.token for o in outs[i] if o.token is not None] for i in range(len(PROMPTS))]
    top = np.array([[o.logprobs.top_logprobs for o in outs[i] if o.token is not None]
                    for i in range(len(PROMPTS))], dtype=float)
    return engine, tokens, top


@pytest.fixture(scope="module")
def dense():
    cfg, params = _model("tiny", "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=16")
    return cfg, params, _serve(params, cfg, 1, 0.8)[1:]


@pytest.mark.parametrize("tensor", [2, 4])
def test_tensor_parallel_steps_give_one_devices_tokens_and_logprobs(dense, tensor):
    cfg, params, (want, want_top) = dense
    engine, tokens, top = _serve(params, cfg, tensor, 0.8)
    assert tokens == want and engine.compiles["sync"] == 0  # every plan ran padded to the one shape
    np.testing.assert_allclose(top, want_top, atol=1e-5, rtol=0)
    # The rules' shards: query heads and KV pages split over the ranks, the step's state whole.
    first = lambda x: x.addressable_shards[0].data.shape  # noqa: E731
    assert first(engine.params["layers"][0]["wq"]) == (cfg.embed_dim, 8 // tensor, cfg.head_dim)
    assert first(engine.params["layers"][0]["w_gate"]) == (cfg.embed_dim, cfg.mlp_dim // tensor)
    assert first(engine.cache["k_pages"])[0] == 4 // tensor
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(engine.state)} == {tensor}


def test_a_draft_model_proposes_on_the_tensor_ranks(dense):
    """``--tensor 2`` with the model as its own draft (k = 4): the draft's weights and pool split as
    the served model's, the greedy prompts' tokens and log-probabilities are one device's without
    speculation, and drafts are kept."""
    cfg, params, (want, want_top) = dense
    engine = padded_engine(params, cfg, dataclasses.replace(CONFIG, tensor=2),
                           [Shape(num_decode=4, prefill_rows=4, prefill_tokens=16, logprobs=True, verify=4)],
                           draft=DraftModel(params, cfg, 4))
    sampling = [SamplingParams(temperature=0.0, seed=0, max_tokens=8, ignore_eos=True, logprobs=5)
                for _ in PROMPTS]
    _, outs, sched = run(engine, PROMPTS, sampling, max_num_batched_tokens=16, speculative="draft")
    for i in (0, 2):  # the greedy ones of `dense`
        got = [o for o in outs[i] if o.token is not None]
        assert [o.token for o in got] == want[i]
        np.testing.assert_allclose([o.logprobs.top_logprobs for o in got], want_top[i], atol=1e-5, rtol=0)
    assert sched.drafter.accepted > 0
    assert engine.draft_cache["k_pages"].addressable_shards[0].data.shape[0] == 4 // 2


@pytest.fixture(scope="module")
def moe():
    cfg, params = _model("tiny-moe")
    return cfg, params, _serve(params, cfg, 1, 0.8)[1:]


@pytest.mark.parametrize("expert, tensor", [(2, 1), (4, 1), (2, 2)])
def test_expert_parallel_steps_give_one_devices_tokens_and_logprobs(moe, expert, tensor):
    """``tiny-moe``'s 4 experts over ``expert`` devices (their hidden dimension over ``tensor``):
    each device computes its own experts' copies of the step's tokens, and the sum is the one
    device's, through prefill chunks and mixed steps, greedy and seeded."""
    cfg, params, (want, want_top) = moe
    engine, tokens, top = _serve(params, cfg, tensor, 0.8, expert=expert)
    assert tokens == want and engine.compiles["sync"] == 0
    np.testing.assert_allclose(top, want_top, atol=1e-5, rtol=0)
    first = lambda x: x.addressable_shards[0].data.shape  # noqa: E731
    experts, mlp = cfg.moe.num_experts, cfg.mlp_dim
    assert first(engine.params["layers"][0]["we_gate"]) == (experts // expert, cfg.embed_dim, mlp // tensor)
    assert first(engine.params["layers"][0]["we_down"]) == (experts // expert, mlp // tensor, cfg.embed_dim)


def _collectives(engine, shape) -> list[tuple[str, tuple[int, ...]]]:
    """The compiled step's collectives in order: (kind, result shape)."""
    import re

    found = re.findall(r"= \w+\[([\d,]*)\]\S* (all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)\(",
                       engine._compile(shape).as_text())
    return [(kind, tuple(int(n) for n in dims.split(",") if n)) for dims, kind in found]


def test_a_tensor_parallel_step_reduces_twice_a_layer_and_gathers_no_weight(dense):
    """At ``tensor=4`` (decode rows and a prefill): Megatron's two all-reduces of ``[tokens, embed]``
    a layer, one more for the embedding's vocab-parallel lookup, and no all-gather larger than the
    sampled rows' logits (no weight, no page travels)."""
    cfg, params, _ = dense
    engine = PagedEngine(params, cfg, dataclasses.replace(CONFIG, tensor=4))
    tokens, rows = SHAPES[0].num_decode + SHAPES[0].prefill_tokens, SHAPES[0].num_decode + SHAPES[0].prefill_rows
    found = _collectives(engine, SHAPES[0])
    wide = [c for c in found if c[0] == "all-reduce" and c[1][-2:] == (tokens, cfg.embed_dim)]
    assert 2 * cfg.num_layers <= len(wide) <= 2 * cfg.num_layers + 2
    assert max(math.prod(s) for kind, s in found if kind == "all-gather") <= rows * cfg.vocab_size
    assert {kind for kind, _ in found} == {"all-reduce", "all-gather"}


def test_an_expert_parallel_step_sums_each_moe_layer_once_and_moves_no_weight():
    """At ``expert=4`` the compiled step (decode rows and a prefill) holds one all-reduce per MoE
    layer, of ``[tokens, embed]``, and no other collective: no expert weight travels."""
    cfg, params = _model("tiny-moe")
    engine = PagedEngine(params, cfg, dataclasses.replace(CONFIG, expert=4))
    tokens = SHAPES[0].num_decode + SHAPES[0].prefill_tokens
    assert _collectives(engine, SHAPES[0]) == [("all-reduce", (tokens, cfg.embed_dim))] * cfg.num_layers


@pytest.mark.parametrize("tensor, expert, quantize, preset", [(4, 1, "none", "tiny"), (2, 1, "int8", "tiny"),
                                                             (1, 4, "none", "tiny-moe"), (2, 2, "int8", "tiny-moe")])
def test_the_serving_plans_weights_per_device_are_a_real_engines_shards(tensor, expert, quantize, preset):
    """``hypertron plan --serve``'s weights per device (:func:`weight_bytes`, from the config alone)
    equal the bytes one device of a tensor- or expert-parallel engine holds, int8 values and
    scales included."""
    from hypertron.models.serve_plan import weight_bytes
    from hypertron.serve.model import prepare_params

    cfg, params = _model(preset, *(() if preset == "tiny-moe" else
                                   ("model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=16")))
    engine = PagedEngine(prepare_params(params, cfg, quantize), cfg,
                         dataclasses.replace(CONFIG, tensor=tensor, expert=expert))
    device = engine.mesh.devices.flat[0]
    held = sum(s.data.nbytes for x in jax.tree.leaves(engine.params) for s in x.addressable_shards if s.device == device)
    assert weight_bytes(cfg, quantize, accelerator=False, mesh={"tensor": tensor, "expert": expert}) == held
    # and the KV pool hypertron serve checks before loading: kv_cache_bytes of its pages' tokens
    from hypertron.models.memory import kv_cache_bytes

    pool = sum(s.data.nbytes for x in jax.tree.leaves(engine.cache) for s in x.addressable_shards if s.device == device)
    assert kv_cache_bytes(cfg, CONFIG.num_pages * CONFIG.page_size, "float32", tensor) == pool


def test_fewer_kv_heads_than_ranks_are_read_whole_by_each():
    """``tiny-gemma``'s one KV head over 2 ranks: its pages on both, the query heads split, each
    rank's attention (in ``shard_map``) reading the head its queries need: no page travels."""
    cfg, params = _model("tiny-gemma")
    _, want, want_top = _serve(params, cfg, 1, 0.8)
    engine, tokens, top = _serve(params, cfg, 2, 0.8)
    assert tokens == want
    np.testing.assert_allclose(top, want_top, atol=1e-5, rtol=0)
    assert engine.cache["k_pages"].addressable_shards[0].data.shape == engine.cache["k_pages"].shape
    rows = SHAPES[0].num_decode + SHAPES[0].prefill_rows
    assert max(math.prod(s) for kind, s in _collectives(engine, SHAPES[0]) if kind == "all-gather") <= rows * cfg.vocab_size


@pytest.mark.parametrize("preset,split,message", [
    ("tiny", {"tensor": 3}, "--tensor=3 does not divide the model's 4 attention heads"),
    ("tiny", {"tensor": 16}, "--tensor=16: this host has 8 devices"),
    ("tiny-moe", {"tensor": 4, "expert": 4}, "--tensor=4 --expert=4: this host has 8 devices"),
    ("tiny-moe", {"expert": 3}, "--expert=3 does not divide the model's 4 experts"),
    ("tiny", {"expert": 2}, "--expert=2: tiny has no experts"),
    ("tiny", {"tensor": 2, "enable_lora": True}, "--tensor=2 with LoRA adapters: not supported yet"),
])
def test_a_split_the_model_or_host_cannot_take_is_one_line(preset, split, message):
    cfg, params = _model(preset)
    with pytest.raises(ConfigError, match=message):
        PagedEngine(params, cfg, dataclasses.replace(CONFIG, **split))


def test_a_draft_model_the_split_cannot_take_is_one_line():
    """The draft model is split as the served one is: heads over ``tensor`` (refused in one line where
    they do not divide); a dense draft beside ``--expert`` ranks is whole on each."""
    cfg, params = _model("tiny", "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=16")
    small, small_params = _model("tiny")  # 4 heads
    with pytest.raises(ConfigError, match="^draft_model: --tensor=8 does not divide the model's 4 attention heads"):
        PagedEngine(params, cfg, dataclasses.replace(CONFIG, tensor=8), draft=DraftModel(small_params, small, 2))
    moe, moe_params = _model("tiny-moe")
    engine = PagedEngine(moe_params, moe, dataclasses.replace(CONFIG, expert=2), draft=DraftModel(small_params, small, 2))
    assert engine.draft_params["layers"][0]["wq"].sharding.is_fully_replicated


def test_the_openai_client_gets_one_devices_greedy_text_from_a_four_way_server():
    """The served path (``hypertron serve``'s app over the orchestrator) with ``--tensor 4``: the
    official ``openai`` client's completions and chat completions, greedy, are ``--tensor 1``'s."""
    from test_server import MODEL, Server, client  # tests/

    cfg, params = _model("tiny", "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=16",
                         "model.vocab_size=2048")  # the HTTP bench's shape
    texts = []
    for tensor in (1, 4):
        engine = PagedEngine(params, cfg, dataclasses.replace(CONFIG, tensor=tensor, max_top_logprobs=1))
        with Server(engine) as server:
            c = client(server)
            texts.append([c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
                          for p in ("Hello there", "The tensor-parallel server")]
                         + [c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=8, temperature=0).choices[0].message.content])
    assert texts[0] == texts[1] and all(texts[0])


def test_a_run_loads_into_its_shards(tmp_path, monkeypatch):
    """``load_engine`` with ``--tensor 4`` restores the checkpoint straight into the rules' shards
    (what the cast to the serving dtype gets is already split: no device held a whole split weight)
    and serves ``--tensor 1``'s greedy tokens."""
    from hypertron.checkpoint import save_params
    from hypertron.config import Config, TrainConfig
    from hypertron.serve import model as serve_model
    from hypertron.serve.loading import load_engine

    cfg, params = _model("tiny", "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=16")
    run_dir = tmp_path / "run"
    save_params(run_dir, Config(run_dir=str(run_dir), model=cfg, train=TrainConfig(seq_len=32)), params)
    seen, prepare = [], serve_model.prepare_params
    monkeypatch.setattr(serve_model, "prepare_params", lambda p, *a: seen.append(p) or prepare(p, *a))
    tokens = []
    for tensor in (1, 4):
        engine, _, _ = load_engine(run_dir, dataclasses.replace(CONFIG, tensor=tensor, compile="background"))
        engine._enqueue = lambda shape: None  # as padded_engine: every plan runs padded to the shape the
        engine._compile(SHAPES[0])  # tests above compiled (the same executable: no compile here)
        _, outs, _ = run(engine, PROMPTS[:2], [SamplingParams(temperature=0.0, seed=0, max_tokens=6, ignore_eos=True)] * 2,
                         max_num_batched_tokens=16)
        tokens.append([[o.token for o in outs[i] if o.token is not None] for i in range(2)])
    wq = seen[-1]["layers"]["wq"]  # [layers, embed, heads, head_dim], as restored, before the cast
    assert wq.addressable_shards[0].data.shape == (cfg.num_layers, cfg.embed_dim, 8 // 4, cfg.head_dim)
    assert tokens[0] == tokens[1] and all(tokens[0])


@pytest.mark.parametrize("preset, flags, message", [
    ("tiny-moe", ["--expert", "3"], "--expert=3 does not divide the model's 4 experts"),
    ("tiny", ["--expert", "2"], "--expert=2: tiny has no experts (a dense model: --tensor splits it)"),
    ("tiny", ["--tensor", "3"], "--tensor=3 does not divide the model's 4 attention heads"),
])
def test_hypertron_serve_refuses_a_split_in_one_line(tmp_path, capsys, preset, flags, message):
    from hypertron import cli
    from hypertron.checkpoint import save_params
    from hypertron.config import Config, TrainConfig

    cfg, params = _model(preset)
    save_params(tmp_path / "run", Config(run_dir=str(tmp_path / "run"), model=cfg, train=TrainConfig(seq_len=32)), params)
    assert cli.main(["serve", "--checkpoint", str(tmp_path / "run"), *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
