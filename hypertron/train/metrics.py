"""Step metrics: throughput arithmetic, the JSONL log, and the console display.

Device-side metrics are kept as arrays and fetched once per logging interval,
so the host never waits on the device inside an interval.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax


@dataclass
class Throughput:
    """Per-step rates from the model's FLOPs and the wall time of an interval."""

    tokens_per_step: int
    flops_per_step: float
    num_devices: int
    peak_flops: float | None

    def rates(self, seconds_per_step: float) -> dict[str, float | None]:
        tflops = self.flops_per_step / seconds_per_step / self.num_devices / 1e12
        return {
            "step_time": seconds_per_step,
            "tokens_per_sec_per_device": self.tokens_per_step / seconds_per_step / self.num_devices,
            "tflops_per_device": tflops,
            "mfu": None if not self.peak_flops else tflops * 1e12 / self.peak_flops,
        }


@dataclass
class MetricsLog:
    """Buffers device metrics per step; ``flush`` fetches them in one transfer and writes JSONL."""

    path: Path | None
    throughput: Throughput
    pending: list[tuple[int, dict[str, jax.Array]]] = field(default_factory=list)
    last_time: float = field(default_factory=time.perf_counter)

    def add(self, step: int, metrics: dict[str, jax.Array]) -> None:
        self.pending.append((step, metrics))

    def restart_clock(self) -> None:
        self.last_time = time.perf_counter()

    def flush(self) -> list[dict[str, Any]]:
        """Fetch buffered metrics (this waits for the device), write one line per step, return them."""
        if not self.pending:
            return []
        host = jax.device_get([m for _, m in self.pending])
        now = time.perf_counter()
        per_step = (now - self.last_time) / len(self.pending)
        self.last_time = now
        rows = []
        for (step, _), m in zip(self.pending, host):
            row = {"step": step, **{k: float(v) for k, v in m.items()}, **self.throughput.rates(per_step)}
            row["time"] = time.time()
            rows.append(row)
        self.pending.clear()
        if self.path is not None and jax.process_index() == 0:
            with self.path.open("a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        return rows


def format_row(row: dict[str, Any]) -> str:
    """One console line for a logged step."""
    parts = [
        f"step {row['step']:>6}",
        f"loss {row['loss']:.4f}",
        f"grad_norm {row['grad_norm']:.3f}",
        f"lr {row['lr']:.2e}",
        f"{row['step_time'] * 1e3:.0f} ms/step",
        f"{row['tokens_per_sec_per_device']:,.0f} tok/s/dev",
        f"{row['tflops_per_device']:.3g} TFLOP/s/dev",
    ]
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    return " | ".join(parts)


def is_interactive() -> bool:
    return sys.stderr.isatty()
