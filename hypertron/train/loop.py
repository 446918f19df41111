"""The training loop behind ``hypertron train``.

Order matters for users: every check that can fail on their input (config,
data paths, mesh against devices, an existing run of another model, a run
whose checkpoints are all damaged) runs before anything is compiled or written.

A run resumes exactly: parameters, optimiser state, step and the position of
every process's data iterator come from the newest checkpoint that passes its
manifest check (older ones are tried if it fails to load). The train step
draws no random numbers (there is no dropout), so nothing else needs saving.
"""

from __future__ import annotations

import dataclasses
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import jax
import numpy as np
from rich.console import Console

from hypertron.checkpoint import (
    CheckpointError,
    Checkpointer,
    newest_usable_step,
    write_run_config,
)
from hypertron.config import Config, ConfigError
from hypertron.errors import DataError
from hypertron.parallel import distributed
from hypertron.parallel.mesh import local_coords
from hypertron.runfiles import METRICS_FILE, TENSORBOARD_DIR
from hypertron.train.events import EventFile, job_start_fields
from hypertron.train.metrics import ConsoleTracker, MetricsFile, TensorBoard
from hypertron.train.preemption import StopSignal
from hypertron.train.task import Task, task_for
from hypertron.tracker import Tracker, Tracking


@dataclass
class TrainResult:
    first_step: int
    last_step: int
    losses: list[float]
    rows: list[dict]
    status: str = "completed"  # completed | preempted
    eval_rows: list[dict] = dataclasses.field(default_factory=list)


def standard_trackers(cfg: Config, console: Console) -> list[Tracker]:
    """The sinks every run has: this process's event file; on process 0 also ``metrics.jsonl``,
    TensorBoard and the console (the other processes print nothing but errors)."""
    run_dir = Path(cfg.run_dir)
    sinks: list[Tracker] = [EventFile(run_dir, jax.process_index())]
    if jax.process_index() == 0:
        sinks += [MetricsFile(run_dir / METRICS_FILE), TensorBoard(run_dir / TENSORBOARD_DIR),
                  ConsoleTracker(console, cfg.train.log_every)]
    return sinks


def train(cfg: Config, console: Console | None = None, trackers: Iterable[Tracker] = ()) -> TrainResult:
    """Train ``cfg`` in ``cfg.run_dir``, resuming from its latest usable checkpoint if there is one.

    ``trackers`` are sinks beside the standard ones (:func:`standard_trackers`): each is told
    when the loop begins, every step's and evaluation's scalars, every job event and the end
    (:mod:`hypertron.tracker`).
    """
    started = time.time()
    task = task_for(cfg)
    task.check_inputs(cfg)
    distributed.initialize(cfg.distributed)
    devices = jax.devices()
    # One voice: processes other than 0 print nothing but errors (the launcher shows those).
    console = console or Console(stderr=True, soft_wrap=True, quiet=jax.process_index() > 0)
    backend_ready = time.time()
    mesh = task.mesh(cfg, devices)
    delay = data_delay(jax.process_index())  # a bad setting fails before compiling
    task.check_init_from(cfg)
    run_dir = Path(cfg.run_dir)
    write_run_config(run_dir, cfg, write=jax.process_index() == 0)
    ckpt = Checkpointer(run_dir, keep=cfg.checkpoint.keep) if cfg.checkpoint.enabled else None
    try:
        # Before any event or compile: a run that cannot resume is refused with nothing written.
        start, skipped = _usable_start(ckpt, console)
    except BaseException:
        if ckpt:
            ckpt.close()
        raise
    tracking = Tracking([*standard_trackers(cfg, console), *trackers], jax.process_index(), start_time=started)
    tracking.emit("job_start", at=started, **job_start_fields(jax.process_count()))
    tracking.emit("backend_ready", at=backend_ready, platform=jax.default_backend(), device_count=len(devices),
                local_device_count=jax.local_device_count(), seconds=backend_ready - started,
                mesh=dict(mesh.shape), mesh_coords=local_coords(mesh), process_count=jax.process_count())
    for step, problem in skipped:
        tracking.emit("checkpoint_skipped", step, reason=problem)
    if ckpt:
        ckpt.events = tracking
    status, last = "failed", None
    try:
        with StopSignal() as stop:
            if start is not None and start >= cfg.train.steps:
                console.print(f"{run_dir} is already at step {start} (train.steps={cfg.train.steps}): "
                              "nothing to do; raise train.steps to train further", highlight=False)
                status, last = "completed", start
                return TrainResult(start, start, [], [])
            data = task.batches(cfg)
            # Built now, so a bad eval split fails before compiling, not hours in.
            eval_data = task.batches(cfg, split="eval") if cfg.train.eval_every else None
            trainer = task.trainer(cfg, mesh)
            state, start = _initial_state(cfg, task, trainer, ckpt, start, data, tracking, console)
            # A task may prepare its batches ahead of the steps (DLRM routes them on a thread); the
            # data position it reports stays the loop's. Optional: not in the Task protocol.
            ahead = getattr(task, "ahead", None)
            if ahead is not None:
                data = ahead(trainer, data)
            loop = _Loop(cfg, task, trainer, ckpt, tracking, stop, console, eval_data, delay)
            last = start
            try:
                result = loop.run(state, start, data)
            finally:
                last = loop.result.last_step
                if ahead is not None:
                    data.close()
            status = result.status
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        try:
            if ckpt:
                ckpt.close()  # waits for an async save in flight, also on Ctrl-C
        finally:
            tracking.emit("job_end", last, status=status, seconds=tracking.seconds())
            tracking.finish(status)
    _summarise(result, start, ckpt is not None, run_dir, console)
    return result


