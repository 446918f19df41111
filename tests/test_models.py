"""The decoder: published parameter counts, scanned layers, attention paths, FLOPs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.config import ModelConfig, load_config
from hypertron.models import count_params, declare, forward, init_params
from hypertron.config import PRESETS
from hypertron.models.flops import (
    attention_flops,
    dense_flops_per_token,
    forward_flops_per_token,
    train_flops_per_token,
)


@pytest.mark.parametrize(
    "preset, expected",
    [
        ("llama2-7b", 6_738_415_616),
        ("llama3-8b", 8_030_261_248),
        ("mistral-7b", 7_241_732_096),
        ("gemma-7b", 8_537_680_896),
        ("gemma-2b", 2_506_172_416),
        ("llama2-13b", 13_015_864_320),
        ("llama2-70b", 68_976_648_192),
        ("llama3-70b", 70_553_706_496),
        ("mixtral-8x7b", 46_702_792_704),
    ],
)
def test_published_parameter_counts(preset, expected):
    # Abstract shapes only: a 70B model must count instantly without allocating.
    assert count_params(PRESETS[preset]) == expected


def test_every_preset_declares_consistent_axes():
    for name, cfg in PRESETS.items():
        specs = declare(cfg)
        for spec in jax.tree.leaves(specs, is_leaf=lambda s: hasattr(s, "axes")):
            assert len(spec.axes) == len(spec.shape), name


def _small(**kw) -> ModelConfig:
    return dataclasses.replace(PRESETS["tiny"], num_layers=2, embed_dim=64, mlp_dim=128, **kw)


def _logits(params, tokens, cfg, **kw):
    """The model's logits, jitted (eagerly, each op outside the layer scan dispatches alone)."""
    return jax.jit(lambda p, t, kw: forward(p, t, cfg, **kw).logits)(params, tokens, kw)


@pytest.mark.slow
def test_attention_paths_agree_with_segments_and_window():
    """jax.nn.dot_product_attention ('xla') equals the explicit-mask reference, packed and windowed."""
    cfg = _small(sliding_window=5)
    params = init_params(cfg, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 3, 259)
    seg = jnp.array([[1] * 7 + [2] * 9, [1] * 16])
    pos = jnp.array([list(range(7)) + list(range(9)), list(range(16))])
    outs = {
        impl: _logits(params, tokens, dataclasses.replace(cfg, attention=impl), positions=pos, segment_ids=seg)
        for impl in ("plain", "xla")
    }
    np.testing.assert_allclose(outs["plain"], outs["xla"], atol=2e-5)


@pytest.mark.parametrize("impl", ["plain", "xla"])
def test_packed_documents_do_not_attend_to_each_other(impl):
    """Logits of a document packed after another equal its logits alone."""
    cfg = _small(attention=impl)
    params = init_params(cfg, jax.random.key(0))
    a = jax.random.randint(jax.random.key(3), (1, 6), 3, 259)
    b = jax.random.randint(jax.random.key(4), (1, 10), 3, 259)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.array([[1] * 6 + [2] * 10])
    pos = jnp.array([list(range(6)) + list(range(10))])
    out = _logits(params, packed, cfg, positions=pos, segment_ids=seg)
    alone = _logits(params, b, cfg)
    np.testing.assert_allclose(out[:, 6:], alone, atol=2e-5)
    # Without segment ids the second document does see the first.
    mixed = _logits(params, packed, cfg, positions=pos)
    assert not np.allclose(mixed[:, 6:], alone, atol=1e-3)


def test_remat_and_unrolled_layers_do_not_change_the_math():
    """The remat policies and unrolled layers give the scanned model's logits (each jitted: eager,
    the unrolled layers run op by op, 4x the CPU). Their gradients: test_train.py's resume under
    ``model.remat=dots`` gives the uninterrupted run's losses."""
    base = _small()
    params = init_params(base, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(5), (2, 12), 3, 259)

    ref = _logits(params, tokens, base)
    for kw in (dict(remat="none"), dict(remat="dots"), dict(scan_layers=False)):
        np.testing.assert_allclose(_logits(params, tokens, dataclasses.replace(base, **kw)), ref, atol=1e-5)


