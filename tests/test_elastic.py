"""Elastic restarts (issue 46): one run resumed on another process count each time, 2 x 4 CPU
devices, then 1 x 8, then 4 x 2 (``hypertron launch local``), reads the batches an uninterrupted run
reads: the default 8 data shards make each global batch the same on 1, 2, 4 and 8 processes, and a
restoring process takes its shards' positions from whichever process saved them. Each process's
``step`` events carry its rows' digest, which the test matches against the uninterrupted stream's
rows that process fed; the losses are one process's on the same 8 devices.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest

from hypertron.config import load_config
from hypertron.data import make_batches
from hypertron.train.events import read_events
from hypertron.train.loop import batch_digest, train
from support import processes  # tests/support
from support.tiny import TWO_LAYERS  # tests/support

pytestmark = pytest.mark.slow

TINY = [*TWO_LAYERS, "train.log_every=1", "data.source=stdlib", "train.schedule=constant", "train.warmup_steps=0",
        "checkpoint.every=4", "monitor.collect=false"]
# (processes, CPU devices each, the step the leg trains to, extra overrides): the mesh is fsdp over all 8
# devices, and on 4 processes data across them (mesh.dcn.data), fsdp inside each.
LEGS = [(2, 4, 4, []), (1, 8, 8, []), (4, 2, 12, ["mesh.dcn.data=-1"])]


def _launch(count: int, devices: int, *overrides: str):
    env = processes.fast_compile({k: v for k, v in os.environ.items() if not k.startswith("JAX_")})
    return processes.run([sys.executable, "-m", "hypertron.cli", "launch", "local", "--processes", str(count),
                          "--cpu-devices", str(devices), "--", "train", *overrides], env=env, timeout=400)


def _fed(step: int, processes_: int, process: int, stream: list[dict]) -> str:
    """The digest of the rows ``process`` of ``processes_`` feeds at ``step`` of the uninterrupted stream."""
    rows = len(stream[0]["inputs"]) // processes_
    return batch_digest({k: v[process * rows:(process + 1) * rows] for k, v in stream[step - 1].items()})


def test_a_run_resumed_on_1_2_and_4_processes_reads_the_uninterrupted_batches(tmp_path):
    run = tmp_path / "run"
    for count, devices, steps, extra in LEGS:
        out = _launch(count, devices, *TINY, f"train.steps={steps}", f"run_dir={run}", *extra)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "starts afresh" not in out.stdout + out.stderr
    stream = make_batches(source="stdlib", seq_len=32, batch_size=8, seed=0, shards=8)
    stream = [next(stream) for _ in range(12)]
    first = 1
    for count, _, last, _ in LEGS:
        for p in range(count):
            events = read_events(run / ("events.jsonl" if p == 0 else f"events.{p}.jsonl"))
            got = {e["step"]: e["batch_digest"] for e in events if e["event"] == "step" and first <= e["step"] <= last}
            assert got == {s: _fed(s, count, p, stream) for s in range(first, last + 1)}, (count, p)
        first = last + 1

    # On 4 processes: data across them (mesh.dcn.data), each process's 2 devices along fsdp inside.
    for p in range(4):
        ready = [e for e in read_events(run / ("events.jsonl" if p == 0 else f"events.{p}.jsonl"))
                 if e["event"] == "backend_ready"][-1]
        assert ready["mesh"] == {"data": 4, "fsdp": 2, "expert": 1, "context": 1, "tensor": 1, "stage": 1}
        assert ready["mesh_coords"] == [[p, i, 0, 0, 0, 0] for i in range(2)] and ready["process_count"] == 4

    # Each restore says which shape saved the step and which restored it.
    ends = [e for e in read_events(run / "events.jsonl") if e["event"] == "restore_end"]
    assert [(e["step"], e["data_restored"]) for e in ends] == [(4, True), (8, True)]
    assert [(e["saved_topology"]["processes"], e["topology"]["processes"]) for e in ends] == [(2, 1), (1, 4)]
    assert ends[1]["topology"]["mesh"]["data"] == 4 and all(e["topology"]["devices"] == 8 for e in ends)

    # The losses: one process on the same 8 devices, 12 steps straight.
    want = train(load_config(None, [*TINY, "train.steps=12", "checkpoint.enabled=false", f"run_dir={tmp_path / 'one'}"]))
    assert len(jax.devices()) == 8
    got = [r["loss"] for r in map(_json, (run / "metrics.jsonl").read_text().splitlines())]
    np.testing.assert_allclose(got, want.losses, rtol=2e-5)

    # 3 processes cannot share 8 shards: one line, before anything is restored or written.
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    refused = _launch(3, 1, *TINY, "train.steps=16", f"run_dir={run}", "data.shards=8", "train.global_batch=24",
                      "mesh.data=3", "mesh.fsdp=1")
    assert refused.returncode != 0
    lines = [line for line in (refused.stdout + refused.stderr).splitlines() if "data.shards=8" in line]
    assert lines and "the 3 processes that read the data must divide it" in lines[0], refused.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def _json(line: str) -> dict:
    import json

    return json.loads(line)
