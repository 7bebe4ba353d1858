"""DecodeLoanFollower: the Serve app's router uses the decode workers the GPU scheduler lends idle
accelerators to (elastic decode), as the rollout workers' routers do.

Knows nats-py (core subscriptions only: it watches ``GpuGranted`` / ``GpuReleased`` and asks the
scheduler's status, as the replica's watch-only "dashboard" user may) and ``DecodeLoanRoster``;
not HTTP. A release is announced before the scheduler stops the worker (``elastic_drain_s``
later), so the router stops sending to it first. Every ``poll_s`` the scheduler's status
reconciles the roster: loans made before the replica started, or while its connection was down,
are picked up, and loans taken back meanwhile are dropped. With no scheduler (``rollmesh serve``)
the status is never answered and nothing is lent.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import structlog

from rollmesh.actors.decode_loans import DecodeLoanRoster
from rollmesh.bus.task_set import TaskSet
from rollmesh.dashboard.feed import POLL_TIMEOUT_S, DashboardSource, connect_to_mesh
from rollmesh.messages import SchedulerStatusRequest
from rollmesh.messages.subjects import GPU_GRANTED, GPU_RELEASED, SCHED_STATUS

_log = structlog.get_logger("rollmesh.serve")


class DecodeLoanFollower:
    def __init__(self, source: DashboardSource, roster: DecodeLoanRoster, *, poll_s: float) -> None:
        self.source = source
        self.roster = roster
        self.poll_s = poll_s
        self._tasks = TaskSet("decode-loans")
        self._nc: Any = None

    def start(self) -> None:
        """Follow the loans in a task of this follower (call from a running event loop)."""
        self._tasks.spawn(self._run(), name="follow")

    async def close(self) -> None:
        await self._tasks.close()
        if self._nc is not None:
            await self._nc.close()

    async def _run(self) -> None:
        self._nc = await connect_to_mesh(self.source, name="rollmesh-serve-loans")
        namespace = self.source.namespace
        await self._nc.subscribe(GPU_GRANTED.format(namespace), cb=self._on_granted)
        await self._nc.subscribe(GPU_RELEASED.format(namespace), cb=self._on_released)
        while True:
            await self._reconcile()
            await asyncio.sleep(self.poll_s)

    async def _on_granted(self, msg: Any) -> None:
        try:
            await self.roster.granted(GPU_GRANTED.decode(msg.data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            _log.warning("decode_loan_event_malformed", subject=GPU_GRANTED.template, error=str(exc))

    async def _on_released(self, msg: Any) -> None:
        try:
            self.roster.released(GPU_RELEASED.decode(msg.data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            _log.warning("decode_loan_event_malformed", subject=GPU_RELEASED.template, error=str(exc))

    async def _reconcile(self) -> None:
        try:
            reply = await self._nc.request(SCHED_STATUS.format(self.source.namespace),
                                           SCHED_STATUS.encode(SchedulerStatusRequest()), timeout=POLL_TIMEOUT_S)
            status = SCHED_STATUS.decode_reply(reply.data)
        except Exception as exc:  # no scheduler (rollmesh serve), a timeout, a bad reply
            _log.debug("decode_loan_status_failed", error=repr(exc))
            return
        await self.roster.reconcile(status.elastic_workers)
