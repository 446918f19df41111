"""Pipeline parallelism (``mesh.stage``): the stacked layers in blocks over the stages, a batch's
rows in pieces that follow one another through them (GPipe's schedule, and the circular one with
``train.pipeline_repeats``). On 8 CPU devices against
one device, float32, rows packed from short documents (so each piece has positions and segments
of its own, which must travel with it through the stages)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from hypertron.config import load_config
from hypertron.parallel.mesh import make_mesh
from hypertron.train.task import task_for

BASE = ["model=tiny", "model.num_layers=4", "model.embed_dim=96", "model.mlp_dim=192", "train.seq_len=64",
        "data.source=jsonl", "train.lr=1e-2", "train.warmup_steps=1", "mesh.fsdp=1"]
MESHES = {  # each data shard's rows divide into the pieces
    "stage2_fsdp4": ["mesh.stage=2", "mesh.fsdp=4", "train.global_batch=16", "train.pipeline_microbatches=4"],
    # the circular schedule: 8 layers in blocks of 1, stage s holding blocks s and 4 + s
    "stage4_data2_r2": ["mesh.stage=4", "mesh.data=2", "train.global_batch=8", "train.pipeline_microbatches=4",
                        "train.pipeline_repeats=2", "model.num_layers=8"],
}


@pytest.fixture(scope="module", autouse=True)
def corpus(tmp_path_factory):
    """Short documents (``write_short_documents``): a 64-token row packs several."""
    from support.tiny import write_short_documents

    paths = write_short_documents(tmp_path_factory.mktemp("pipeline") / "docs.jsonl")[1:]
    BASE.extend(paths)
    yield
    del BASE[-len(paths):]


def _trainer(overrides: list[str], devices):
    cfg = load_config(None, [*BASE, *overrides])
    task = task_for(cfg)
    return cfg, task, task.trainer(cfg, make_mesh(cfg.mesh, devices))


def _run(overrides: list[str], devices) -> tuple[np.ndarray, dict]:
    _, task, trainer = _trainer(overrides, devices)
    cfg = trainer.cfg
    state, batches, losses = trainer.init(jax.random.key(0)), task.batches(cfg), []
    for _ in range(4):
        state, metrics = task.step(trainer, state, next(batches))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(trainer.to_model(state)["params"])


@pytest.mark.parametrize("name", MESHES)
def test_four_steps_through_the_stages_are_one_devices(name):
    batch = [o for o in MESHES[name] if o.startswith(("train.global_batch", "model."))]
    want_losses, want_params = _run(batch, jax.devices()[:1])
    losses, params = _run(MESHES[name], None)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), params, want_params)


@pytest.mark.parametrize("name", MESHES)
def test_stages_pass_activations_on_and_never_gather_a_layers_weights(name):
    """The compiled step: each layer weight stays in its stage's blocks (``[L / S, ...]`` of
    ``[L, ...]``), gathered over fsdp only (never whole), and the stages hand activations on by
    collective permutes."""
    cfg, task, trainer = _trainer(MESHES[name], None)
    state = trainer.init(jax.random.key(0))
    assert state["params"]["layers"]["wq"].sharding.spec[0] == "stage"
    text = trainer.step.lower(state, trainer.batch(next(task.batches(cfg)))).compile().as_text()
    gathered = [tuple(int(x) for x in m.split(",") if x)
                for m in re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", text)]
    stacked = {tuple(x.shape) for x in jax.tree.leaves(state["params"]["layers"])}
    assert not [s for s in gathered if s in stacked or (len(s) > 1 and s[0] == cfg.model.num_layers)], gathered
    assert re.search(r"collective-permute(?:-start)?\(", text)


def test_a_checkpoint_of_stages_resumes_without_them_and_back(tmp_path):
    """2 steps of the circular schedule (stage 4 x 2 repeats), then 2 more without stages from its
    checkpoint, give the losses of 4 steps without (within 1e-5: the stages sum in another order),
    and back: the step holds the layers in the stages' order, the checkpoint in the model's."""
    from hypertron.train.loop import train

    common = [*BASE, "model.num_layers=8", "train.global_batch=16", "train.steps=4", "checkpoint.every=2",
              "train.schedule=constant", "monitor.collect=false"]
    staged = ["mesh.stage=4", "mesh.data=2", "train.pipeline_microbatches=4", "train.pipeline_repeats=2"]
    straight = train(load_config(None, [*common, f"run_dir={tmp_path / 'a'}", "mesh.fsdp=8"]))
    for first, then, run in ((staged, ["mesh.fsdp=8"], "b"), (["mesh.fsdp=8"], staged, "c")):
        head = train(load_config(None, [*common, f"run_dir={tmp_path / run}", "train.steps=2", *first]))
        tail = train(load_config(None, [*common, f"run_dir={tmp_path / run}", *then]))
        assert tail.first_step == 2
        np.testing.assert_allclose(head.losses + tail.losses, straight.losses, rtol=1e-5)
