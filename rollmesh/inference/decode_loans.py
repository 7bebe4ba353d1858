"""The decode workers the GPU scheduler lends idle accelerators to (decode loans), as one router
sees them: a loan's worker joins the router, a loan taken back leaves it.

Knows the router and the loan events of the wire contract; not NATS, and Ray only through the
injected ``find_worker`` (``ray.get_actor`` in the mesh's namespace: a loan's grant id names its
worker). Two routers follow loans: each rollout worker's (its shell delivers the events) and the
Serve app's (``rollmesh.serve_apps.decode_loan_follower``). Both also ``reconcile`` with the
scheduler's status, which lists the loans made before they started or while they were not
listening.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from rollmesh.inference.router import InferenceRouter
from rollmesh.messages import GpuGranted, GpuReleased
from rollmesh.messages.sim_jobs import DECODE_LOAN_HOLDER


class DecodeLoanRoster:
    def __init__(self, router: InferenceRouter, find_worker: Callable[[str], Any]) -> None:
        """``find_worker(name)``: the worker's actor handle; raises ValueError when it is gone."""
        self.router = router
        self.find_worker = find_worker
        self._releases: dict[str, int] = {}  # name -> releases seen, to spot one during a lookup

    async def granted(self, message: GpuGranted) -> None:
        if message.holder == DECODE_LOAN_HOLDER:
            await self.add(message.grant_id)

    def released(self, message: GpuReleased) -> None:
        # Announced before the worker is stopped, so nothing new is sent to it from here on.
        if message.holder == DECODE_LOAN_HOLDER:
            self._releases[message.grant_id] = self._releases.get(message.grant_id, 0) + 1
            self.router.remove_decode_worker(message.grant_id)

    async def add(self, name: str) -> None:
        releases_before = self._releases.get(name, 0)
        try:
            # A named-actor lookup is a blocking call into Ray's GCS: off the event loop.
            worker = await asyncio.to_thread(self.find_worker, name)
        except ValueError:
            return  # already taken back and gone
        if self._releases.get(name, 0) == releases_before:  # not taken back while we looked
            self.router.add_decode_worker(name, worker)

    async def reconcile(self, lent_now: Iterable[str]) -> None:
        """Make the router's lent workers exactly ``lent_now`` (the scheduler's ``decode_loan_workers``)."""
        lent_now = set(lent_now)
        for name in set(self.router.lent_decode_workers()) - lent_now:
            self.router.remove_decode_worker(name)
        for name in sorted(lent_now - set(self.router.lent_decode_workers())):
            await self.add(name)
