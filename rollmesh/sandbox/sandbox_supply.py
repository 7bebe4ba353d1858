"""Where the broker's sandboxes come from and go: warm pools, creation slots, admission room.

The broker (``broker.py``) decides who holds a sandbox; this class makes, hands out and destroys
them, and counts every one against ``max_sandboxes`` in one place: leased ones (read from the
broker's lease table through ``leased``), those reserved for grants under way, and warm ones,
ready or being created. Warm sandboxes give way to leases (a lease of one profile may evict
another profile's warm sandbox). Creations wait for one of ``max_concurrent_creates`` slots.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

import structlog

from rollmesh.config import SandboxConfig
from rollmesh.sandbox.errors import LeaseAbandonedError
from rollmesh.sandbox.lease_terms import LeaseTerms, profile_limits
from rollmesh.sandbox.sandbox_protocol import Sandbox, SandboxBackend, SandboxLimits
from rollmesh.sandbox.warm_pool import WarmPool

log = structlog.get_logger(__name__)


def _always_wanted() -> None:
    return None


class SandboxSupply:
    """``leased`` returns how many sandboxes leases hold now; ``counts`` is the broker's."""

    def __init__(
        self,
        config: SandboxConfig,
        backend: SandboxBackend,
        *,
        leased: Callable[[], int],
        counts: Counter[str],
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str],
    ) -> None:
        self.config = config
        self.backend = backend
        self.pool = WarmPool(window_s=config.demand_window_s, clock=clock)
        self.reserved = 0  # sandboxes being obtained for grants under way
        self.closed = False
        self._leased = leased
        self._counts = counts
        self._clock = clock
        self._new_id = new_id
        self._creates = asyncio.Semaphore(config.max_concurrent_creates)
        self._pools_wanted = asyncio.Event()

    def live(self) -> int:
        """Leased, reserved for a grant, and warm (ready or being created)."""
        return self._leased() + self.reserved + self.pool.total()

    async def obtain(self, terms: LeaseTerms, still_wanted: Callable[[], None]) -> tuple[Sandbox, bool]:
        """A sandbox for one lease of ``terms``, and whether it came warm. ``still_wanted``
        raises (``LeaseAbandonedError``) once nobody waits for it: asked before a warm sandbox
        is taken, and before and after a creation."""
        still_wanted()
        if terms.warmable:
            sandbox, dead = self.pool.take(terms.profile)
            for corpse in dead:
                await self.destroy(corpse, "died while warm")
            if sandbox is not None:
                self._pools_wanted.set()
                return sandbox, True
        while self.live() > self.config.max_sandboxes:
            evicted = self.pool.evict_one()
            if evicted is None:
                break
            await self.destroy(evicted, "room for a lease")
        return await self._create(terms.profile, terms.limits, network=terms.network,
                                  still_wanted=still_wanted), False

    async def destroy(self, sandbox: Sandbox, why: str) -> None:
        try:
            await sandbox.destroy()
        except Exception as exc:  # noqa: BLE001 - a failed destroy must not fail the request
            log.warning("sandbox destroy failed", sandbox_id=sandbox.info.sandbox_id, why=why, error=repr(exc))
        self._counts["sandboxes_destroyed"] += 1

    async def resize_pools(self) -> None:
        """Bring each profile's warm pool to its demand-sized target."""
        for sandbox in self.pool.dead():
            await self.destroy(sandbox, "died while warm")
        for name in self.config.profile_names():
            profile = self.config.profile(name)
            assert profile is not None
            target = self.pool.target(name, minimum=profile.warm_min, maximum=profile.warm_max)
            for sandbox in self.pool.surplus(name, target):
                await self.destroy(sandbox, "warm pool shrank")
            while (not self.closed and self.pool.ready(name) + self.pool.creating(name) < target
                   and self.live() < self.config.max_sandboxes):
                if not await self._create_warm(name, profile_limits(profile)):
                    break  # the runtime failed: try again next round, not in a tight loop

    async def pools_forever(self) -> None:
        """Resize the pools every ``pool_interval_s``, or sooner once a lease took a warm one."""
        while True:
            try:
                await self.resize_pools()
            except Exception as exc:  # noqa: BLE001 - a failed round must not stop the timer
                log.error("sandbox warm pool resize failed", error=repr(exc))
            self._pools_wanted.clear()
            try:
                await asyncio.wait_for(self._pools_wanted.wait(), self.config.pool_interval_s)
            except TimeoutError:
                pass

    async def close(self) -> None:
        """Make no more warm sandboxes and destroy those there are (the broker is stopping)."""
        self.closed = True
        for sandbox in self.pool.drain():
            await self.destroy(sandbox, "broker stopped")

    async def _create_warm(self, profile: str, limits: SandboxLimits) -> bool:
        self.pool.begin_creation(profile)
        try:
            sandbox = await self._create(profile, limits, network=False)
        except Exception as exc:  # noqa: BLE001
            log.warning("sandbox warm creation failed", profile=profile, error=repr(exc))
            self._counts["create_failures"] += 1
            return False
        finally:
            self.pool.end_creation(profile)
        if self.closed or self.live() >= self.config.max_sandboxes:
            await self.destroy(sandbox, "no room left for it")  # leases took the room meanwhile
            return False
        self.pool.add(profile, sandbox)
        return True

    async def _create(self, profile: str, limits: SandboxLimits, *, network: bool,
                      still_wanted: Callable[[], None] = _always_wanted) -> Sandbox:
        async with self._creates:
            still_wanted()  # the wait for a creation slot is where a lease request queues longest
            started = self._clock()
            sandbox = await self.backend.create(self._new_id(), limits, network=network, profile=profile)
            self.pool.record_creation(profile, self._clock() - started)
        self._counts["sandboxes_created"] += 1
        try:
            still_wanted()
        except LeaseAbandonedError:
            self._counts["sandboxes_ready_too_late"] += 1
            await self.destroy(sandbox, "every request for it gave up waiting")
            raise
        return sandbox
