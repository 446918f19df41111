"""Two real processes on localhost (``jax.distributed`` over gloo, CPU) training data-parallel.

``hypertron launch local`` starts both; each feeds its own rows of the global batch (its 4 of the
8 data shards). The losses must equal one process fed the same global batch (both halves,
concatenated in process order): a language model's, and a DLRM's whose tables are split over
both processes' devices. Resuming on the same or another process count, onto a mesh split
across the processes (``mesh.dcn.data=-1``), is ``tests/test_elastic.py``'s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from hypertron.checkpoint import Checkpointer
from hypertron.config import load_config
from hypertron.data import make_batches
from hypertron.parallel.mesh import make_mesh
from hypertron.recsys import data as recsys_data
from hypertron.train.dlrm import make_dlrm_trainer
from hypertron.train.loop import train
from hypertron.train.events import read_events
from hypertron.train.step import global_batch, make_trainer
from support import processes  # tests/support
from support.tiny import TWO_LAYERS  # tests/support

pytestmark = pytest.mark.slow

TINY = [*TWO_LAYERS, "train.log_every=1", "data.source=stdlib",
        "train.schedule=constant", "train.warmup_steps=0", "checkpoint.every=2"]


def _launch(*overrides: str) -> subprocess.CompletedProcess:
    env = processes.fast_compile({k: v for k, v in os.environ.items() if not k.startswith("JAX_")})
    return processes.run([sys.executable, "-m", "hypertron.cli", "launch", "local", "--processes", "2",
                           "--cpu-devices", "4", "--", "train", *overrides],
                          env=env, capture_output=True, text=True, timeout=400)


def _reference_losses(steps: int) -> list[float]:
    """One process, 8 devices, fed each global batch as process 0's rows then process 1's (each
    feeding 4 of the default 8 data shards)."""
    cfg = load_config(None, TINY)
    trainer = make_trainer(cfg, make_mesh(cfg.mesh, jax.devices()))
    state = trainer.init(jax.random.key(cfg.train.seed))
    shards = [make_batches(source="stdlib", seq_len=32, batch_size=4, seed=0, shards=8, process_index=p,
                           process_count=2) for p in range(2)]
    losses = []
    for _ in range(steps):
        halves = [next(s) for s in shards]
        assert not np.array_equal(halves[0]["inputs"], halves[1]["inputs"])  # different rows per process
        local = {k: np.concatenate([h[k] for h in halves]) for k in halves[0]}
        state, metrics = trainer.step(state, global_batch(local, trainer.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses


def test_two_processes_train_like_one_on_the_same_global_batch(tmp_path):
    """Resuming, also on another process count and across nodes (mesh.dcn.data), is
    tests/test_elastic.py's."""
    run = tmp_path / "run"
    first = _launch(*TINY, "train.steps=2", f"run_dir={run}")
    assert first.returncode == 0, first.stdout + first.stderr

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # written once, by process 0
    np.testing.assert_allclose([r["loss"] for r in rows], _reference_losses(2), rtol=2e-5)

    # Each process saved its own data position, and wrote its own events.
    assert sorted(p.name for p in (run / "checkpoints" / "2" / "data").glob("process_*")) == [
        "process_0-of-2.json", "process_1-of-2.json"]
    for name, index in (("events.jsonl", 0), ("events.1.jsonl", 1)):
        events = read_events(run / name)
        assert {e["process"] for e in events} == {index}
        assert [e["step"] for e in events if e["event"] == "step"] == [1, 2]
        # Where this process's 4 devices sat: fsdp=8 over both processes.
        (flat,) = [e for e in events if e["event"] == "backend_ready"]
        assert flat["mesh"] == {"data": 1, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1, "stage": 1}
        assert flat["mesh_coords"] == [[0, 4 * index + i, 0, 0, 0, 0] for i in range(4)]


