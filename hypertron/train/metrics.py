"""Step metrics: throughput arithmetic, the JSONL log, and the console display.

The loop fetches each step's metrics while the next step already runs on the
device, so the host never leaves the device idle to log.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax


@dataclass
class Throughput:
    """Per-step rates from the model's FLOPs and the wall time of an interval."""

    tokens_per_step: int
    flops_per_step: float
    num_devices: int
    peak_flops: float | None  # bf16
    # With quantised training: the peak of its format (None if unknown). MFU is then against
    # it, and EMFU (effective MFU) against the bf16 peak, as MaxText reports them.
    quant_peak_flops: float | None = None
    quantized: bool = False

    def rates(self, seconds_per_step: float) -> dict[str, float | None]:
        tflops = self.flops_per_step / seconds_per_step / self.num_devices / 1e12
        ratio = lambda peak: None if not peak else tflops * 1e12 / peak
        out = {
            "step_time": seconds_per_step,
            "tokens_per_sec_per_device": self.tokens_per_step / seconds_per_step / self.num_devices,
            "tflops_per_device": tflops,
            "mfu": ratio(self.quant_peak_flops if self.quantized else self.peak_flops),
        }
        if self.quantized:
            out["emfu"] = ratio(self.peak_flops)
        return out


@dataclass
class MetricsLog:
    """Rows of step (and eval) metrics, appended to ``metrics.jsonl`` by process 0 only."""

    path: Path | None
    throughput: Throughput

    def step_row(self, step: int, metrics: dict[str, Any], step_time: float) -> dict[str, Any]:
        """The row of one finished step (``metrics`` already on the host); written and returned."""
        values = {k: (float(v) if getattr(v, "ndim", 0) == 0 else [float(x) for x in v]) for k, v in metrics.items()}
        row = {"step": step, **values, **self.throughput.rates(step_time)}
        return self.write(row)

    def write(self, row: dict[str, Any]) -> dict[str, Any]:
        row["time"] = time.time()
        if self.path is not None and jax.process_index() == 0:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return row


def mean_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The last row, with step time and rates averaged over ``rows`` (for one console line per interval)."""
    out = dict(rows[-1])
    for key in ("step_time", "tokens_per_sec_per_device", "tflops_per_device", "mfu", "emfu"):
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
        f"{row['tokens_per_sec_per_device']:,.0f} tok/s/dev",
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
