"""Accelerators free for simulation jobs over future time: the profile EASY backfill plans against.

Plain arithmetic on a step function. It is built fresh for every scheduling pass from what the
core expects: running jobs release at their expected ends, preempted ones at their deadlines, RL
roles claim what they announced at the announced times. Values may go negative: that is a deficit
the core must preempt for.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable


class Availability:
    def __init__(self, now: float, free_now: int, changes: Iterable[tuple[float, int]]) -> None:
        # Segment i holds values[i] over [times[i], times[i + 1]); the last one runs forever.
        self.times = [now]
        self.values = [free_now]
        for at, delta in sorted((max(at, now), delta) for at, delta in changes if at < math.inf):
            if at == self.times[-1]:
                self.values[-1] += delta
            else:
                self.times.append(at)
                self.values.append(self.values[-1] + delta)

    def at(self, t: float) -> int:
        return self.values[max(0, bisect.bisect_right(self.times, t) - 1)]

    def min_over(self, start: float, end: float) -> int:
        first = max(0, bisect.bisect_right(self.times, start) - 1)
        last = bisect.bisect_left(self.times, end)
        return min(self.values[first:max(last, first + 1)])

    def first_short(self, start: float, end: float, needed: int) -> float | None:
        """The first time in [start, end) with fewer than ``needed`` free, or None."""
        first = max(0, bisect.bisect_right(self.times, start) - 1)
        for i in range(first, len(self.times)):
            if self.times[i] >= end:
                break
            if self.values[i] < needed:
                return max(self.times[i], start)
        return None

    def earliest_window(self, needed: int, duration: float) -> float:
        """The first breakpoint from which ``needed`` stay free for ``duration`` (inf if never)."""
        for t in self.times:
            if self.min_over(t, t + duration) >= needed:
                return t
        return math.inf

    def shift(self, start: float, end: float, delta: int) -> None:
        """Add ``delta`` over [start, end): a job placed (negative) or released early (positive)."""
        for t in (start, end):
            if t < math.inf and t > self.times[0]:
                i = bisect.bisect_left(self.times, t)
                if i == len(self.times) or self.times[i] != t:
                    self.times.insert(i, t)
                    self.values.insert(i, self.values[i - 1])
        for i, t in enumerate(self.times):
            if start <= t < end:
                self.values[i] += delta
