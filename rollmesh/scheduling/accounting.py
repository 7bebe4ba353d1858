"""Accounting: accelerator-seconds allocated vs busy, and what preemption cost.

Plain arithmetic. Whoever knows the rates (the simulator, or the live scheduler from its grants
and the roles' reports) calls ``set_rates`` whenever one changes; the account integrates the
step function in total and per fixed interval (the samples behind the utilization plot).
Busy is goodput: work thrown away by a preemption was busy when it ran, so ``discard`` takes it
back out of the totals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class UtilizationSample:
    """Mean accelerators over [start, end)."""

    start: float
    end: float
    allocated: float
    busy: float
    rl_held: float


@dataclass(frozen=True)
class UtilizationTotals:
    capacity: int
    window_s: float
    allocated_s: float  # accelerator-seconds held by anyone
    busy_s: float  # accelerator-seconds of useful work (lost work excluded)
    rl_held_s: float
    lost_s: float  # progress thrown away by preemptions and kills
    overhead_s: float  # time preempted jobs spent saving on request and reloading after restart

    @property
    def busy_utilization(self) -> float:
        return self._fraction_of_capacity(self.busy_s)

    @property
    def allocated_utilization(self) -> float:
        return self._fraction_of_capacity(self.allocated_s)

    def _fraction_of_capacity(self, accelerator_s: float) -> float:
        # A scheduler with no accelerators (scheduler.total_gpus = 0, the default) has nothing to
        # utilize: 0, not a ZeroDivisionError that would leave its status requests unanswered.
        available_s = self.capacity * self.window_s
        return accelerator_s / available_s if available_s > 0 else 0.0


class UtilizationAccount:
    def __init__(self, capacity: int, *, start: float = 0.0, interval_s: float = 300.0) -> None:
        self.capacity = capacity
        self.start = start
        self.interval_s = interval_s
        self._last = start
        self._rates = (0.0, 0.0, 0.0)  # allocated, busy, rl_held
        self._totals = [0.0, 0.0, 0.0]
        self._buckets: dict[int, list[float]] = {}
        self.lost_s = 0.0
        self.overhead_s = 0.0

    def set_rates(self, now: float, *, allocated: float, busy: float, rl_held: float) -> None:
        """The rates that hold from ``now`` on (the previous ones are integrated up to ``now``)."""
        self._integrate(now)
        self._rates = (allocated, busy, rl_held)

    def discard(self, accelerator_seconds: float) -> None:
        """Work done earlier was lost (progress since the last checkpoint of a preempted job)."""
        self.lost_s += accelerator_seconds

    def add_overhead(self, accelerator_seconds: float) -> None:
        self.overhead_s += accelerator_seconds

    def totals(self, end: float) -> UtilizationTotals:
        self._integrate(end)
        allocated, busy, rl_held = self._totals
        return UtilizationTotals(capacity=self.capacity, window_s=end - self.start, allocated_s=allocated,
                                 busy_s=busy - self.lost_s, rl_held_s=rl_held, lost_s=self.lost_s,
                                 overhead_s=self.overhead_s)

    def samples(self, end: float) -> list[UtilizationSample]:
        self._integrate(end)
        samples = []
        for index in range(math.ceil((end - self.start) / self.interval_s)):
            lo = self.start + index * self.interval_s
            hi = min(lo + self.interval_s, end)
            sums = self._buckets.get(index, [0.0, 0.0, 0.0])
            width = hi - lo
            samples.append(UtilizationSample(lo, hi, *(value / width for value in sums)))
        return samples

    def _integrate(self, now: float) -> None:
        t = self._last
        while t < now:
            index = int((t - self.start) // self.interval_s)
            step_end = min(now, self.start + (index + 1) * self.interval_s)
            if step_end <= t:  # t sits on a boundary that float division put in the bucket before
                index += 1
                step_end = min(now, self.start + (index + 1) * self.interval_s)
            bucket = self._buckets.setdefault(index, [0.0, 0.0, 0.0])
            for i, rate in enumerate(self._rates):
                bucket[i] += rate * (step_end - t)
                self._totals[i] += rate * (step_end - t)
            t = step_end
        self._last = max(self._last, now)
