"""BusyClock: how long one worker of an accelerator-holding role (trainer, prefill, decode,
resharder) has spent computing. The GPU scheduler counts that, not the time its accelerators are
merely held, as their busy time (goodput).

Knows the metrics module only. Busy intervals may overlap (an async actor serves calls
concurrently): time counts once while at least one is open. ``report_as`` exports the running
total as the counter ``rollmesh_role_busy_seconds`` (label ``role``) in the process's metric
snapshot, which the hub sums for Prometheus and the scheduler reads off the bus per process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rollmesh.telemetry import metrics, metrics_catalog


class BusyClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._open = 0
        self._opened_at = 0.0
        self._closed_total = 0.0

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Count the time inside the block as busy."""
        if self._open == 0:
            self._opened_at = self.clock()
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
            if self._open == 0:
                self._closed_total += self.clock() - self._opened_at

    def total(self) -> float:
        """Busy seconds so far, the interval still open included."""
        if self._open:
            return self._closed_total + self.clock() - self._opened_at
        return self._closed_total

    def report_as(self, role: str) -> None:
        """Export the total as ``rollmesh_role_busy_seconds{role=...}`` while this clock lives."""
        metrics.observe(metrics_catalog.ROLE_BUSY, self, lambda clock: [(clock.total(), {"role": role})])
