"""Expert parallelism: on 8 CPU devices, MoE meshes give the loss and gradients of one device.

The whole objective is checked (NLL plus both router losses), so the router
statistics summed over the batch shards are covered too. Capped routing drops
copies here (capacity factor 0.5): its capacity is per sequence, so what is
dropped does not depend on the mesh either.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hypertron.config import ConfigError, load_config
from hypertron.train.checks import validate_for_devices
from hypertron.parallel.mesh import make_mesh
from hypertron.parallel.rules import use_rules
from hypertron.train.step import global_batch, loss_terms, make_trainer

BASE = ["model=tiny-moe", "model.num_layers=2", "model.embed_dim=32", "model.mlp_dim=24", "model.num_heads=2",
        "model.num_kv_heads=2", "model.head_dim=16", "model.moe.num_experts=8", "model.moe.capacity_factor=0.5",
        "train.global_batch=8", "train.seq_len=16"]
MESHES = {
    "expert8": ["mesh.expert=8", "mesh.fsdp=1"],
    "expert4_data2": ["mesh.expert=4", "mesh.data=2", "mesh.fsdp=1"],
    "expert2_fsdp2_tensor2": ["mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2"],
}
# Per-device shard of one expert weight, we_gate [L=2, E=8, D=32, F=24]: experts over expert,
# embed over fsdp, mlp over tensor.
SHARDS = {"expert8": (2, 1, 32, 24), "expert4_data2": (2, 2, 32, 24), "expert2_fsdp2_tensor2": (2, 4, 16, 12)}


def _batch():
    rng = np.random.default_rng(0)
    toks = rng.integers(3, 259, (8, 17)).astype(np.int32)
    seg = np.ones((8, 16), np.int32)
    seg[:, 12:] = 2
    seg[5, 13:] = 0  # a little padding
    pos = np.concatenate([np.arange(12), np.arange(4)]).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg,
            "positions": np.tile(pos, (8, 1)), "loss_weights": (seg > 0).astype(np.float32)}


def _objective_and_grads(mode: str, mesh_overrides: list[str], devices=None):
    cfg = load_config(None, BASE + [f"model.moe.mode={mode}"] + mesh_overrides)
    mesh = make_mesh(cfg.mesh, devices)
    trainer = make_trainer(cfg, mesh)
    params = trainer.init(jax.random.key(0))["params"]
    batch = global_batch(_batch(), trainer.batch_sharding)

    def fn(params, batch):
        with use_rules(mesh):
            return jax.value_and_grad(loss_terms, has_aux=True)(params, batch, cfg)

    jitted = jax.jit(fn, out_shardings=(None, trainer.state_shardings["params"]))
    (objective, aux), grads = jitted(params, batch)
    return jax.device_get((objective, aux)), grads, jitted.lower(params, batch).as_text(), params


_REFERENCES: dict = {}


def _reference(mode: str):
    if mode not in _REFERENCES:
        _REFERENCES[mode] = _objective_and_grads(mode, ["mesh.fsdp=1"], jax.devices()[:1])
    return _REFERENCES[mode]


@pytest.mark.slow
@pytest.mark.parametrize("mode,name", [("dropless", n) for n in MESHES] + [("capped", "expert2_fsdp2_tensor2")])
def test_expert_parallel_meshes_match_one_device(mode, name):
    (ref_obj, ref_aux), ref_grads, _, _ = _reference(mode)
    (obj, aux), grads, hlo, params = _objective_and_grads(mode, MESHES[name])
    np.testing.assert_allclose(obj, ref_obj, rtol=2e-5)
    for key in ("moe_lb_sum", "moe_z_sum", "moe_dropped_sum", "expert_load"):
        np.testing.assert_allclose(aux[key], ref_aux[key], rtol=2e-5, atol=1e-6)
    if mode == "capped":
        assert 0.2 < ref_aux["moe_dropped_sum"] / ref_aux["weight"] < 0.8  # copies really were dropped
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4),
                 grads, ref_grads)
    we_gate = params["layers"]["we_gate"]
    assert we_gate.addressable_shards[0].data.shape == SHARDS[name]
    assert "all_to_all" in hlo  # token copies travel to their experts' devices


def test_expert_axis_must_divide_the_experts_and_joins_the_batch_shards():
    cfg = load_config(None, BASE + ["model.moe.num_experts=6", "mesh.expert=4", "mesh.fsdp=2"])
    with pytest.raises(ConfigError, match="mesh.expert=4 does not divide model.moe.num_experts=6"):
        validate_for_devices(cfg, 8)
    cfg = load_config(None, BASE + ["train.global_batch=4", "mesh.expert=8", "mesh.fsdp=1"])
    with pytest.raises(ConfigError, match=r"by the 8 data shards \(mesh data x fsdp x expert\)"):
        validate_for_devices(cfg, 8)
    # A dense model may use the expert axis: it is one more data-parallel axis there.
    dense = load_config(None, ["model=tiny", "train.global_batch=8", "mesh.expert=8", "mesh.fsdp=1"])
    assert validate_for_devices(dense, 8) == {"data": 1, "fsdp": 1, "expert": 8, "context": 1, "tensor": 1, "stage": 1}
