"""How the monitor judges a run, and the defaults, in one place: :func:`hypertron.monitor.report.build`,
:mod:`hypertron.monitor.stragglers` and ``hypertron monitor``'s flags read them."""

from __future__ import annotations

from dataclasses import dataclass, field


def _option(default, metavar: str, help: str):
    """A setting's field with its ``--flag``'s help and metavar (``hypertron.cli.flags`` reads them)."""
    return field(default=default, metadata={"metavar": metavar, "help": help})


@dataclass(frozen=True, kw_only=True)
class ReportSettings:
    """The report's thresholds: one field per ``hypertron monitor`` flag (``hang_factor`` is
    ``--hang-factor``), whose default and help are the field's.

    ``hang_factor``, ``hang_min``: a running job is hung when its last step ended more than
    ``hang_factor`` x the ideal step time ago, and at least ``hang_min`` seconds;
    ``straggler_threshold``: a process whose relative or individual score is under it is a
    straggler; ``top``: the outliers are the top ``top`` processes per metric."""

    hang_factor: float = _option(10.0, "K", "hung: no step for K x the ideal step time (default %(default)s)...")
    hang_min: float = _option(60.0, "S", "...and at least S seconds (default %(default)s)")
    straggler_threshold: float = _option(0.75, "R", "a process scoring under R is a straggler (default %(default)s)")
    top: int = _option(5, "N", "outliers: the top N processes per metric (default %(default)s)")


DEFAULTS = ReportSettings()
