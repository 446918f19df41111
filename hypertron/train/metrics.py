"""Step metrics: throughput arithmetic, and the sinks that show and keep them (the console
lines and progress bar, ``metrics.jsonl``, TensorBoard; :mod:`hypertron.tracker`).

The loop fetches each step's metrics while the next step already runs on the
device, so the host never leaves the device idle to log.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from hypertron.tracker import Tracker
from hypertron.train.tfevents import EventFile


@dataclass
class Throughput:
    """Per-step rates from the model's FLOPs and the wall time of an interval. ``unit``: what a step
    counts (``tokens`` for a language model, ``samples`` for a recommender), naming its rate."""

    tokens_per_step: int
    flops_per_step: float
    num_devices: int
    peak_flops: float | None  # bf16
    # With quantised training: the peak of its format (None if unknown). MFU is then against
    # it, and EMFU (effective MFU) against the bf16 peak, as MaxText reports them.
    quant_peak_flops: float | None = None
    quantized: bool = False
    unit: str = "tokens"

    def rates(self, seconds_per_step: float) -> dict[str, float | None]:
        tflops = self.flops_per_step / seconds_per_step / self.num_devices / 1e12
        ratio = lambda peak: None if not peak else tflops * 1e12 / peak
        out = {
            "step_time": seconds_per_step,
            f"{self.unit}_per_sec_per_device": self.tokens_per_step / seconds_per_step / self.num_devices,
            "tflops_per_device": tflops,
            "mfu": ratio(self.quant_peak_flops if self.quantized else self.peak_flops),
        }
        if self.quantized:
            out["emfu"] = ratio(self.peak_flops)
        return out


class MetricsFile(Tracker):
    """The sink that appends one JSON line per step and per evaluation to ``metrics.jsonl``
    (process 0's): ``step``, the values (an evaluation's prefixed ``eval_``), ``time``."""

    def __init__(self, path: str | Path):
        self._file = Path(path).open("a", buffering=1)

    def scalars(self, step: int, values: Mapping[str, Any], group: str = "train") -> None:
        named = values if group == "train" else {f"{group}_{k}": v for k, v in values.items()}
        self._file.write(json.dumps({"step": step, **named, "time": time.time()}) + "\n")

    def finish(self, status: str) -> None:
        self._file.close()


class TensorBoard(Tracker):
    """The sink that writes every numeric scalar as ``group/name`` to a TensorBoard event file
    (:mod:`hypertron.train.tfevents`: the file format without TensorFlow or the TensorBoard server)."""

    def __init__(self, logdir: str | Path, flush_secs: int = 10):
        self._file = EventFile(logdir, flush_secs=flush_secs)

    def scalars(self, step: int, values: Mapping[str, Any], group: str = "train") -> None:
        self._file.scalars(step, ((f"{group}/{name}", value) for name, value in values.items()
                                  if isinstance(value, (int, float)) and not isinstance(value, bool)))

    def finish(self, status: str) -> None:
        self._file.close()


class ConsoleTracker(Tracker):
    """The sink that prints a line per ``log_every`` steps (their mean rates; the first step,
    which carries the compile, alone) and per evaluation, and draws a progress bar on a terminal."""

    def __init__(self, console: Console, log_every: int, interactive: bool | None = None):
        self.console, self.log_every = console, log_every
        self.interactive = is_interactive() if interactive is None else interactive
        self.interval: list[dict[str, Any]] = []
        self.first = self.total = None
        self.progress = self.task = None

    def begin(self, step: int, total: int) -> None:
        self.first, self.total = step + 1, total
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(), console=self.console, disable=not self.interactive,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=step, info="compiling")

    def scalars(self, step: int, values: Mapping[str, Any], group: str = "train") -> None:
        if group != "train":
            extra = f" | {values['tokens']:,.0f} tokens" if "tokens" in values else ""
            extra += f" | auc {values['auc']:.4f}" if "auc" in values else ""
            self.console.print(f"step {step:>6} | {group}_loss {values['loss']:.4f}{extra}", highlight=False)
            return
        self.interval.append({"step": step, **values})
        if step == self.first or step % self.log_every == 0 or step == self.total:
            self.console.print(format_row(mean_row(self.interval)), highlight=False)
            self.interval = []
            if self.progress:
                self.progress.update(self.task, info=f"loss {values['loss']:.3f}")
        if self.progress:
            self.progress.update(self.task, completed=step)

    def finish(self, status: str) -> None:
        if self.progress:
            self.progress.stop()
            self.progress = None


def mean_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The last row, with step time and rates averaged over ``rows`` (for one console line per interval)."""
    out = dict(rows[-1])
    for key in ("step_time", "tokens_per_sec_per_device", "samples_per_sec_per_device", "tflops_per_device", "mfu",
                "emfu"):
        values = [r[key] for r in rows if r.get(key) is not None]
        if key in out or values:
            out[key] = sum(values) / len(values) if values else None
    return out


def format_row(row: dict[str, Any]) -> str:
    """One console line for a logged step."""
    parts = [
        f"step {row['step']:>6}",
        f"loss {row['loss']:.4f}",
        f"grad_norm {row['grad_norm']:.3f}",
        f"lr {row['lr']:.2e}",
        f"{row['step_time'] * 1e3:.0f} ms/step",
        *([f"{row['tokens_per_sec_per_device']:,.0f} tok/s/dev"] if "tokens_per_sec_per_device" in row else []),
        *([f"{row['samples_per_sec_per_device']:,.0f} samples/s/dev"] if "samples_per_sec_per_device" in row else []),
        f"{row['tflops_per_device']:.3g} TFLOP/s/dev",
    ]
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    if row.get("emfu") is not None:
        parts.append(f"EMFU {100 * row['emfu']:.1f}%")
    if row.get("expert_load") is not None:
        load = row["expert_load"]
        parts.append(f"busiest expert {max(load) * len(load):.2f}x even")
        if row.get("moe_dropped"):
            parts.append(f"dropped {100 * row['moe_dropped']:.1f}%")
    return " | ".join(parts)


def is_interactive() -> bool:
    return sys.stderr.isatty()
