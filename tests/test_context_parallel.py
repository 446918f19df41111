"""Context parallelism (``mesh.context``): each device holds an equal part of every row's tokens;
the sharding rules put the activations' ``seq`` on ``context`` and the weights' ``embed`` on
``fsdp`` and ``context`` together, and XLA's partitioner gathers each layer's keys and values
over ``context`` for attention. On 8 CPU devices, against one device, float32."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from hypertron.config import load_config
from hypertron.parallel.mesh import make_mesh
from hypertron.train.step import global_batch
from hypertron.train.task import task_for

# Packed documents of the standard library's sources (segment ids; documents cross the parts of a
# row each device holds); width 96 so that no [rows, tokens, width] activation has the shape of a
# row's keys.
BASE = ["model=tiny", "model.num_layers=2", "model.embed_dim=96", "model.mlp_dim=192", "train.global_batch=8",
        "train.seq_len=64", "data.source=stdlib", "train.lr=1e-2", "train.warmup_steps=1"]


def _run(mesh: list[str], devices) -> tuple[np.ndarray, dict]:
    cfg = load_config(None, [*BASE, "mesh.fsdp=1", *mesh])
    task = task_for(cfg)
    trainer = task.trainer(cfg, make_mesh(cfg.mesh, devices))
    state, batches, losses = trainer.init(jax.random.key(0)), task.batches(cfg), []
    for _ in range(4):
        state, metrics = task.step(trainer, state, next(batches))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state["params"])


@pytest.fixture(scope="module")
def one_device():
    return _run([], jax.devices()[:1])


@pytest.mark.parametrize("mesh", [["mesh.context=8"], ["mesh.data=2", "mesh.context=4"],
                                  ["mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2"]])
def test_four_steps_on_a_context_mesh_are_one_devices(one_device, mesh):
    want_losses, want_params = one_device
    losses, params = _run(mesh, None)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6), params, want_params)


def test_attention_gathers_keys_and_values_over_context_and_no_whole_activation():
    """The compiled step's all-gathers: a row's keys and values at KV-head width (its tokens
    whole, this device's rows), and never a [rows, tokens, width] activation."""
    cfg = load_config(None, [*BASE, "mesh.fsdp=1", "mesh.context=8"])
    task = task_for(cfg)
    trainer = task.trainer(cfg, make_mesh(cfg.mesh, None))
    state = trainer.init(jax.random.key(0))
    batch = global_batch(next(task.batches(cfg)), trainer.batch_sharding)
    gathered = []
    for line in trainer.step.lower(state, batch).compile().as_text().splitlines():
        m = re.match(r"\s*\S+ = \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", line)
        if m:
            gathered.append((tuple(int(x) for x in m.group(1).split(",") if x), "attention" in line))
    m = cfg.model
    kv = (8, 64, m.num_kv_heads, m.head_dim)  # every row (the mesh has no batch axis), all 64 tokens
    assert any(shape == kv and attention for shape, attention in gathered), gathered
    assert not [s for s, _ in gathered if len(s) >= 2 and 64 in s[:-1] and s[-1] == m.embed_dim], gathered
