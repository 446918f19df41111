"""The tracker interface: a sink passed to ``train`` sees exactly what the standard sinks keep."""

import json
import struct

import numpy as np
import pytest

from hypertron.config import load_config
from hypertron.train.events import read_events
from hypertron.train.loop import train
from hypertron.tracker import Tracker, Tracking
from support.tiny import ONE_LAYER  # tests/support

TINY = [*ONE_LAYER, "train.log_every=1", "data.source=stdlib", "train.eval_every=2",
        "train.eval_batches=1", "data.eval_fraction=0.05", "checkpoint.every=2"]


class Recorder(Tracker):
    def __init__(self):
        self.calls = []

    def begin(self, step, total):
        self.calls.append(("begin", step, total))

    def scalars(self, step, values, group="train"):
        self.calls.append(("scalars", step, dict(values), group))

    def event(self, record):
        self.calls.append(("event", dict(record)))

    def finish(self, status):
        self.calls.append(("finish", status))


def _tensorboard_scalars(logdir):
    """``{(tag, step): value}`` from TensorBoard event files, read record by record as TensorBoard
    reads them, with ``tensorboardX``'s protobuf and CRC-32C (our writer is
    :mod:`hypertron.train.tfevents`): the length, its masked CRC, the Event, its masked CRC; each
    file starts with the ``brain.Event:2`` version record."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    out = {}
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files
    for path in files:
        data = path.read_bytes()
        at, versions = 0, []
        while at < len(data):
            header = data[at: at + 8]
            (length,) = struct.unpack("<Q", header)
            body = data[at + 12: at + 12 + length]
            assert struct.unpack_from("<I", data, at + 8)[0] == masked_crc32c(header)
            assert struct.unpack_from("<I", data, at + 12 + length)[0] == masked_crc32c(body)
            event = Event.FromString(body)
            at += 12 + length + 4
            versions += [event.file_version] if event.file_version else []
            for value in event.summary.value:
                out[(value.tag, event.step)] = value.simple_value
        assert at == len(data) and versions == ["brain.Event:2"], (path, versions)
    return out


def test_a_tracker_sees_every_scalar_and_event_the_files_keep(tmp_path):
    run = tmp_path / "run"
    first, again = Recorder(), Recorder()
    result = train(load_config(None, TINY + [f"run_dir={run}", "train.steps=4"]), trackers=[first])
    train(load_config(None, TINY + [f"run_dir={run}", "train.steps=6"]), trackers=[again])

    # Evaluations on the held-out split of the stdlib corpus (the same batch each time).
    assert [r["step"] for r in result.eval_rows] == [2, 4]
    assert all(np.isfinite(r["eval_loss"]) and r["eval_tokens"] == 8 * 16 for r in result.eval_rows)
    assert result.eval_rows[0]["eval_loss"] != result.eval_rows[1]["eval_loss"]

    # The loop begins after the restored step, and finishing comes last, after job_end.
    assert first.calls[0][0] == "event" and ("begin", 0, 4) in first.calls
    assert ("begin", 4, 6) in again.calls
    for rec in (first, again):
        assert rec.calls[-1] == ("finish", "completed")
        assert rec.calls[-2][0] == "event" and rec.calls[-2][1]["event"] == "job_end"

    # Events: the same records, in the same order, as events.jsonl (both jobs).
    seen = [c[1] for rec in (first, again) for c in rec.calls if c[0] == "event"]
    assert seen == read_events(run / "events.jsonl")
    assert [e["step"] for e in seen if e["event"] == "step"] == [1, 2, 3, 4, 5, 6]

    # Scalars: metrics.jsonl holds each one, with its step and the time it was written.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sent = [(c[1], c[2], c[3]) for rec in (first, again) for c in rec.calls if c[0] == "scalars"]
    assert [(step, group) for step, _, group in sent] == [
        (1, "train"), (2, "train"), (2, "eval"), (3, "train"), (4, "train"), (4, "eval"),
        (5, "train"), (6, "train"), (6, "eval")]
    for (step, values, group), row in zip(sent, rows, strict=True):
        named = values if group == "train" else {f"eval_{k}": v for k, v in values.items()}
        assert row == {"step": step, **named, "time": pytest.approx(row["time"])}
    assert {"loss", "grad_norm", "lr", "step_time", "data_wait", "tokens_per_sec_per_device"} <= set(sent[0][1])

    # TensorBoard: every numeric scalar as group/name at its step (float32 there).
    board = _tensorboard_scalars(run / "tensorboard")
    for step, values, group in sent:
        for name, value in values.items():
            if isinstance(value, float):
                assert board[(f"{group}/{name}", step)] == pytest.approx(value, rel=1e-6, abs=1e-30)


class Broken(Tracker):
    def finish(self, status):
        raise OSError("disk full")


def test_fan_out_stamps_once_and_finishes_every_sink():
    a, b = Recorder(), Recorder()
    tracking = Tracking([a, Broken(), b], process_index=3, start_time=100.0)
    record = tracking.emit("step", 7, at=123.5, step_time=0.5, data_wait=0.0)
    assert record == {"time": 123.5, "event": "step", "process": 3, "step": 7, "step_time": 0.5, "data_wait": 0.0}
    assert a.calls == b.calls == [("event", record)]
    with pytest.raises(ValueError, match="unknown event 'stepp'"):
        tracking.emit("stepp", 1)
    with pytest.raises(OSError, match="disk full"):  # the first failure, after every sink finished
        tracking.finish("failed")
    assert a.calls[-1] == b.calls[-1] == ("finish", "failed")
    tracking.emit("job_end", 7)  # after the end: nothing is sent
    tracking.finish("failed")  # once only
    assert len(a.calls) == 2
    Tracking([Tracker()]).emit("job_start")  # the no-op tracker accepts everything
