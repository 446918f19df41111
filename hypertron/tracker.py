"""The tracker interface: where the training loop sends what it measures and what happens.

The loop knows one object, a :class:`Tracking`, and tells it four things: the loop
begins (``begin``), a step's or an evaluation's scalars (``scalars``), a job event
(``emit``, see ``docs/events.md``), and the job's end (``finish``). :class:`Tracking`
stamps each event once and hands the same record to every sink behind it. The console
lines and progress bar, ``metrics.jsonl``, the event files and TensorBoard are such sinks
(:mod:`hypertron.train.metrics`, :mod:`hypertron.train.events`); a new one (a metrics
collector, an experiment tracker) is a :class:`Tracker` passed to ``train(cfg,
trackers=[...])``, and the loop does not change.

A sink overrides what it needs; :class:`Tracker` itself does nothing. Sinks are called
under one lock (checkpoint ends arrive from Orbax's thread), so they need none of their
own, and they should return quickly: the loop waits for them. A sink must not change the
values or records it is given: every sink sees the same objects.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Mapping

from hypertron.runfiles import EVENTS


class Tracker:
    """A sink for what the training loop reports; every method is a no-op here."""

    def begin(self, step: int, total: int) -> None:
        """The loop starts after ``step`` (0, or the restored step) and runs to ``total``."""

    def scalars(self, step: int, values: Mapping[str, Any], group: str = "train") -> None:
        """Values measured at ``step``: ``group`` "train" (a step: loss, step_time, throughput,
        ... as plain floats, or lists of floats) or "eval" (loss, tokens, seconds)."""

    def event(self, record: Mapping[str, Any]) -> None:
        """A job event: ``time``, ``event``, ``process``, ``step`` and its own fields."""

    def finish(self, status: str) -> None:
        """The job ended (completed, preempted, interrupted or failed); release what is held."""


class Tracking:
    """The loop's one tracker: stamps events and fans everything out to its sinks, in order."""

    def __init__(self, trackers: Iterable[Tracker] = (), process_index: int = 0,
                 start_time: float | None = None):
        self.trackers = list(trackers)
        self.process_index = process_index
        self.start_time = time.time() if start_time is None else start_time  # when the job began
        self._lock = threading.Lock()
        self._finished = False

    def seconds(self) -> float:
        """Seconds since the job started."""
        return time.time() - self.start_time

    def begin(self, step: int, total: int) -> None:
        with self._lock:
            for tracker in self.trackers:
                tracker.begin(step, total)

    def scalars(self, step: int, values: Mapping[str, Any], group: str = "train") -> None:
        with self._lock:
            for tracker in self.trackers:
                tracker.scalars(step, values, group)

    def emit(self, event: str, step: int | None = None, *, at: float | None = None,
             **fields: Any) -> dict[str, Any]:
        """Send one event, stamped now (or ``at``, a Unix time), to every sink; returns it.
        After :meth:`finish` nothing is sent."""
        if event not in EVENTS:
            raise ValueError(f"unknown event {event!r}")
        record = {"time": time.time() if at is None else at, "event": event,
                  "process": self.process_index, "step": step, **fields}
        with self._lock:
            if not self._finished:
                for tracker in self.trackers:
                    tracker.event(record)
        return record

    def finish(self, status: str) -> None:
        """Finish every sink, even when one fails; the first failure is raised afterwards."""
        failure = None
        with self._lock:
            if self._finished:
                return
            self._finished = True
            for tracker in self.trackers:
                try:
                    tracker.finish(status)
                except BaseException as e:  # the other sinks still close their files
                    failure = failure or e
        if failure is not None:
            raise failure
