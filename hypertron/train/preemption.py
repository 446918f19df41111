"""Stopping cleanly on SIGTERM: finish the step in flight, save a checkpoint, exit 0.

Schedulers (Kubernetes, Slurm, spot VMs) send SIGTERM some seconds before
they kill a job. The handler only records the signal; the training loop asks
:meth:`StopSignal.reached` after each step and saves there.

With several processes the signal may reach them at different steps, and a
process that stops alone would leave the others waiting in a collective. So
every process must stop at the same step: JAX's coordination service agrees
on it (``multihost_utils.reached_preemption_sync_point``; its preemption
notifier catches SIGTERM in every process).
"""

from __future__ import annotations

import signal
import threading

import jax


class StopSignal:
    """A context that turns SIGTERM into a request to stop at the next step boundary."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = None

    def __enter__(self) -> "StopSignal":
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    def reached(self, step: int) -> bool:
        """True when the job must stop after ``step`` (the same answer on every process)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.signal = signal.SIGTERM
                return True
            return False
        return self.signal is not None
