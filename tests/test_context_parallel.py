"""Context parallelism (``mesh.context``): each device holds an equal part of every row's tokens;
the sharding rules put the activations' ``seq`` on ``context`` and the weights' ``embed`` on
``fsdp`` and ``context`` together, and attention runs in ``shard_map``, each device's queries
against the row's keys and values gathered over ``context``, masked by positions and segment ids.
Load balancing (on by default) reorders each row's tokens on the host. On 8 CPU devices, against
one device, float32."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from hypertron.config import load_config
from hypertron.parallel.mesh import make_mesh
from hypertron.train.step import global_batch
from hypertron.train.task import task_for
from support.runs import train_steps

# Packed documents of the standard library's sources (segment ids; documents cross the parts of a
# row each device holds); width 96 so that no [rows, tokens, width] activation has the shape of a
# row's keys.
BASE = ["model=tiny", "model.num_layers=2", "model.embed_dim=96", "model.mlp_dim=192", "train.global_batch=8",
        "train.seq_len=64", "data.source=stdlib", "train.lr=1e-2", "train.warmup_steps=1"]


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """Short documents: segments end inside each device's part of a row, and the gathered segment
    ids decide what each query may see."""
    from support.tiny import write_short_documents

    return write_short_documents(tmp_path_factory.mktemp("context") / "docs.jsonl")


def _run(mesh: list[str], devices) -> tuple[np.ndarray, dict]:
    return train_steps([*BASE, "mesh.fsdp=1", *mesh], devices, 4)


@pytest.fixture(scope="module")
def one_device():
    return _run([], jax.devices()[:1])


@pytest.mark.parametrize("mesh", [["mesh.context=8"], ["mesh.data=2", "mesh.context=4"],
                                  ["mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2"],
                                  ["mesh.context=2", "mesh.tensor=4"],  # 2 KV heads for 4 tensor shards
                                  ["mesh.context=8", "model.context_load_balance=false"]])
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


def test_balanced_rows_give_every_context_device_as_many_causal_pairs():
    """One document a row over 4 context devices: in the balanced order each device's queries
    score as many (query, earlier key) pairs; in the plain order the last device scores 6.6x the
    first. The trainer's batch is in that order, every array of a row alike."""
    from hypertron.data.pipeline import balanced_order

    t, c = 64, 4

    def pairs(order):  # per device: its queries' causal keys among the whole row's
        return [int(sum(p + 1 for p in part)) for part in np.split(np.arange(t)[order], c)]

    assert len(set(pairs(balanced_order(t, c)))) == 1
    plain = pairs(np.arange(t))
    assert plain[-1] > 6 * plain[0]  # 904 against 136

    cfg = load_config(None, [*BASE, "data.source=synthetic", "mesh.fsdp=2", "mesh.context=4"])
    task = task_for(cfg)
    trainer = task.trainer(cfg, make_mesh(cfg.mesh, None))
    local = next(task.batches(cfg))
    batch = jax.device_get(trainer.batch(local))
    order = balanced_order(t, c)
    np.testing.assert_array_equal(batch["positions"], np.broadcast_to(np.arange(t)[order], (8, t)))
    for k in ("inputs", "targets", "segment_ids", "loss_weights"):
        np.testing.assert_array_equal(batch[k], local[k][:, order])


def test_documents_that_end_inside_a_devices_part_are_masked_by_their_gathered_segments(short_docs):
    """Rows of several short documents over context=4 (balanced): one device's losses."""
    want, _ = _run(short_docs, jax.devices()[:1])
    got, _ = _run([*short_docs, "mesh.context=4", "mesh.data=2"], None)
    np.testing.assert_allclose(got, want, rtol=1e-5)
