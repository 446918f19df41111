"""Bytes and seconds for people: one format wherever hypertron prints a size or a duration (the
planners, the refusals, the monitor's report)."""

from __future__ import annotations

import math

_BYTE_UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def describe_bytes(n: float, per_second: bool = False) -> str:
    """Three significant figures in binary units: ``4 GiB``, ``1.91 KiB``, ``33.2 GiB``, ``12 B``;
    ``per_second`` adds ``/s``."""
    unit = "/s" if per_second else ""
    for scale, name in _BYTE_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.3g} {name}{unit}"
    return f"{n:.0f} B{unit}"


def describe_seconds(x: float | None) -> str:
    """A short time: ``12.5 ms`` under a second, ``1.234 s`` above; ``-`` for none."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.3f} s"


def describe_duration(seconds: float | None) -> str:
    """A span: ``42.00s`` under a minute, else ``1d02h03m04s`` (days and hours when there are any)."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.2f}s"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    return (f"{d}d" if d else "") + (f"{h}h" if h or d else "") + f"{m:02d}m{s:02d}s"
