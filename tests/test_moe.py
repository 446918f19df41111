"""Mixture-of-Experts: capped and dropless routing against hand-computed expectations.

The expert math is checked against a per-token loop (each token through its
own experts, weighted by the router), which is the definition of the layer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.config import ModelConfig, MoEConfig, load_config
from hypertron.models import forward, init_params
from hypertron.models.decoder import activation
from hypertron.models.moe import _capped, _dropless, capacity, moe_mlp, route
from hypertron.config import PRESETS
from hypertron.quant import einsum_for

EINSUM = einsum_for("none", jnp.float32)


def _cfg(**moe) -> ModelConfig:
    return dataclasses.replace(PRESETS["tiny-moe"], num_layers=2, embed_dim=32, mlp_dim=24, num_heads=2,
                               num_kv_heads=1, head_dim=16,
                               moe=dataclasses.replace(PRESETS["tiny-moe"].moe, **moe))


def _layer_params(cfg: ModelConfig, seed: int = 0) -> dict:
    params = init_params(cfg, jax.random.key(seed))
    return jax.tree.map(lambda a: a[0], params["layers"])


def _per_token(x_td, weights_tk, experts_tk, p, cfg, keep_tk=None):
    """The layer by definition: each kept copy through its expert, weighted, summed per token."""
    out = np.zeros(x_td.shape, np.float32)
    for t in range(x_td.shape[0]):
        for j in range(experts_tk.shape[1]):
            if keep_tk is not None and not keep_tk[t, j]:
                continue
            e = int(experts_tk[t, j])
            x = x_td[t]
            h = activation(x @ p["we_gate"][e], cfg) * (x @ p["we_up"][e])
            out[t] += float(weights_tk[t, j]) * np.asarray(h @ p["we_down"][e])
    return out


@pytest.mark.slow
def test_capped_drops_exactly_the_copies_past_capacity():
    cfg = _cfg(num_experts=2, top_k=2, mode="capped", capacity_factor=0.3)  # ceil(0.3 x 6 x 2 / 2) per sequence
    assert capacity(cfg, 6) == 2
    p = _layer_params(cfg)
    x_td = jax.random.normal(jax.random.key(3), (6, cfg.embed_dim))
    experts_tk = jnp.array([[0, 1], [0, 1], [0, 1], [1, 0], [0, 1], [1, 0]], jnp.int32)
    weights_tk = jnp.array([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1], [0.8, 0.2], [0.5, 0.5], [0.55, 0.45]])
    # By hand: first choices go first, in token order. Expert 0 is the first choice of tokens 0, 1,
    # 2, 4 and keeps 0 and 1; expert 1 keeps tokens 3 and 5. Every second choice finds its expert full.
    keep = np.zeros((6, 2), bool)
    keep[[0, 1, 3, 5], 0] = True
    # Jitted: one compile per batch shape instead of one per primitive run eagerly.
    capped = jax.jit(_capped, static_argnums=(4, 5, 6))
    y_td, dropped = capped(x_td[None], weights_tk, experts_tk, p, cfg, EINSUM, activation)
    np.testing.assert_allclose(y_td, _per_token(x_td, weights_tk, experts_tk, p, cfg, keep), rtol=1e-5, atol=1e-6)
    assert float(dropped) == pytest.approx(8 / 12)
    # Capacity is per sequence: the same six tokens as a second row of a batch drop the same copies.
    x2 = jnp.stack([jnp.roll(x_td, 1, axis=0), x_td])
    y2, dropped2 = capped(x2, jnp.concatenate([weights_tk, weights_tk]), jnp.concatenate([experts_tk, experts_tk]),
                          p, cfg, EINSUM, activation)
    np.testing.assert_allclose(y2[6:], y_td, rtol=1e-5, atol=1e-6)
    assert float(dropped2) == pytest.approx(8 / 12)


@pytest.mark.slow
@pytest.mark.parametrize("gating", ["topk_softmax", "softmax_topk"])
def test_capped_with_room_for_everything_equals_dropless(gating):
    cfg = _cfg(gating=gating)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 3, cfg.vocab_size)
    dropless = forward(params, tokens, cfg, stats=True)
    big = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, mode="capped", capacity_factor=100.0))
    capped = forward(params, tokens, big, stats=True)
    np.testing.assert_allclose(capped.logits, dropless.logits, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(capped.stats["dropped"])) == 0.0
    small = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, mode="capped", capacity_factor=0.5))
    s3 = forward(params, tokens, small, stats=True).stats
    assert float(jnp.min(s3["dropped"])) >= 0.5 - 1e-6  # at most half of the copies fit


def test_dropless_keeps_every_token_when_all_go_to_one_expert():
    cfg = _cfg(num_experts=4, top_k=1)
    p = _layer_params(cfg)
    x_td = jax.random.normal(jax.random.key(5), (10, cfg.embed_dim))
    p["router"] = jnp.zeros_like(p["router"]).at[:, 2].set(1.0)
    x_td = jnp.abs(x_td)  # positive inputs: expert 2 has the largest logit for every token
    weights_tk, experts_tk, losses = route(x_td, p["router"], cfg)
    assert (np.asarray(experts_tk) == 2).all() and float(losses["load"][2]) == 10
    y_td = _dropless(x_td, weights_tk, experts_tk, p, cfg, activation)
    np.testing.assert_allclose(y_td, _per_token(x_td, weights_tk, experts_tk, p, cfg), rtol=1e-5, atol=1e-6)
    assert float(losses["load_balance"]) == pytest.approx(4.0)  # all load on one expert: E x 1 x 1


def test_mixtral_gating_is_softmax_over_the_chosen_logits():
    cfg = _cfg(num_experts=4, top_k=2)
    router = jnp.eye(cfg.embed_dim, 4)
    x_td = jnp.zeros((1, cfg.embed_dim)).at[0, :4].set(jnp.array([1.0, 3.0, 2.0, -1.0]))
    weights_tk, experts_tk, _ = route(x_td, router, cfg)
    assert experts_tk.tolist() == [[1, 2]]
    np.testing.assert_allclose(weights_tk[0], jax.nn.softmax(jnp.array([3.0, 2.0])), rtol=1e-6)


def test_shared_experts_add_a_dense_mlp():
    cfg = _cfg(shared_experts=1)
    p = _layer_params(cfg)
    x = jax.random.normal(jax.random.key(2), (1, 4, cfg.embed_dim))
    y, _ = moe_mlp(x, p, cfg, EINSUM, activation)
    no_shared = {k: v for k, v in p.items() if not k.startswith("w_")}
    y0, _ = moe_mlp(x, no_shared, dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_experts=0)),
                    EINSUM, activation)
    dense = (activation(x @ p["w_gate"], cfg) * (x @ p["w_up"])) @ p["w_down"]
    np.testing.assert_allclose(y, y0 + dense, rtol=1e-5, atol=1e-5)


def test_moe_config_errors():
    from hypertron.config import ConfigError

    with pytest.raises(ConfigError, match="model.moe.top_k=9"):
        load_config(None, ["model=tiny-moe", "model.moe.top_k=9"])
    with pytest.raises(ConfigError, match="model.moe.mode"):
        load_config(None, ["model=tiny-moe", "model.moe.mode=sometimes"])
    cfg = load_config(None, ["model=tiny", "model.moe.num_experts=4"])  # a dense preset made MoE
    assert cfg.model.moe == MoEConfig(num_experts=4)


@pytest.mark.slow
def test_tiny_moe_trains_on_the_embedded_corpus_like_the_dense_tiny_model(tmp_path, one_device):
    # One device: the learning does not depend on the mesh (test_expert_parallel.py: meshes give one device's step).
    from hypertron.train.loop import train

    common = ["model.num_layers=2", "train.global_batch=8", "train.seq_len=64", "train.steps=30",
              "train.lr=3e-3", "train.warmup_steps=5", "train.log_every=10", "checkpoint.enabled=false"]
    results = {}
    for preset in ("tiny", "tiny-moe"):
        results[preset] = train(load_config(None, [f"model={preset}", f"run_dir={tmp_path / preset}", *common]))
    dense, moe = (np.mean(results[p].losses[-5:]) for p in ("tiny", "tiny-moe"))
    first = np.mean(results["tiny-moe"].losses[:3])
    assert first > 5.0 and moe < first - 1.5, (first, moe)
    assert abs(moe - dense) < 0.25, (moe, dense)
    row = results["tiny-moe"].rows[-1]
    assert len(row["expert_load"]) == 4 and sum(row["expert_load"]) == pytest.approx(1.0)
    assert row["moe_dropped"] == 0.0 and np.isfinite(row["moe_load_balance"])


def test_flops_count_only_the_active_experts():
    from hypertron.models.flops import forward_flops_per_token

    moe, dense = PRESETS["tiny-moe"], PRESETS["tiny"]  # 2 of 4 experts of 192 = one MLP of 384
    router = 2 * moe.embed_dim * moe.moe.num_experts
    assert forward_flops_per_token(moe, 128) == forward_flops_per_token(dense, 128) + moe.num_layers * router


@pytest.mark.parametrize("mode", ["dropless", "capped"])
def test_padding_takes_no_capacity_and_no_part_in_the_router_statistics(mode):
    cfg = _cfg(mode=mode, capacity_factor=1.0)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 3, cfg.vocab_size)
    segments = jnp.ones((2, 16), jnp.int32).at[:, 10:].set(0)  # the last 6 positions of each row are padding
    other = tokens.at[:, 10:].set(jax.random.randint(jax.random.key(2), (2, 6), 3, cfg.vocab_size))
    a = forward(params, tokens, cfg, segment_ids=segments, stats=True)
    b = forward(params, other, cfg, segment_ids=segments, stats=True)
    np.testing.assert_allclose(a.logits[:, :10], b.logits[:, :10], rtol=1e-5, atol=1e-5)  # real tokens unaffected
    sa, sb = a.stats, b.stats
    for key in ("load_balance", "router_z", "load", "dropped"):
        np.testing.assert_allclose(sa[key], sb[key], rtol=1e-5, atol=1e-6)
    assert float(jnp.sum(sa["load"][0])) == 2 * 10 * cfg.moe.top_k  # only real copies are counted


def test_generation_never_drops_tokens_even_when_capped():
    from support.contiguous_cache import init_cache  # tests/support

    cfg = _cfg(mode="capped", capacity_factor=0.25)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 3, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    cached = forward(params, tokens, cfg, positions=positions, cache=init_cache(cfg, 2, 16)).logits
    dropless = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, mode="dropless"))
    np.testing.assert_allclose(cached, forward(params, tokens, dropless).logits, rtol=1e-5, atol=1e-5)


def test_top1_with_mixtral_gating_is_refused():
    from hypertron.config import ConfigError

    with pytest.raises(ConfigError, match="top_k=1 with gating=topk_softmax"):
        load_config(None, ["model=tiny-moe", "model.moe.top_k=1"])
