"""Warm pools: fresh, never-used sandboxes per profile, and the demand that sizes them.

Knows the sandbox protocol only; creates and destroys nothing itself (the broker does, so every
sandbox is counted against its admission limit in one place). A pool holds sandboxes that no
lease has touched: a released sandbox is destroyed, never put back, so one rollout's files,
processes or damage can never reach the next.

Sizing follows Little's law: the sandboxes that should be ready are the leases expected while
one is being created, ``ceil(lease rate x creation latency)``, clamped to the profile's
``[warm_min, warm_max]``. The rate is counted over the last ``window_s`` seconds; the latency is
a moving average of measured creations.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rollmesh.sandbox.sandbox_protocol import Sandbox

# Weight of the newest creation in the latency average.
_LATENCY_WEIGHT = 0.3


@dataclass
class _Pool:
    ready: deque[Sandbox] = field(default_factory=deque)
    leases: deque[float] = field(default_factory=deque)  # when each recent lease was asked for
    latency_s: float = 0.0
    creating: int = 0


class WarmPool:
    def __init__(self, *, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self._clock = clock
        self._pools: dict[str, _Pool] = {}

    def _pool(self, profile: str) -> _Pool:
        return self._pools.setdefault(profile, _Pool())

    # -- demand ----------------------------------------------------------------------------

    def record_lease(self, profile: str) -> None:
        self._pool(profile).leases.append(self._clock())

    def record_creation(self, profile: str, seconds: float) -> None:
        pool = self._pool(profile)
        seconds = max(0.0, seconds)
        pool.latency_s = seconds if pool.latency_s == 0.0 else (
            _LATENCY_WEIGHT * seconds + (1 - _LATENCY_WEIGHT) * pool.latency_s)

    def lease_rate(self, profile: str) -> float:
        """Leases per second over the window."""
        pool = self._pool(profile)
        horizon = self._clock() - self.window_s
        while pool.leases and pool.leases[0] < horizon:
            pool.leases.popleft()
        return len(pool.leases) / self.window_s

    def target(self, profile: str, *, minimum: int, maximum: int) -> int:
        pool = self._pool(profile)
        wanted = math.ceil(self.lease_rate(profile) * pool.latency_s)
        if pool.leases and wanted == 0:
            wanted = 1  # demand, but no creation measured yet
        return max(minimum, min(maximum, wanted))

    # -- sandboxes -------------------------------------------------------------------------

    def take(self, profile: str) -> tuple[Sandbox | None, list[Sandbox]]:
        """A fresh live sandbox of ``profile`` (None when empty), and the dead ones met on the
        way, for the caller to destroy."""
        ready = self._pool(profile).ready
        dead: list[Sandbox] = []
        while ready:
            sandbox = ready.popleft()
            if sandbox.alive():
                return sandbox, dead
            dead.append(sandbox)
        return None, dead

    def add(self, profile: str, sandbox: Sandbox) -> None:
        self._pool(profile).ready.append(sandbox)

    def surplus(self, profile: str, target: int) -> list[Sandbox]:
        """Remove and return what is above ``target`` (newest last in, first out)."""
        ready = self._pool(profile).ready
        extra = []
        while len(ready) > target:
            extra.append(ready.pop())
        return extra

    def evict_one(self) -> Sandbox | None:
        """Any one warm sandbox, from the fullest pool: room for a lease of another profile."""
        fullest = max(self._pools.values(), key=lambda pool: len(pool.ready), default=None)
        if fullest is None or not fullest.ready:
            return None
        return fullest.ready.pop()

    def dead(self) -> list[Sandbox]:
        """Remove and return every warm sandbox that died while waiting."""
        found: list[Sandbox] = []
        for pool in self._pools.values():
            alive = [sandbox for sandbox in pool.ready if sandbox.alive()]
            found += [sandbox for sandbox in pool.ready if not sandbox.alive()]
            pool.ready = deque(alive)
        return found

    def drain(self) -> list[Sandbox]:
        found = [sandbox for pool in self._pools.values() for sandbox in pool.ready]
        for pool in self._pools.values():
            pool.ready.clear()
        return found

    # -- creation in flight ----------------------------------------------------------------

    def begin_creation(self, profile: str) -> None:
        self._pool(profile).creating += 1

    def end_creation(self, profile: str) -> None:
        self._pool(profile).creating -= 1

    # -- counts ----------------------------------------------------------------------------

    def ready(self, profile: str) -> int:
        return len(self._pool(profile).ready)

    def creating(self, profile: str) -> int:
        return self._pool(profile).creating

    def total(self) -> int:
        """Sandboxes held or being made for the pools."""
        return sum(len(pool.ready) + pool.creating for pool in self._pools.values())

    def profiles(self) -> list[str]:
        return list(self._pools)

    def latency_s(self, profile: str) -> float:
        return self._pool(profile).latency_s
