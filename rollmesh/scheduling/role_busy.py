"""RoleBusyRates: how busy each RL role's workers are, from the cumulative busy seconds every
worker process reports in its metric snapshot (``rollmesh_role_busy_seconds``, a
``telemetry.busy_clock.BusyClock``).

Plain logic: no NATS, no clock of its own. A process's rate is the increase of its total over the
time between its last two snapshots (their ``reported_at``), bounded to [0, 1]; a role's fraction
is the mean over its processes heard from within ``stale_s``. A role none of whose processes
reported recently has no fraction (None): the scheduler then counts what it holds as busy, since
it cannot tell.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Source:
    role: str
    total_s: float
    reported_at: float
    heard_at: float
    rate: float | None = None


class RoleBusyRates:
    def __init__(self, *, stale_s: float) -> None:
        self.stale_s = stale_s
        self._sources: dict[str, _Source] = {}

    def record(self, source: str, role: str, total_s: float, *, reported_at: float, now: float) -> None:
        """``source`` (one process) reported ``total_s`` busy seconds so far at ``reported_at``."""
        last = self._sources.get(source)
        if last is None or last.role != role:
            self._sources[source] = _Source(role, total_s, reported_at, now)
            return
        if reported_at <= last.reported_at:
            return  # a late or repeated snapshot says nothing new
        rate = (total_s - last.total_s) / (reported_at - last.reported_at)
        self._sources[source] = _Source(role, total_s, reported_at, now, min(max(rate, 0.0), 1.0))

    def fraction(self, role: str, now: float) -> float | None:
        rates = [source.rate for source in self._sources.values()
                 if source.role == role and source.rate is not None and now - source.heard_at <= self.stale_s]
        return sum(rates) / len(rates) if rates else None

    def forget_stale(self, now: float) -> None:
        """Drop processes not heard from in ten staleness periods (stopped or restarted ones)."""
        for name in [name for name, source in self._sources.items() if now - source.heard_at > 10 * self.stale_s]:
            del self._sources[name]
