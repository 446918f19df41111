"""The TPU's flash attention (``model.attention=splash``, :mod:`hypertron.kernels.splash`: JAX's
Pallas splash kernel), run interpreted on the CPU: against XLA's attention on packed rows, and
training steps under fsdp and tensor sharding (the kernel in ``shard_map``) against XLA's on one
device. The memory model plans it on TPUs, so 8,192-token rows of a 70B model fit a v6e."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.kernels.splash import block_for, splash_attention, splash_takes
from support.runs import train_steps


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (2, 2, 40)])
def test_splash_equals_xla_attention_on_packed_rows_forward_and_backward(heads, kv_heads, window):
    """Two documents a row (the second starting inside the first 128-token block), GQA and MHA, a
    sliding window: outputs and the gradients of every input within 1e-5 of their largest."""
    b, t, h = 2, 256, 32
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (b, t, heads, h))
    k, v = (jax.random.normal(x, (b, t, kv_heads, h)) for x in ks[1:])
    seg = jnp.asarray([[0] * 100 + [1] * 156, [0] * 200 + [1] * 56], jnp.int32)
    mask = seg[:, None, :, None] == seg[:, None, None, :]
    local = None if window is None else (window - 1, 0)

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=local)

    def splash(q, k, v):
        return splash_attention(q, k, v, seg, window)

    np.testing.assert_allclose(jax.jit(splash)(q, k, v), xla(q, k, v), atol=1e-5)
    # Rows of one document (no segment ids): causal alone.
    np.testing.assert_allclose(splash_attention(q, k, v, None, window),
                               jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local), atol=1e-5)
    grads = [jax.jit(jax.grad(lambda *x, f=f: (f(*x) ** 2).sum(), argnums=(0, 1, 2)))(q, k, v) for f in (splash, xla)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.abs(want).max()))


BASE = ["model=tiny", "model.num_layers=2", "train.global_batch=8", "train.seq_len=128", "data.source=synthetic",
        "train.lr=1e-2", "train.warmup_steps=1"]


def _run(attention: str, mesh: list[str], devices) -> tuple[np.ndarray, dict]:
    return train_steps([*BASE, f"model.attention={attention}", "mesh.fsdp=1", *mesh], devices, 2)


@pytest.mark.parametrize("heads", [4, 8])
def test_training_with_splash_under_fsdp_and_tensor_equals_xla_on_one_device(heads):
    """Two steps of the tiny model (2 KV heads; 4 or 8 query heads) with the kernel in ``shard_map``
    over fsdp 2 x tensor 4 (the 2 KV heads copied to the 4 shards, each shard's query heads then
    one KV head's) give XLA's one-device losses and parameters."""
    width = [f"model.num_heads={heads}"]
    want_losses, want_params = _run("xla", width, jax.devices()[:1])
    losses, params = _run("splash", ["mesh.fsdp=2", "mesh.tensor=4", *width], None)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    # Adam at lr 1e-2 moves a weight about 1e-2 a step: 1e-5 is the kernel's float32 order of summation.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), params, want_params)


def test_the_memory_model_plans_splash_on_tpus_only_where_it_takes_the_shape(capsys):
    """auto is splash on a TPU for whole 128-token blocks and head dims of 128 (not on a GPU,
    whose cuDNN rule is its own, nor for a row split over context, whose attention is XLA's):
    llama3.1-70b's 8,192-token rows then fit 256 v6e chips over fsdp with remat=full."""
    from hypertron import cli

    assert splash_takes(128, 8192) and not splash_takes(64, 8192) and not splash_takes(128, 8000)
    assert (block_for(8192), block_for(768), block_for(640), block_for(100)) == (512, 256, 128, None)
    args = ["plan", "--hardware", "tpu-v6e", "--devices", "256", "model=llama3.1-70b", "train.seq_len=8192",
            "train.global_batch=256", "--json"]
    import json

    assert cli.main(args) == 0
    flash = json.loads(capsys.readouterr().out)
    assert cli.main([*args, "model.attention=xla"]) == 1  # the scores of a row's 64 heads alone: 17 GB a layer
    held = json.loads(capsys.readouterr().out)
    assert flash["memory"]["fits"] and held["memory"]["activations"] > 2 * flash["memory"]["activations"]
    assert cli.main([*args, "mesh.context=4", "mesh.fsdp=64"]) == 1  # split rows: XLA's attention
    capsys.readouterr()
    assert cli.main(["plan", "--hardware", "h100", "--devices", "8", "model=tiny", "model.attention=splash"]) == 2
    assert "model.attention=splash is the TPU's kernel" in capsys.readouterr().err
    assert cli.main(["plan", "--hardware", "tpu-v5e", "--devices", "4", "model=tiny", "model.attention=splash",
                     "train.seq_len=100"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "train.seq_len=100 is no whole number of the kernel's blocks" in err
