"""DLRM-v2 through the training loop: sizes, learning a planted teacher, TorchRec parity, exact resume,
Criteo-format files and bad input. On 8 simulated CPU devices."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from hypertron.checkpoint import MANIFEST
from hypertron.config import ConfigError, load_config
from hypertron.errors import DataError
from hypertron.recsys import data as recsys_data
from hypertron.recsys import dlrm
from hypertron.recsys.metrics import auc, log_loss
from hypertron.train.dlrm import ROUTED, Recommender, RoutedAhead, evaluate_logits, make_dlrm_trainer
from hypertron.train.loop import batch_digest, train
from support.cli import run_cli  # tests/support

ROOT = Path(__file__).parent.parent
RECIPE = ROOT / "recipes" / "cpu" / "dlrm-v2-tiny.yaml"
TINY = ["task=dlrm", "dlrm=dlrm-v2-tiny", "train.global_batch=256", "train.lr=0.05", "train.schedule=constant",
        "train.warmup_steps=0"]


def _cfg(*overrides: str):
    return load_config(None, [*TINY, *overrides])


def _trainer(cfg, per_process=None):
    return make_dlrm_trainer(cfg, Recommender().mesh(cfg, jax.devices()), per_process=per_process)


def test_the_mlperf_preset_counts_its_parameters_as_its_tables_and_mlps_add_up():
    cfg = load_config(None, ["task=dlrm", "dlrm=dlrm-v2"]).dlrm
    rows = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938,
            155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
    tables = sum(rows) * 128  # 204,184,588 rows of 128
    bottom = (13 * 512 + 512) + (512 * 256 + 256) + (256 * 128 + 128)
    n = 27 * 128  # the dense output and 26 pooled embeddings, concatenated
    cross = 3 * (n * 512 + 512 * n + n)  # V (no bias), W, the bias
    top = (n * 1024 + 1024) + (1024 * 1024 + 1024) + (1024 * 512 + 512) + (512 * 256 + 256) + (256 * 1 + 1)
    s = dlrm.sizes(cfg)
    assert s["table_params"] == tables == 26_135_627_264
    assert s["dense_params"] == bottom + cross + top
    assert s["params"] == tables + bottom + cross + top
    # Row-wise Adagrad: one accumulator per row; the MLPs' Adagrad: one per weight.
    assert s["optimizer_bytes"] == 4 * (sum(rows) + bottom + cross + top)


def test_auc_and_log_loss_on_hand_computed_cases():
    # Pairs (positive, negative) ranked right: (0.35 > 0.1), (0.8 > 0.1), (0.8 > 0.4); wrong: (0.35 < 0.4).
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    # A tie between a positive and a negative counts half: (0.5 = 0.5) -> 0.5, (0.5 > 0.2) -> 1.
    assert auc(np.array([0.5, 0.5, 0.2]), np.array([1, 0, 0])) == 0.75
    assert np.isnan(auc(np.array([0.1, 0.2]), np.array([1, 1])))
    assert log_loss(np.array([0.0, 0.0]), np.array([1, 0])) == pytest.approx(np.log(2))
    assert log_loss(np.array([100.0]), np.array([1])) == pytest.approx(0.0, abs=1e-30)


@pytest.mark.slow
def test_tiny_dlrm_learns_the_planted_teacher_and_its_tables_carry_the_signal():
    """Held-out AUC after 150 steps is near the teacher's own (0.92 on this data); with every
    pooled embedding zeroed it is 0.5 within noise: the signal is in the tables."""
    cfg = _cfg()
    trainer, task = _trainer(cfg), Recommender()
    state = trainer.init(jax.random.key(0))
    data = task.batches(cfg)
    for _ in range(150):
        state, metrics = trainer.step(state, next(data))
    held_out = task.batches(cfg, "eval")
    start = held_out.get_state()
    logits, labels = evaluate_logits(trainer, state, held_out, 16)
    held_out.set_state(start)
    ablated, _ = evaluate_logits(trainer, state, held_out, 16, zero_tables=True)
    held_out.set_state(start)
    teacher = np.concatenate([recsys_data.teacher_logits(cfg.dlrm, b["dense"].astype(np.float64), b["sparse"])
                              for b in (next(held_out) for _ in range(16))])
    learned, bayes, none = auc(logits, labels), auc(teacher, labels), auc(ablated, labels)
    print(f"held-out AUC {learned:.4f}, the teacher's {bayes:.4f}, tables zeroed {none:.4f} ({len(labels)} samples)")
    assert learned > 0.85 and bayes - learned < 0.05
    assert abs(none - 0.5) < 0.03  # 4,096 samples: the AUC of chance has a standard deviation of about 0.009


# --- TorchRec as the reference ---------------------------------------------------------------------------------

def _torchrec():
    return pytest.importorskip("torchrec", reason="TorchRec (make test installs torchrec==1.9.2 with fbgemm-gpu-cpu)")


def _torch_model(cfg, trainer, state):
    """TorchRec's DLRM_DCN of ``cfg.dlrm`` with hypertron's weights of ``state`` copied in."""
    import torch
    _torchrec()
    from torchrec.models.dlrm import DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    d = cfg.dlrm
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=d.embed_dim, num_embeddings=rows, feature_names=[f"f{i}"],
                           pooling=PoolingType.SUM) for i, rows in enumerate(d.table_rows)], device=torch.device("cpu"))
    model = DLRM_DCN(ebc, dense_in_features=d.dense_features, dense_arch_layer_sizes=list(d.bottom_mlp),
                     over_arch_layer_sizes=list(d.top_mlp), dcn_num_layers=d.cross_layers,
                     dcn_low_rank_dim=d.cross_rank)
    sd = dlrm.torchrec_state_dict(jax.device_get(state["params"]["dense"]),
                                  [values for values, _ in trainer.host_tables(state)])
    model.load_state_dict({k: torch.tensor(np.array(v)) for k, v in sd.items()}, strict=True)
    return model


def _torch_loss(model, cfg, batch):
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    b = len(batch["labels"])
    values, lengths, start = [], [], 0
    for hot in cfg.dlrm.ids_per_sample:
        values.append(batch["sparse"][:, start:start + hot].reshape(-1))
        lengths.append(np.full(b, hot))
        start += hot
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(len(cfg.dlrm.table_rows))],
                                              values=torch.tensor(np.concatenate(values), dtype=torch.int64),
                                              lengths=torch.tensor(np.concatenate(lengths), dtype=torch.int64))
    logits = model(torch.tensor(batch["dense"]), kjt).squeeze(-1)
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor(batch["labels"]))


@pytest.mark.slow
def test_twenty_sgd_steps_give_torchrecs_losses_with_tables_split_row_wise():
    import torch

    cfg = _cfg("dlrm.optimizer=sgd", "dlrm.placement=row", "train.lr=0.5")
    trainer = _trainer(cfg)
    state = trainer.init(jax.random.key(3))
    model = _torch_model(cfg, trainer, state)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = Recommender().batches(cfg)
    ours, theirs = [], []
    for _ in range(20):
        batch = next(data)
        state, metrics = trainer.step(state, batch)
        ours.append(float(metrics["loss"]))
        opt.zero_grad()
        loss = _torch_loss(model, cfg, batch)
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-6)
    assert ours[-1] < ours[0] - 0.01  # it learned: the steps were not all alike


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,placement,per_process", [("adagrad", "column", False),
                                                               ("rowwise_adagrad", "mixed", True),
                                                               ("rowwise_adagrad", "table", False)])
def test_one_adagrad_step_gives_torchrecs_parameters(optimizer, placement, per_process):
    """Tables: Adagrad (torch's), or TorchRec's RowWiseAdagrad (one accumulator per row); MLPs: Adagrad.
    A first Adagrad step is ``lr * g / (|g| + eps)``: with eps 1e-8 it is ``lr * sign(g)`` wherever
    ``|g|`` is not tiny, and where it is tiny float32's rounding of ``g`` decides it. eps 1e-3
    makes the comparison well conditioned (and still tells ``sqrt(acc) + eps`` from ``sqrt(acc + eps)``).
    Routed per process (as several processes route), ``mixed`` is every placement in one step: t0
    row-wise, t1 column-wise (its ids gathered on the devices, its duplicates merged there, its row
    sums summed over the column shards), t2 and t3 table-wise (held as one row-wise array,
    :mod:`hypertron.embed.batched`) and the planner's t4-t7 data-parallel (pooled on each device
    from its own copy, their gradients summed with the MLPs'): :mod:`hypertron.train.dlrm_fused`."""
    import torch
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad  # noqa: F401  (imported after the skip)

    lr, eps = 0.05, 1e-3
    where = "dlrm.placements=[row,column,table,table,auto,auto,auto,auto]" if placement == "mixed" else \
        f"dlrm.placement={placement}"
    cfg = _cfg(f"dlrm.optimizer={optimizer}", where, f"train.lr={lr}", f"dlrm.eps={eps}")
    trainer = _trainer(cfg, per_process)
    if placement == "mixed":
        assert [t.spec.placement for t in trainer.tables] == ["row", "column", "table", "table"] + ["data"] * 4
    state = trainer.init(jax.random.key(4))
    model = _torch_model(cfg, trainer, state)
    tables = [p for n, p in model.named_parameters() if n.startswith("sparse_arch.")]
    dense = [p for n, p in model.named_parameters() if not n.startswith("sparse_arch.")]
    opts = [torch.optim.Adagrad(dense, lr=lr, eps=eps),
            RowWiseAdagrad(tables, lr=lr, eps=eps) if optimizer == "rowwise_adagrad"
            else torch.optim.Adagrad(tables, lr=lr, eps=eps)]
    batch = next(Recommender().batches(cfg))
    state, _ = trainer.step(state, batch)
    _torch_loss(model, cfg, batch).backward()
    for o in opts:
        o.step()
    want = _torch_model(cfg, trainer, state).state_dict()  # hypertron's new weights, in TorchRec's names
    got = model.state_dict()
    assert set(want) == set(got)
    for name in want:
        np.testing.assert_allclose(want[name].numpy(), got[name].numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


# --- the loop: resume, Criteo files, bad input ------------------------------------------------------------------



def test_batches_routed_ahead_are_the_streams_batches_routed_and_keep_the_loops_position():
    """The loop's batches, routed one ahead on a thread: each is the stream's next batch (its
    digest leaves the routing out) with the routing the step would do itself; the position saved
    after 3 batches is the stream's after 3 (the thread has read the fourth), and an iterator set
    to it goes on with the fourth. (That the loop resumes from it bit for bit: the test below.)"""
    cfg = _cfg()
    trainer, task = _trainer(cfg), Recommender()
    ahead, ref = RoutedAhead(task.batches(cfg), trainer), task.batches(cfg)
    for _ in range(3):
        local, want = next(ahead), next(ref)
        assert batch_digest(local) == batch_digest(want)
        for got, expect in zip(local[ROUTED], trainer.route(want), strict=True):
            for a, b in zip(got.arrays(), expect.arrays(), strict=True):
                np.testing.assert_array_equal(a, b)
    saved = ahead.get_state()
    assert json.loads(saved) == ref.get_state()
    again = RoutedAhead(task.batches(cfg), trainer)
    again.set_state(saved)
    assert batch_digest(next(again)) == batch_digest(next(ref)) == batch_digest(next(ahead))
    ahead.close()
    again.close()


def test_the_two_process_recipe_is_the_tiny_recipe_on_2_processes_of_4_devices():
    """recipes/cpu/dlrm-v2-tiny-2proc.yaml is what test_multiprocess.py launches by hand: the tiny
    recipe's training, as 1 node x 2 processes of 4 CPU devices."""
    from hypertron.launch import recipes

    r = recipes.load(str(RECIPE.with_name("dlrm-v2-tiny-2proc.yaml")), None, [])
    assert (r.nodes, r.processes) == (1, 2) and "--xla_force_host_platform_device_count=4" in r.env()["XLA_FLAGS"]
    one, two = load_config(RECIPE, []), load_config(RECIPE.with_name("dlrm-v2-tiny-2proc.yaml"), [])
    assert (two.task, two.dlrm, two.train) == (one.task, one.dlrm, one.train)


@pytest.mark.slow
def test_the_recipe_stopped_at_checkpoint_6_resumes_bit_identically(tmp_path):
    """The recipe (8 tables, row-wise Adagrad, its data stream, held-out AUC) resumed from checkpoint 6
    gives the uninterrupted run's 12 losses and final AUC, bit for bit. In process: that a process
    killed with SIGKILL after a checkpoint resumes the same way is ``test_resume.py``'s (the recipe's
    schedule is constant, so a 6-step run is the first half of the 12-step one)."""
    common = ["monitor.collect=false", "train.steps=12", "checkpoint.every=6", "train.eval_every=6",
              "train.eval_batches=2"]
    straight = train(load_config(RECIPE, [*common, f"run_dir={tmp_path / 'a'}"]))
    run = tmp_path / "b"
    first = train(load_config(RECIPE, [*common, f"run_dir={run}", "train.steps=6"]))
    assert (run / "checkpoints" / "6" / MANIFEST).exists()
    resumed = train(load_config(RECIPE, [*common, f"run_dir={run}"]))
    assert resumed.first_step == 6 and len(straight.losses) == 12
    assert first.losses + resumed.losses == straight.losses  # exact float equality
    assert resumed.eval_rows[-1]["eval_auc"] == straight.eval_rows[-1]["eval_auc"]


def _criteo_line(rng, label: int) -> str:
    counts = [str(int(x)) if rng.random() > 0.1 else "" for x in rng.integers(-2, 1000, 13)]
    ids = [f"{int(x):08x}" if rng.random() > 0.1 else "" for x in rng.integers(0, 2**32, 26)]
    return "\t".join([str(label), *counts, *ids])


@pytest.mark.slow
def test_criteo_format_files_are_read_as_the_dlrm_reference_reads_them_and_train(tmp_path):
    line = "1\t5\t\t-3\t0" + "\t7" * 9 + "\t" + "\t".join(["ff", "", "10"] + ["0"] * 23)
    rows = tuple(range(10, 36))
    s = recsys_data.parse_criteo(line.encode(), rows)
    assert s["labels"] == 1.0
    np.testing.assert_allclose(s["dense"][:4], np.log1p([5, 0, 0, 0]).astype(np.float32))
    assert list(s["sparse"][:3]) == [255 % 10, 0, 16 % 12]
    rng = np.random.default_rng(0)
    days, held = tmp_path / "day_0.tsv", tmp_path / "day_23.tsv"
    days.write_text("\n".join(_criteo_line(rng, int(rng.random() < 0.3)) for _ in range(300)) + "\n")
    held.write_text("\n".join(_criteo_line(rng, i % 2) for i in range(64)))  # no newline at the end
    cfg = _cfg("dlrm.source=criteo", f"dlrm.paths={days}", f"dlrm.eval_paths={held}", "dlrm.ids_per_sample=" +
               ",".join(["1"] * 26), "dlrm.table_rows=" + ",".join(str(r) for r in rows), "train.global_batch=64")
    task, trainer = Recommender(), _trainer(cfg)
    task.check_inputs(cfg)
    batches = task.batches(cfg)
    first = next(batches)
    assert first["dense"].shape == (64, 13) and first["sparse"].shape == (64, 26)
    assert (first["sparse"] < np.array(rows)).all() and first["dense"].min() >= 0
    state = trainer.init(jax.random.key(0))
    for _ in range(6):  # past the end of the 300 lines: the next epoch
        state, metrics = trainer.step(state, next(batches))
    values = task.evaluate(trainer, state, task.batches(cfg, "eval"), 1)
    assert values["samples"] == 64 and 0 <= values["auc"] <= 1 and np.isfinite(values["loss"])


def test_a_global_batch_is_the_same_on_any_process_count_and_so_is_its_position(tmp_path):
    """Synthetic (8 blocks) and Criteo-format files: two processes' batches, process 0's then process
    1's, are one process's batch, batch after batch (the Criteo lines past an epoch too); and a
    position saved by two processes restores one process's stream (and one process's, two) to the
    batch after it."""
    rng = np.random.default_rng(1)
    day = tmp_path / "day_0.tsv"
    day.write_text("\n".join(_criteo_line(rng, i % 2) for i in range(100)) + "\n")
    criteo = ["dlrm.source=criteo", f"dlrm.paths={day}", "dlrm.ids_per_sample=" + ",".join(["1"] * 26),
              "dlrm.table_rows=" + ",".join(["50"] * 26)]
    for overrides in ([], criteo):
        d = _cfg(*overrides).dlrm

        def stream(count: int, index: int = 0):
            return recsys_data.make_batches(d, batch_size=32 // count, seed=3, process_index=index,
                                            process_count=count, shards=8)

        def joined(streams):  # the processes' next batches, in process order
            halves = [next(s) for s in streams]
            return {k: np.concatenate([h[k] for h in halves]) for k in halves[0]}

        one, two = stream(1), [stream(2, p) for p in range(2)]
        for _ in range(4):  # 4 x 32 Criteo lines: past the 100 of an epoch
            assert batch_digest(joined(two)) == batch_digest(next(one)), overrides
        for p, s in enumerate(two):
            (tmp_path / f"process_{p}-of-2.json").write_text(json.dumps(s.get_state()))
        again = stream(1)
        again.restore_from_files(sorted(tmp_path.glob("process_*-of-2.json")))
        assert batch_digest(next(again)) == batch_digest(next(one))
        (tmp_path / "process_0-of-1.json").write_text(json.dumps(one.get_state()))
        two = [stream(2, p) for p in range(2)]
        for s in two:
            s.restore_from_files([tmp_path / "process_0-of-1.json"])
        assert batch_digest(joined(two)) == batch_digest(next(one))


@pytest.mark.parametrize("overrides,message", [
    (["dlrm.bottom_mlp=32,8"], "dlrm.bottom_mlp ends at 8: its last layer must be dlrm.embed_dim=16 wide"),
    (["dlrm.top_mlp=64,2"], "dlrm.top_mlp ends at 2"),
    (["dlrm.ids_per_sample=1,2"], "dlrm.ids_per_sample has 2 entries and dlrm.table_rows 8"),
    (["dlrm.table_rows=10,0,1,1,1,1,1,1"], "dlrm.table_rows=[10, 0, 1, 1, 1, 1, 1, 1]: every entry must be positive"),
    (["dlrm=dlrm-v3"], "dlrm=dlrm-v3: unknown preset"),
    (["dlrm.optimizer=adam"], "dlrm.optimizer=adam: must be one of sgd, adagrad, rowwise_adagrad"),
    (["dlrm.source=criteo"], "dlrm.paths: dlrm.source=criteo needs at least one file"),
])
def test_bad_dlrm_configs_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        _cfg(*overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_bad_dlrm_runs_are_refused_in_one_line_before_anything_is_written(tmp_path):
    run = tmp_path / "run"
    for args, message in [
        (["train.global_batch=100"], "train.global_batch=100: task=dlrm splits it by samples over the 8 devices"),
        (["dlrm.source=criteo", f"dlrm.paths={tmp_path / 'missing.tsv'}", "dlrm.ids_per_sample=" + ",".join(
            ["1"] * 26), "dlrm.table_rows=" + ",".join(["5"] * 26)], "missing.tsv is not a file"),
        (["dlrm.source=criteo", f"dlrm.paths={RECIPE}", "dlrm.ids_per_sample=" + ",".join(["2"] * 26),
          "dlrm.table_rows=" + ",".join(["5"] * 26)], "Criteo lines hold one id per feature"),
    ]:
        r = run_cli(["train", RECIPE, "monitor.collect=false", f"run_dir={run}", "train.eval_every=0", *args])
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.rc == 2 and message in r.stderr and len(lines) == 1, r.describe()
        assert not (run / "checkpoints").exists()
    with pytest.raises(DataError, match="40 tab-separated fields"):
        recsys_data.parse_criteo(b"1\t2\t3", tuple([5] * 26))


def test_the_dlrm_task_does_not_touch_the_language_model_config():
    """The task interface adds a section; an LM run's config and checks are what they were."""
    cfg = load_config(None, ["model=tiny"])
    assert cfg.task == "lm" and cfg.dlrm == load_config(None, []).dlrm
    assert dataclasses.replace(cfg, dlrm=dataclasses.replace(cfg.dlrm, embed_dim=32)).model == cfg.model


def test_hypertron_plan_of_a_dlrm_recipe_sizes_it_and_places_its_tables(capsys):
    from hypertron import cli

    args = ["plan", str(RECIPE), "dlrm=dlrm-v2", "train.global_batch=65536", "--hardware", "h100"]
    assert cli.main([*args, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["params"] == 26_151_671_809 and p["table_params"] == 26_135_627_264
    assert p["dense_bytes_per_device"] == 2 * 4 * 16_044_545  # the MLPs and their Adagrad state, on every device
    placements = [t["placement"] for t in p["tables"]["tables"]]
    assert len(placements) == 26 and placements.count("table") == 21  # the 40M-row tables split, the rest whole
    assert cli.main([*args, "--devices", "1"]) == 1  # 98 GiB do not fit one H100
    assert "26,151,671,809 parameters" in capsys.readouterr().out
    assert cli.main([*args, "--devices", "16", "--json"]) == 0  # two nodes: no table whole on one device
    tables = json.loads(capsys.readouterr().out)["tables"]["tables"]
    assert "table" not in {t["placement"] for t in tables}
    # The tables whose gradient's all-reduce moves fewer bytes than splitting them would: on every device.
    assert {t["rows"] for t in tables if t["placement"] == "data"} == {3, 4, 10, 14, 36, 63, 108, 155, 976, 1543, 2209}
