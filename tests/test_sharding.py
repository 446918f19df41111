"""Sharded training steps equal the single-device step, and parameters shard as the rules say."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from hypertron.config import ConfigError, MeshConfig, load_config
from hypertron.parallel.mesh import make_mesh
from hypertron.parallel.rules import DEFAULT_RULES, RulesError, spec_for
from hypertron.parallel.rules import use_rules
from hypertron.train.step import global_batch, loss_terms, make_trainer

BASE = ["model=tiny", "model.num_layers=2", "train.global_batch=8", "train.seq_len=16",
        "train.warmup_steps=0", "train.lr=1e-2"]


def _batch():
    rng = np.random.default_rng(0)
    toks = rng.integers(3, 259, (8, 17)).astype(np.int32)
    seg = np.ones((8, 16), np.int32)
    seg[:, 10:] = 2
    pos = np.concatenate([np.arange(10), np.arange(6)]).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg,
            "positions": np.tile(pos, (8, 1)), "loss_weights": np.ones((8, 16), np.float32)}


def _step(mesh_overrides, devices=None):
    cfg = load_config(None, BASE + mesh_overrides)
    trainer = make_trainer(cfg, make_mesh(cfg.mesh, devices))
    state = trainer.init(jax.random.key(0))
    batch = global_batch(_batch(), trainer.batch_sharding)

    def grads_fn(params, batch):
        with use_rules(trainer.mesh):
            return jax.grad(loss_terms, has_aux=True)(params, batch, cfg)[0]

    grads = jax.jit(grads_fn, out_shardings=trainer.state_shardings["params"])(state["params"], batch)
    new_state, metrics = trainer.step(state, batch)
    return new_state, jax.device_get(metrics), grads


@pytest.fixture(scope="module")
def reference():
    return _step(["mesh.fsdp=1"], jax.devices()[:1])


MESHES = {
    "data8": ["mesh.data=8", "mesh.fsdp=1"],
    "fsdp8": ["mesh.fsdp=8"],
    "fsdp4_tensor2": ["mesh.fsdp=4", "mesh.tensor=2"],
    "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
}

# Expected per-device shard shapes of two parameters: wq [L=2, D=128, N=4, H=32]
# (embed -> fsdp, heads -> tensor) and w_down [L=2, F=384, D=128] (mlp -> tensor, embed -> fsdp).
SHARDS = {
    "data8": ((2, 128, 4, 32), (2, 384, 128)),
    "fsdp8": ((2, 16, 4, 32), (2, 384, 16)),
    "fsdp4_tensor2": ((2, 32, 2, 32), (2, 192, 32)),
    "data2_fsdp2_tensor2": ((2, 64, 2, 32), (2, 192, 64)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_step_matches_single_device(name, reference):
    _, ref_metrics, ref_grads = reference
    state, metrics, grads = _step(MESHES[name])
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=2e-5)
    # Every gradient leaf (summed over tokens), not only their norm.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4),
        grads, ref_grads,
    )
    assert grads["layers"]["wq"].sharding.spec == state["params"]["layers"]["wq"].sharding.spec
    wq, w_down = state["params"]["layers"]["wq"], state["params"]["layers"]["w_down"]
    assert (wq.addressable_shards[0].data.shape, w_down.addressable_shards[0].data.shape) == SHARDS[name]
    # The optimiser state is sharded like the parameters it belongs to.
    mu = state["opt_state"][1][0].mu["layers"]["wq"]
    assert mu.sharding.spec == wq.sharding.spec


def test_mesh_sizes_resolve_and_fail_clearly():
    assert MeshConfig(data=2, fsdp=-1, tensor=2).shape(8) == {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2, "stage": 1}
    assert MeshConfig(data=3, fsdp=1).shape(3) == {"data": 3, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1, "stage": 1}
    with pytest.raises(ConfigError, match="= 3 devices, but 8"):
        MeshConfig(data=3, fsdp=1).shape(8)
    with pytest.raises(ConfigError, match="at most one axis"):
        MeshConfig(data=-1, fsdp=-1).shape(8)


def test_rules_refuse_two_axes_on_one_mesh_axis():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    rules = dict(DEFAULT_RULES, mlp="fsdp")
    with pytest.raises(RulesError, match="'embed' and 'mlp'"):
        spec_for(("embed", "mlp"), rules, mesh)


def test_batch_keeps_the_mesh_axes_that_divide_it():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
    assert tuple(spec_for(("batch", "seq"), DEFAULT_RULES, mesh, (8, 16))) == (("data", "fsdp"), None)
    assert tuple(spec_for(("batch", "seq"), DEFAULT_RULES, mesh, (6, 16))) == ("data", None)


def test_indivisible_dimension_is_replicated():
    mesh = Mesh(np.array(jax.devices()).reshape(1, 4, 2), ("data", "fsdp", "tensor"))
    # One KV head cannot be split over tensor=2: that dimension stays whole.
    spec = spec_for(("embed", "kv_heads", "head_dim"), DEFAULT_RULES, mesh, (128, 1, 32))
    assert tuple(spec) == ("fsdp", None, None)