def _hlo_size(num_layers: int) -> int:
    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.step import make_trainer

    cfg = load_config(None, ["model=tiny", f"model.num_layers={num_layers}", "train.global_batch=2",
                             "train.seq_len=16", "mesh.fsdp=1"])
    trainer = make_trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    state = jax.eval_shape(trainer.init, jax.random.key(0))
    batch = {k: jax.ShapeDtypeStruct((2, 16), jnp.float32 if k == "loss_weights" else jnp.int32)
             for k in ("inputs", "targets", "segment_ids", "positions", "loss_weights")}
    text = trainer.step.lower(state, batch).as_text()
    return sum(1 for line in text.splitlines() if "=" in line)


def test_layers_are_scanned_not_unrolled():
    small, large = _hlo_size(2), _hlo_size(16)
    assert abs(large - small) / small < 0.05, (small, large)


def test_flops_hand_count():
    cfg = ModelConfig(vocab_size=10, embed_dim=8, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=4, mlp_dim=16)
    # q: 2*8*8, k and v: 2 * 2*8*4, o: 2*8*8  -> 128 + 128 + 128 = 384
    # gated MLP: 3 matmuls of 2*8*16 -> 768
    # causal attention at seq 4: QK^T and PV, 2 FLOPs each, 2 heads x 4 dims, 2.5 keys on average -> 80
    # unembedding: 2*8*10 -> 160
    assert forward_flops_per_token(cfg, 4) == 384 + 768 + 80 + 160
    assert train_flops_per_token(cfg, 4) == 3 * 1392
    windowed = dataclasses.replace(cfg, sliding_window=2)
    # window 2 at seq 4: keys seen per query 1, 2, 2, 2 -> mean 1.75
    assert forward_flops_per_token(windowed, 4) == 384 + 768 + 2 * 2 * 8 * 1.75 + 160
    assert dense_flops_per_token(cfg) == 384 + 768 + 160 and attention_flops(cfg, 2.5) == 80


def test_blocked_attention_is_dot_product_attention():
    """Several query and key blocks with padding on both (37 queries in 3 blocks, 300 keys in 5),
    and keys that fill their blocks: jax.nn.dot_product_attention's result within float32
    rounding; blocks larger than the
    lengths; bf16 in, bf16 out."""
    from hypertron.models import attention

    blocked_attention = jax.jit(attention.blocked_attention, static_argnames=("block_q", "block_k"))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 37, 3, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 300, 3, 8)), jnp.float32) for _ in "kv")
    got = blocked_attention(q, k, v, block_q=16, block_k=64)
    np.testing.assert_allclose(got, jax.nn.dot_product_attention(q, k, v), atol=2e-6)
    whole = blocked_attention(q, k[:, :256], v[:, :256], block_q=16, block_k=64)  # 4 key blocks, none padded: no mask
    np.testing.assert_allclose(whole, jax.nn.dot_product_attention(q, k[:, :256], v[:, :256]), atol=2e-6)
    short = blocked_attention(q[:, :5].astype(jnp.bfloat16), k[:, :3], v[:, :3])
    assert short.dtype == jnp.bfloat16
    np.testing.assert_allclose(short.astype(jnp.float32), jax.nn.dot_product_attention(q[:, :5], k[:, :3], v[:, :3]),
                               atol=3e-2)


def test_full_attention_blocks_on_the_cpu_from_the_threshold():
    """Below BLOCKED_MIN_SCORES scores a head XLA's attention (no loop), from it the blocked one."""
    from hypertron.models import attention as A

    def loops(s):
        x = jax.ShapeDtypeStruct((1, s, 2, 8), jnp.float32)
        return "scan" in str(jax.make_jaxpr(A.full_attention)(x, x, x))

    side = int(A.BLOCKED_MIN_SCORES ** 0.5)
    assert not loops(side - 8) and loops(side)
