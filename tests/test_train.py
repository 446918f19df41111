"""Training end to end: the loss falls, checkpoints resume exactly, accumulation is exact."""

import json

import jax
import numpy as np
import pytest

from hypertron.checkpoint import load_params
from hypertron.config import load_config
from hypertron.parallel.mesh import make_mesh
from hypertron.train.loop import train
from hypertron.train.optimizer import schedule
from hypertron.train.step import global_batch, make_trainer
from support.tiny import TWO_LAYERS  # tests/support

TINY = [*TWO_LAYERS, "train.log_every=1"]


@pytest.mark.slow
def test_loss_falls_on_embedded_corpus_and_checkpoint_is_saved(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, TINY + [f"run_dir={run}", "train.steps=30", "train.lr=3e-3",
                                    "train.warmup_steps=5", "checkpoint.every=20"])
    result = train(cfg)
    first, last = np.mean(result.losses[:3]), np.mean(result.losses[-3:])
    assert first > 5.0 and last < first - 1.5, (first, last)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 31))
    for key in ("loss", "grad_norm", "lr", "step_time", "tokens_per_sec_per_device", "tflops_per_device"):
        assert all(np.isfinite(r[key]) for r in lines), key
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [20, 30]
    cfg_saved, params = load_params(run)
    assert cfg_saved.model == cfg.model
    assert params["layers"]["wq"].shape == (2, 64, 4, 32)

    # A new run can start from these parameters (fine-tuning): its first loss is the trained one.
    tuned = train(load_config(run / "config.yaml", [f"run_dir={tmp_path / 'ft'}", "train.steps=1",
                                                    f"train.init_from={run}"]))
    assert tuned.losses[0] < first - 1.5


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    """6 steps straight equal 3 steps, a restart from the checkpoint, then 3 more."""
    common = TINY + ["train.steps=6", "checkpoint.every=3", "data.source=stdlib", "train.warmup_steps=2"]
    straight = train(load_config(None, common + [f"run_dir={tmp_path / 'a'}"]))
    first = train(load_config(None, common + [f"run_dir={tmp_path / 'b'}", "train.steps=3"]))
    # Execution choices (here the remat policy) may change on resume; the math does not.
    resumed = train(load_config(None, common + [f"run_dir={tmp_path / 'b'}", "model.remat=dots"]))
    assert resumed.first_step == 3
    done = train(load_config(None, common + [f"run_dir={tmp_path / 'b'}"]))
    assert done.losses == [] and done.last_step == 6  # already finished: nothing runs, nothing is lost
    np.testing.assert_allclose(first.losses + resumed.losses, straight.losses, rtol=1e-5)


def _one_step(overrides):
    cfg = load_config(None, TINY + ["mesh.fsdp=1"] + overrides)
    trainer = make_trainer(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    state = trainer.init(jax.random.key(0))
    rng = np.random.default_rng(1)
    toks = rng.integers(3, 259, (8, 33)).astype(np.int32)
    w = np.ones((8, 32), np.float32)
    w[:, 20:] = 0.0  # padding: accumulation must weight micro-batches by real tokens
    w[0, :] = 0.0
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((8, 32), np.int32),
             "positions": np.tile(np.arange(32, dtype=np.int32), (8, 1)), "loss_weights": w}
    state, metrics = trainer.step(state, global_batch(batch, trainer.batch_sharding))
    return state, jax.device_get(metrics)


@pytest.mark.slow
def test_gradient_accumulation_equals_full_batch():
    s1, m1 = _one_step(["train.grad_accum=1", "train.warmup_steps=0", "train.clip_norm=0"])
    s4, m4 = _one_step(["train.grad_accum=4", "train.warmup_steps=0", "train.clip_norm=0"])
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-6)
    np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-5)
    assert m1["tokens"] == 7 * 20


def test_z_loss_is_reported_and_added():
    _, plain = _one_step(["train.z_loss=0"])
    _, with_z = _one_step(["train.z_loss=1e-2"])
    assert plain["z_loss"] > 0
    np.testing.assert_allclose(with_z["loss"], plain["loss"], rtol=1e-6)  # "loss" is the NLL alone
    assert with_z["grad_norm"] != plain["grad_norm"]


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedule_warms_up_then_decays(kind):
    cfg = load_config(None, ["train.steps=100", "train.warmup_steps=10", "train.lr=1.0",
                             "train.min_lr_ratio=0.1", f"train.schedule={kind}"])
    lr = schedule(cfg.train)
    assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    end = float(lr(100))
    assert end == pytest.approx(1.0 if kind == "constant" else 0.1, rel=1e-5)


@pytest.mark.slow
def test_bfloat16_compute_tracks_float32():
    """The accelerator default (bf16 compute, float32 master weights) trains like float32."""
    _, f32 = _one_step(["model.dtype=float32"])
    _, bf16 = _one_step(["model.dtype=bfloat16"])
    _, all_bf16 = _one_step(["model.dtype=bfloat16", "model.param_dtype=bfloat16"])
    for m in (bf16, all_bf16):
        assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
        np.testing.assert_allclose(m["loss"], f32["loss"], rtol=2e-2)


@pytest.mark.parametrize("source", ["synthetic"])  # stdlib: tests/test_tracker.py
def test_periodic_eval_on_the_held_out_split(tmp_path, source):
    run = tmp_path / "run"
    result = train(load_config(None, TINY + [f"run_dir={run}", f"data.source={source}", "train.steps=4",
                                             "train.eval_every=2", "train.eval_batches=2",
                                             "data.eval_fraction=0.05", "checkpoint.enabled=false"]))
    assert [r["step"] for r in result.eval_rows] == [2, 4]
    assert all(np.isfinite(r["eval_loss"]) and r["eval_tokens"] == 2 * 8 * 32 for r in result.eval_rows)
    assert result.eval_rows[0]["eval_loss"] != result.eval_rows[1]["eval_loss"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