def _summarise(result: TrainResult, start: int, saved: bool, run_dir: Path, console) -> None:
    if len(result.losses) > 1:
        tail = result.losses[-max(1, len(result.losses) // 10):]
        console.print(f"loss {result.losses[0]:.3f} at step {start + 1} -> {np.mean(tail):.3f} "
                      f"(mean of the last {len(tail)} steps)", highlight=False)
    if result.status == "preempted":
        console.print(f"stopped by SIGTERM after step {result.last_step}"
                      + ("; the next run resumes there" if saved else " (checkpoints are off: nothing saved)"))
    if saved and result.last_step > start:
        console.print(f"saved checkpoint at step {result.last_step} in {run_dir / 'checkpoints'}")


def _usable_start(ckpt: Checkpointer | None, console) -> tuple[int | None, list[tuple[int, str]]]:
    """The step to resume from, checked before compiling, and the damaged newer steps set aside."""
    if ckpt is None:
        return None, []
    skipped = []

    def report(step: int, problem: str) -> None:
        console.print(f"checkpoint {step} is unusable ({problem}); falling back to an earlier one",
                      highlight=False)
        skipped.append((step, problem))

    start = newest_usable_step(ckpt, report)
    if start is not None:
        ckpt.require_train_state(start)  # a converted model cannot be resumed
    if skipped:
        # Out of the way, so this run can save those steps again; kept, not deleted.
        where = ckpt.set_aside([step for step, _ in skipped])
        console.print(f"moved unusable checkpoints {sorted(s for s, _ in skipped)} to {where}", highlight=False)
    return start, skipped


def _initial_state(cfg: Config, task: Task, trainer, ckpt: Checkpointer | None, start: int | None, data,
                   tracking: Tracking, console):
    """The state to start from: the latest checkpoint, else the task's new state (``train.init_from``'s
    parameters, else random)."""
    if start is not None:
        state, start = _restore(cfg, task, trainer, ckpt, start, data, tracking, console)
        state["step"] = jax.device_put(np.int32(start), trainer.state_shardings["step"])
        task.restored(cfg, trainer, state, console)
        return state, start
    return task.initial_state(cfg, trainer, console), 0


def _restore(cfg: Config, task: Task, trainer, ckpt: Checkpointer, start: int, data, tracking: Tracking, console):
    """Restore ``start``, or the newest older usable step if it cannot be read.

    A step that fails to load is only set aside once an older one has loaded
    (so the failure was that step's, not a config that fits none of them);
    if none loads, nothing is moved and the run is refused. With several
    processes a failure is not retried: the processes could disagree.
    """
    failed: list[tuple[int, str]] = []
    for step in [s for s in ckpt.usable_steps()[0] if s <= start]:
        console.print(f"resuming from step {step} in {cfg.run_dir}", highlight=False)
        if ckpt.unverified(step):
            console.print(f"checkpoint {step} has no manifest (older, or killed just after saving): "
                          "its files are not verified", highlight=False)
        tracking.emit("restore_start", step)
        t0 = time.time()
        try:
            state = trainer.to_held(ckpt.restore(step, trainer.abstract_state()))
            meta = ckpt.meta(step)
            data_restored = meta.get("data") == task.data_fingerprint(cfg) and ckpt.has_data(step)
            if data_restored:
                try:
                    ckpt.restore_data(step, data)
                except DataError as e:  # the position, not the checkpoint: the stream starts afresh
                    console.print(f"checkpoint {step}'s data position does not fit this run ({e})", highlight=False)
                    data_restored = False
        except (CheckpointError, KeyboardInterrupt):
            raise
        except Exception as e:  # Orbax / TensorStore raise many types for unreadable files
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            if jax.process_count() > 1:
                raise CheckpointError(f"checkpoint {step} could not be read ({reason})") from None
            console.print(f"checkpoint {step} could not be read ({reason}); trying an earlier one",
                          highlight=False)
            tracking.emit("checkpoint_skipped", step, reason=reason)
            failed.append((step, reason))
            continue
        if failed:  # out of the way, so this run can save those steps again; kept, not deleted
            where = ckpt.set_aside([s for s, _ in failed])
            console.print(f"moved unreadable checkpoints {[s for s, _ in failed]} to {where}", highlight=False)
        if not data_restored:
            console.print(f"the data settings differ from those of step {step}: the data stream starts afresh",
                          highlight=False)
        saved = {"saved_topology": meta["topology"]} if meta.get("topology") else {}  # older steps kept none
        tracking.emit("restore_end", step, seconds=time.time() - t0, data_restored=data_restored,
                      topology=topology(trainer), **saved)
        return state, step
    first_step, first_reason = failed[0]
    raise CheckpointError(
        f"no checkpoint in {ckpt.directory} could be read (step {first_step}: {first_reason}); if the config "
        "changed since they were saved, restore it, else move the checkpoints directory away to start over"
    )


FAULT_DATA_DELAY = "HYPERTRON_FAULT_DATA_DELAY"


def data_delay(process_index: int) -> float:
    """Seconds this process sleeps in each batch's loading: fault injection for straggler tests,
    set by ``HYPERTRON_FAULT_DATA_DELAY=PROCESS:SECONDS`` (e.g. ``2:0.3``; ``*:S`` for every process)."""
    text = os.environ.get(FAULT_DATA_DELAY, "").strip()
    if not text:
        return 0.0
    who, _, seconds = text.partition(":")
    try:
        delay = float(seconds)
        if who != "*":
            int(who)
    except ValueError:
        delay = -1.0
    if delay < 0:
        raise ConfigError(f"{FAULT_DATA_DELAY}={text!r}: expected PROCESS:SECONDS, e.g. 1:0.2")
    return delay if who == "*" or int(who) == process_index else 0.0


class _Loop:
    """Steps ``start + 1 .. train.steps``: feed batches, log, evaluate and save on schedule, stop on SIGTERM.

    Step ``n + 1`` is dispatched before step ``n``'s metrics are fetched, so
    the device always has the next step queued while the host logs. A step's
    ``step_time`` is the wall time between the ends of consecutive steps,
    which includes waiting for data but not evaluations or the blocking part
    of checkpoint saves (those have their own events). The first step's runs
    from the start of the loop, so it holds the compilation and the first batch.
    """

    def __init__(self, cfg: Config, task: Task, trainer, ckpt: Checkpointer | None, tracking: Tracking,
                 stop: StopSignal, console, eval_data=None, data_delay: float = 0.0):
        self.cfg, self.task, self.trainer, self.ckpt = cfg, task, trainer, ckpt
        self.tracking, self.stop = tracking, stop
        self.eval_data = None if eval_data is None else (eval_data, eval_data.get_state())
        self.console = console
        self.throughput = task.throughput(cfg)
        self.data_delay = data_delay  # fault injection (HYPERTRON_FAULT_DATA_DELAY)
        self.result = TrainResult(0, 0, [], [])
        self.last_end = time.perf_counter()

    def run(self, state, start: int, data) -> TrainResult:
        t, cfg = self.cfg.train, self.cfg
        self.result = TrainResult(start, start, [], [])
        self.start = start
        pending = None
        self.tracking.begin(start, t.steps)
        self.last_end = time.perf_counter()  # the first step's time runs from here
        for step in range(start + 1, t.steps + 1):
            t0 = time.perf_counter()
            local = next(data)
            if self.data_delay:
                time.sleep(self.data_delay)  # fault injection: a slow input pipeline on this process
            data_wait = time.perf_counter() - t0
            state, metrics = self.task.step(self.trainer, state, local)
            digest = batch_digest(local)  # while the step runs
            if pending:
                self._finish(*pending)
            pending = (step, metrics, data_wait, digest)
            # SIGTERM during the last step changes nothing: the run completes and saves anyway.
            preempted = self.stop.reached(step) and step < t.steps
            save = self.ckpt and (step % cfg.checkpoint.every == 0 or step == t.steps or preempted)
            evaluate = t.eval_every and step % t.eval_every == 0
            if save or evaluate or preempted:
                self._finish(*pending)
                pending = None
                if preempted:
                    self.tracking.emit("preemption", step, signal="SIGTERM")
                    self.result.status = "preempted"
                if evaluate:
                    self._evaluate(state, step)
                if save:
                    # The job waits for its last save (and the bundle) anyway: all of it blocks.
                    reason = "preemption" if preempted else "final" if step == t.steps else "interval"
                    saved = self.trainer.to_model(state)  # checkpoints and bundles hold the model's order
                    then = (lambda: self.task.finish(cfg, saved, self.console)) if reason == "final" else None
                    meta = {"data": self.task.data_fingerprint(cfg), "topology": topology(self.trainer)}
                    self.ckpt.save(step, saved, meta, data_iterator=data, reason=reason, wait=reason != "interval",
                                   then=then)
                self.last_end = time.perf_counter()
            if preempted:
                break
        if pending:
            self._finish(*pending)
        return self.result

    def _finish(self, step: int, metrics: dict, data_wait: float, digest: str) -> None:
        """Fetch a step's metrics (waiting for it), then report its scalars and events."""
        host = jax.device_get(metrics)
        now, wall = time.perf_counter(), time.time()  # the step's end, on both clocks
        step_time, self.last_end = now - self.last_end, now
        values = {k: (float(v) if getattr(v, "ndim", 0) == 0 else [float(x) for x in v]) for k, v in host.items()}
        values.update(self.throughput.rates(step_time), data_wait=data_wait)
        if step == self.start + 1:
            self.tracking.emit("first_step", step, at=wall, seconds=wall - self.tracking.start_time)
        # Stamped with the step's end, so ``time - step_time`` is when it began (docs/events.md).
        self.tracking.emit("step", step, at=wall, step_time=step_time, data_wait=data_wait, batch_digest=digest)
        self.tracking.scalars(step, values)
        self.result.losses.append(values["loss"])
        self.result.rows.append({"step": step, **values})
        self.result.last_step = step

    def _evaluate(self, state, step: int) -> None:
        """The task's scalars over ``train.eval_batches`` batches of the held-out split (the same
        batches each time): ``loss``, and ``tokens`` or ``auc`` (the task's)."""
        t0 = time.time()
        batches, initial = self.eval_data
        batches.set_state(initial)
        values = self.task.evaluate(self.trainer, state, batches, self.cfg.train.eval_batches)
        values["seconds"] = time.time() - t0
        self.tracking.scalars(step, values, group="eval")
        self.tracking.emit("eval", step, **values)
        self.result.eval_rows.append({"step": step, **{f"eval_{k}": v for k, v in values.items()}})


def batch_digest(local: dict) -> str:
    """This process's rows of a step, as 8 hex digits: CRC-32 over its arrays' bytes in key order
    (the ``step`` event's ``batch_digest``: which rows a step saw, compared across runs and process
    counts without keeping them). Keys with a leading ``_`` hold what a task derived from the rows
    ahead of the step (DLRM's routing), not rows, and are left out."""
    crc = 0
    rows = {k: v for k, v in local.items() if not k.startswith("_")}
    for leaf in jax.tree.leaves(rows):  # dicts flatten in key order
        a = np.asarray(leaf)
        crc = zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B") if a.dtype != object
                         else repr(a.tolist()).encode(), crc)
    return f"{crc:08x}"


def topology(trainer) -> dict:
    """The processes, devices and mesh a run trains on (checkpoint meta; ``restore_end``)."""
    mesh = trainer.mesh
    return {"processes": jax.process_count(), "devices": int(mesh.devices.size), "mesh": dict(mesh.shape)}


def steps_per_second(result: TrainResult) -> float:
    times = [r["step_time"] for r in result.rows[1:]]
    return 1.0 / float(np.mean(times)) if times else float("nan")
