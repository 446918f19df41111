"""How the monitor judges a run, and the defaults, in one place: :func:`hypertron.monitor.report.build`,
:mod:`hypertron.monitor.stragglers` and ``hypertron monitor``'s flags read them."""

from __future__ import annotations

from dataclasses import dataclass

from hypertron.config import flag_field


@dataclass(frozen=True, kw_only=True)
class ReportSettings:
    """The report's thresholds: one field per ``hypertron monitor`` flag (``hang_factor`` is
    ``--hang-factor``), whose default and help are the field's.

    ``hang_factor``, ``hang_min``: a running job is hung when its last step ended more than
    ``hang_factor`` x the ideal step time ago, and at least ``hang_min`` seconds;
    ``straggler_threshold``: a process whose relative or individual score is under it is a
    straggler; ``top``: the outliers are the top ``top`` processes per metric."""

    hang_factor: float = flag_field(10.0, "hung: no step for K x the ideal step time (default %(default)s)...", "K")
    hang_min: float = flag_field(60.0, "...and at least S seconds (default %(default)s)", "S")
    straggler_threshold: float = flag_field(0.75, "a process scoring under R is a straggler (default %(default)s)", "R")
    top: int = flag_field(5, "outliers: the top N processes per metric (default %(default)s)", "N")


DEFAULTS = ReportSettings()
