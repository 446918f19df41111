"""The training loop behind ``hypertron train``.

Order matters for users: every check that can fail on their input (config,
data paths, mesh against devices, an existing run of another model) runs
before anything is compiled or written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from hypertron.checkpoint import (
    CheckpointError,
    Checkpointer,
    latest_step,
    load_params,
    read_run_config,
    write_run_config,
)
from hypertron.config import Config, validate_for_devices
from hypertron.data import check_source, make_batches
from hypertron.parallel.mesh import make_mesh
from hypertron.train.flops import device_peak_flops, train_flops_per_token
from hypertron.train.metrics import MetricsLog, Throughput, format_row, is_interactive
from hypertron.train.step import global_batch, make_trainer


@dataclass
class TrainResult:
    first_step: int
    last_step: int
    losses: list[float]
    rows: list[dict]


def batches_for(cfg: Config) -> Iterator[dict]:
    """This process's share of each global batch, from the configured source."""
    d, t = cfg.data, cfg.train
    per_process = t.global_batch // jax.process_count()
    return make_batches(
        source=d.source, paths=d.paths, text_field=d.text_field, tokenizer=d.tokenizer,
        seq_len=t.seq_len, batch_size=per_process, seed=d.seed, shuffle=d.shuffle,
        process_index=jax.process_index(), process_count=jax.process_count(),
        vocab_size=cfg.model.vocab_size,
    )


def check_init_from(cfg: Config) -> None:
    """``train.init_from`` must name a run with a checkpoint of the same parameter shapes."""
    if not cfg.train.init_from:
        return
    from hypertron.models import declare
    from hypertron.models.params import abstract

    src = read_run_config(cfg.train.init_from)
    latest_step(cfg.train.init_from)  # refuses a run without checkpoints, before compiling
    shapes = lambda m: jax.tree.map(lambda a: a.shape, abstract(declare(m), "float32"))
    if shapes(src.model) != shapes(cfg.model):
        raise CheckpointError(
            f"train.init_from={cfg.train.init_from} holds a {src.model.name} model whose parameter "
            f"shapes differ from model={cfg.model.name}; set model to match it"
        )


def train(cfg: Config, console: Console | None = None) -> TrainResult:
    """Train ``cfg`` in ``cfg.run_dir``, resuming from its latest checkpoint if there is one."""
    console = console or Console(stderr=True, soft_wrap=True)
    check_source(cfg.data.source, cfg.data.paths, cfg.data.text_field)
    devices = jax.devices()
    validate_for_devices(cfg, len(devices))
    check_init_from(cfg)
    run_dir = Path(cfg.run_dir)
    write_run_config(run_dir, cfg)
    ckpt = Checkpointer(run_dir, keep=cfg.checkpoint.keep) if cfg.checkpoint.enabled else None
    try:
        start = ckpt.latest_step() if ckpt else None
        if start is not None:
            ckpt.require_train_state(start)  # before compiling: a converted model cannot be resumed
        if start is not None and start >= cfg.train.steps:
            console.print(f"{run_dir} is already at step {start} (train.steps={cfg.train.steps}): "
                          "nothing to do; raise train.steps to train further", highlight=False)
            return TrainResult(start, start, [], [])
        trainer = make_trainer(cfg, make_mesh(cfg.mesh, devices))
        state, start = _initial_state(cfg, trainer, ckpt, start, console)
        result = _run_steps(cfg, trainer, state, start, ckpt, console)
    finally:
        if ckpt:
            ckpt.close()  # waits for an async save in flight, also on Ctrl-C
    if len(result.losses) > 1:
        tail = result.losses[-max(1, len(result.losses) // 10):]
        console.print(f"loss {result.losses[0]:.3f} at step {start + 1} -> {np.mean(tail):.3f} "
                      f"(mean of the last {len(tail)} steps)", highlight=False)
    if ckpt and result.last_step > start:
        console.print(f"saved checkpoint at step {result.last_step} in {run_dir / 'checkpoints'}")
    return result


def _initial_state(cfg: Config, trainer, ckpt: Checkpointer | None, start: int | None, console):
    """The state to start from: the latest checkpoint, else ``train.init_from``'s parameters, else random."""
    if start is not None:
        console.print(f"resuming from step {start} in {cfg.run_dir}")
        state = ckpt.restore(start, trainer.abstract_state())
        state["step"] = jax.device_put(np.int32(start), trainer.state_shardings["step"])
        return state, start
    state = trainer.init(jax.random.key(cfg.train.seed))
    if cfg.train.init_from:
        console.print(f"starting from the parameters in {cfg.train.init_from}")
        _, state["params"] = load_params(cfg.train.init_from, shardings=trainer.abstract_state()["params"])
    return state, 0


def _run_steps(cfg: Config, trainer, state, start: int, ckpt: Checkpointer | None, console) -> TrainResult:
    """Steps ``start + 1 .. train.steps``: feed batches, log at intervals, save on schedule."""
    t = cfg.train
    data = batches_for(cfg)
    # Without a checkpointed iterator position, skip what earlier steps consumed
    # so a resumed run does not see the same batches again.
    for _ in range(start):
        next(data)
    tokens = t.global_batch * t.seq_len
    log = MetricsLog(
        Path(cfg.run_dir) / "metrics.jsonl" if jax.process_index() == 0 else None,
        Throughput(tokens, train_flops_per_token(cfg.model, t.seq_len) * tokens, jax.device_count(),
                   device_peak_flops(t.peak_flops)),
    )
    result = TrainResult(start, start, [], [])
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(), console=console, disable=not is_interactive(),
    )
    with progress:
        task = progress.add_task("train", total=t.steps, completed=start, info="compiling")
        for step in range(start + 1, t.steps + 1):
            state, metrics = trainer.step(state, global_batch(next(data), trainer.batch_sharding))
            log.add(step, metrics)
            first = step == start + 1
            if first or step % t.log_every == 0 or step == t.steps:
                rows = log.flush()  # the only host-device sync of an interval
                if first:
                    log.restart_clock()  # the first step carries the compile
                result.losses += [r["loss"] for r in rows]
                result.rows += rows
                console.print(format_row(rows[-1]), highlight=False)
                progress.update(task, info=f"loss {rows[-1]['loss']:.3f}")
            progress.update(task, completed=step)
            if ckpt and (step % cfg.checkpoint.every == 0 or step == t.steps):
                ckpt.save(step, state)
            result.last_step = step
    return result


def steps_per_second(result: TrainResult) -> float:
    times = [r["step_time"] for r in result.rows[1:]]
    return 1.0 / float(np.mean(times)) if times else float("nan")
