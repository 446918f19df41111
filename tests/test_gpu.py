"""Paths that exist only on an NVIDIA GPU: cuDNN flash attention and cuBLASLt fp8 matmuls.

Run by the GPU campaign's T1 (``pytest -m gpu``, see docs/benchmarks.md); on any other
backend each test skips and says why. The Pallas kernels, bf16 Hugging Face parity and
bf16 engine parity are in their own modules, marked ``gpu`` as well.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypertron.config import PRESETS, load_config
from hypertron.models.attention import self_attention
from support.numerics import rel_err  # tests/support

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda)"),
]


def matmul_summary(hlo: str, name: str) -> str:
    """What the compiled ``hlo`` does instead (for a failure message): its custom-call targets,
    its Triton GEMM fusions, how often an f8 type appears; the HLO itself is written to
    ``$HYPERTRON_GPU_ARTIFACTS/<name>_hlo.txt.gz`` when that is set (the campaign's T1 sets it).
    2026-11-25, H100, JAX 0.11.2: no cuBLASLt f8 GEMM at all, and nothing more was known."""
    import collections
    import gzip
    import os
    import re

    out = os.environ.get("HYPERTRON_GPU_ARTIFACTS")
    if out:
        with gzip.open(os.path.join(out, f"{name}_hlo.txt.gz"), "wt") as f:
            f.write(hlo)
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))
    triton_gemms = len(re.findall(r'"kind":"__triton[a-z_]*gemm[a-z_]*"', hlo))
    return (f"custom calls {dict(targets)}, Triton GEMM fusions {triton_gemms}, "
            f"f8e4m3fn {hlo.count('f8e4m3fn')}, f8e5m2 {hlo.count('f8e5m2')}")


def f8_gemms(hlo: str) -> int:
    """The fp8 GEMMs of a compiled module's text: cuBLAS Lt f8 custom calls, and ``dot``s whose
    two operands are f8 (XLA may give a GEMM to Triton instead of cuBLAS; 2026-11-26 on an H100,
    JAX 0.11.2, it did so for every fp8 matmul of the tests' small shapes, the dot inside the
    fusion taking the e5m2 gradient and the e4m3 operand as they are)."""
    import re

    types = dict(re.findall(r"%?([\w.\-]+) = (\w+)\[", hlo))  # instructions
    types.update(re.findall(r"([\w.\-]+): (\w+)\[", hlo))  # computations' parameters
    dots = re.findall(r"= \w+\[[^\]]*\][^ ]* dot\(%?([\w.\-]+), %?([\w.\-]+)\)", hlo)
    f8 = sum(all(types.get(o, "").startswith("f8") for o in ops) for ops in dots)
    return hlo.count('custom_call_target="__cublas$lt$matmul$f8"') + f8




def _segments(b: int, t: int) -> jax.Array:
    """Three documents per row, of uneven lengths."""
    cuts = np.array([t // 5, t // 2])
    return jnp.asarray(np.broadcast_to(np.searchsorted(cuts, np.arange(t), side="right") + 1, (b, t)), jnp.int32)


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("window", [None, 64])
def test_cudnn_attention_matches_xla_and_float32(segments, window):
    """cuDNN (bf16) and XLA (bf16) against the explicit-mask reference in float32, forward and
    the gradients wrt q, k, v. Stated tolerance: relative error under 2e-2 each."""
    cfg = dataclasses.replace(PRESETS["tiny"], num_heads=8, num_kv_heads=2, head_dim=64, sliding_window=window)
    b, t = 2, 256
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, 8, 64), jnp.float32)
    k = jax.random.normal(keys[1], (b, t, 2, 64), jnp.float32)
    v = jax.random.normal(keys[2], (b, t, 2, 64), jnp.float32)
    dout = jax.random.normal(keys[3], (b, t, 8, 64), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seg = _segments(b, t) if segments else None
    if segments:  # positions restart per document, as the packer writes them
        starts = jnp.asarray([0, t // 5, t // 2])
        positions = positions - starts[seg - 1]

    def run(impl, dtype):
        c = dataclasses.replace(cfg, attention=impl)
        f = lambda q, k, v: self_attention(q, k, v, positions, seg, c).astype(jnp.float32)
        cast = [x.astype(dtype) for x in (q, k, v)]
        out, vjp = jax.vjp(f, *cast)
        return out, vjp(dout)

    ref_out, ref_grads = jax.jit(lambda: run("plain", jnp.float32))()
    for impl in ("cudnn", "xla"):
        out, grads = jax.jit(lambda impl=impl: run(impl, jnp.bfloat16))()
        assert rel_err(out, ref_out) < 2e-2, impl
        for g, r, name in zip(grads, ref_grads, "qkv"):
            assert rel_err(g, r) < 2e-2, (impl, "d" + name)


def test_cudnn_is_what_auto_picks_for_bf16():
    from hypertron.models.attention import attention_impl

    assert attention_impl(PRESETS["llama-1b"], jnp.bfloat16, 2048) == "cudnn"


def test_fp8_train_step_runs_its_matmuls_in_fp8():
    """The fp8 training step compiles each quantised matmul, forward and both backward ones, to a
    GEMM of fp8 operands (cuBLAS Lt's or Triton's: :func:`f8_gemms`), not to a bf16 one at fp8's
    cost."""
    from hypertron.parallel.mesh import make_mesh
    from hypertron.train.step import make_trainer

    cfg = load_config(None, ["model=tiny", "model.embed_dim=128", "model.mlp_dim=256", "model.num_layers=2",
                             "model.quantization=fp8", "model.dtype=bfloat16", "data.source=synthetic",
                             "train.global_batch=16", "train.seq_len=128"])
    trainer = make_trainer(cfg, make_mesh(cfg.mesh))
    state = jax.eval_shape(trainer.init, jax.random.key(0))
    batch = {k: jax.ShapeDtypeStruct((16, 128), jnp.float32 if k == "loss_weights" else jnp.int32)
             for k in ("inputs", "targets", "segment_ids", "positions", "loss_weights")}
    hlo = trainer.step.lower(state, batch).compile().as_text()
    # Forward: q, k, v, o, gate, up, down per layer, and two backward per forward matmul (at least one
    # per forward matmul counted: XLA may merge sibling dots that share an operand).
    assert f8_gemms(hlo) >= 7 * cfg.model.num_layers, (f"{f8_gemms(hlo)} fp8 GEMMs in the compiled step; "
                                                       + matmul_summary(hlo, "fp8_train_step"))