def test_sigterm_to_the_launcher_stops_both_processes_at_the_same_step(tmp_path):
    """The launcher forwards SIGTERM; JAX's preemption sync point makes both processes save the same
    step. Started from a recipe (``launch local --recipe``): its 1 node x 2 processes, its 4 CPU
    devices each (XLA flags) and its environment."""
    import signal
    import time

    from test_slurm import RECIPE  # the same tiny run, as a recipe of 1 node x 2 processes

    run, recipe = tmp_path / "run", tmp_path / "tiny2.yaml"
    recipe.write_text(RECIPE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    proc = processes.start([sys.executable, "-m", "hypertron.cli", "launch", "local", "--recipe", str(recipe),
                             "train.steps=100000", "checkpoint.every=100000", f"run_dir={run}"],
                            env=env, stdout=processes.DEVNULL, stderr=processes.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not ((run / "events.jsonl").exists()
                   and sum(e["event"] == "step" for e in read_events(run / "events.jsonl")) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not get going"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    stops = []
    for name in ("events.jsonl", "events.1.jsonl"):
        events = read_events(run / name)
        stops.append([e["step"] for e in events if e["event"] == "preemption"])
        assert [e["status"] for e in events if e["event"] == "job_end"] == ["preempted"]
    assert len(stops[0]) == 1 and stops[0] == stops[1]
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()] == [str(stops[0][0])]
    ready = [e for e in read_events(run / "events.jsonl") if e["event"] == "backend_ready"]
    assert [(e["device_count"], e["local_device_count"]) for e in ready] == [(8, 4)]  # the recipe's devices


def test_a_pipeline_across_the_two_processes_trains_like_one_process(tmp_path):
    """``mesh.dcn.stage=2``: a stage on each process (fsdp 4 inside), the activations handed from
    one to the other. Both processes feed the same rows (they hold the same batch shards), so the
    losses are one process's on fsdp 8 fed one stream of whole batches; the final save and bundle
    are written once, with the layers whole."""
    run = tmp_path / "run"
    out = _launch(*TINY, "train.steps=3", "checkpoint.every=3", f"run_dir={run}", "mesh.fsdp=4", "mesh.stage=1",
                  "mesh.dcn.stage=2")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    cfg = load_config(None, TINY)
    trainer = make_trainer(cfg, make_mesh(cfg.mesh, jax.devices()))
    state = trainer.init(jax.random.key(cfg.train.seed))
    stream = make_batches(source="stdlib", seq_len=32, batch_size=8, seed=0, shards=8)
    want = []
    for _ in range(3):
        state, metrics = trainer.step(state, global_batch(next(stream), trainer.batch_sharding))
        want.append(float(metrics["loss"]))
    np.testing.assert_allclose([r["loss"] for r in rows], want, rtol=2e-5)
    ready = [e for e in read_events(run / "events.1.jsonl") if e["event"] == "backend_ready"]
    assert ready[0]["mesh"]["stage"] == 2 and {c[5] for c in ready[0]["mesh_coords"]} == {1}  # process 1: stage 1
    assert (run / "model").is_dir()


DLRM = [str(Path(__file__).parent.parent / "recipes" / "cpu" / "dlrm-v2-tiny.yaml"), "train.steps=10",
        "train.log_every=1", "train.eval_every=10", "train.eval_batches=1", "checkpoint.every=5",
        "monitor.collect=false",
        "dlrm.ids_per_sample=[8,2,1,2,4,1,1,1]", "dlrm.placements=[row,column,table,table,auto,auto,auto,auto]"]


def test_two_processes_train_the_dlrm_like_one_and_resume_on_one(tmp_path):
    """``task: dlrm`` on 2 processes x 4 devices (what recipes/cpu/dlrm-v2-tiny-2proc.yaml runs), its
    tables over all 8 (t0 row-wise, t1 column-wise, t2 and t3 table-wise, held as one row-wise
    array of two owners' blocks, and the planner's choice for the 4 smallest: whole on every
    device, data-parallel), each process reading its block
    of each global batch and routing only its own samples' ids, equals one process on 8 devices fed
    the same global batches and routing them per process too: the 10 losses to 1e-6, and from
    checkpoint 10 every table and its row-wise Adagrad state to 1e-5. Then, as if killed after
    checkpoint 5, the run resumes on one process of 8 devices (its tables whole on a device, the
    step's duplicates found on the host): steps 6 to 10 give the two processes' losses (1e-6),
    reading the same batches, and the held-out loss at step 10 (one compiled program a batch on
    two processes, a lookup a table on one) agrees to 1e-5."""
    run = tmp_path / "run"
    out = _launch(*DLRM, f"run_dir={run}")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in rows if "loss" in r]
    (evaluated,) = [r["eval_loss"] for r in rows if "eval_loss" in r]

    cfg = load_config(DLRM[0], DLRM[1:])
    trainer = make_dlrm_trainer(cfg, Mesh(np.array(jax.devices()[:8]), ("data",)), per_process=True)
    assert [t.spec.placement for t in trainer.tables] == ["row", "column", "table", "table"] + ["data"] * 4
    state = trainer.init(jax.random.key(cfg.train.seed))
    stream = recsys_data.make_batches(cfg.dlrm, batch_size=cfg.train.global_batch, seed=cfg.data.seed, shards=8)
    want = []
    for _ in range(10):
        state, metrics = trainer.step(state, next(stream))
        want.append(float(metrics["loss"]))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # Row-wise Adagrad's first steps divide a row's gradient by its own size, so where a row's gradient
    # is a near-cancelling sum, the summation order moves the row by about 1e-6 (seen: up to 2.3e-6 in 3
    # of 16,000 values, the rows up to 0.6; every other value within 1e-6).
    saved = trainer.to_held(Checkpointer(run, create=False).restore(10, trainer.abstract_state()))
    for t, a, b in zip(trainer.tables, trainer.host_tables(saved), trainer.host_tables(state), strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-5, err_msg=t.spec.name)

    shutil.rmtree(run / "checkpoints" / "10")  # what a kill after checkpoint 5 leaves
    resumed = train(load_config(DLRM[0], [*DLRM[1:], f"run_dir={run}"]))
    assert resumed.first_step == 5
    np.testing.assert_allclose(resumed.losses, got[5:], rtol=1e-6)
    np.testing.assert_allclose(resumed.eval_rows[-1]["eval_loss"], evaluated, rtol=1e-5)


def test_bad_ids_and_an_overflow_in_one_process_are_one_error_on_both_and_neither_hangs(tmp_path):
    """tests/support/embed_processes.py on 2 processes x 4 devices, a row-wise table over all 8, each
    process checking and routing its own samples: a good batch's lookup equals the reference on the
    whole batch; an id past the table in process 1's samples, a negative id in process 0's, lengths
    that do not add up in process 1's, then 9 ids from one of process 0's devices to one shard past
    a capacity of 4, are each one error naming the feature and the process, the same on both, after
    which both go on (the launch is bounded: none hangs)."""
    from hypertron.launch.local import free_ports, process_env

    script = Path(__file__).parent / "support" / "embed_processes.py"
    port, base = free_ports(), processes.fast_compile({k: v for k, v in os.environ.items() if not k.startswith("JAX_")})
    procs = [processes.start([sys.executable, str(script), str(tmp_path)],
                             env={**process_env(base, i, 2, port, 4), "PYTHONPATH": os.pathsep.join(sys.path)})
             for i in range(2)]
    try:
        errs = [p.communicate(timeout=180)[1] for p in procs]
    finally:
        processes.kill(*procs)
    want = ["good",
            "error: feature 'clicks': an id that is not a row of table 't' (0 to 63), in the samples of process 1",
            "error: feature 'clicks': an id that is not a row of table 't' (0 to 63), in the samples of process 0",
            "error: feature 'clicks': lengths that do not add up to its ids (or a negative length), in the samples "
            "of process 1",
            "error: feature 'clicks': 9 ids go from one device of process 0 to one shard of table 't' in this batch, "
            "past the buffer's capacity=4: raise it, leave it unset to size it from the data, or set overflow='drop' "
            "to drop and count them"]
    for i, (p, err) in enumerate(zip(procs, errs)):
        assert p.returncode == 0, err
        assert (tmp_path / f"process_{i}.txt").read_text().splitlines() == want
