"""DecodeLoanFollower: the Serve app's router uses the decode workers the GPU scheduler lends idle
accelerators to (decode loans), as the rollout workers' routers do.

Knows the bus (a ``BusWatcher``: it watches ``GpuGranted`` / ``GpuReleased`` and the scheduler's
status, as the replica's watch-only "dashboard" user may) and ``DecodeLoanRoster``;
not HTTP. A release is announced before the scheduler stops the worker (``decode_loan_drain_s``
later), so the router stops sending to it first. The scheduler's status reconciles the roster:
asked for once at start (loans made before the replica started), then as the scheduler
publishes it every ``scheduler.report_every_s`` (loans granted or taken back while the
connection was down), so following the loans costs no request of its own. With no scheduler
(``rollmesh serve``) nothing is answered or published, and nothing is lent.
"""

from __future__ import annotations

from typing import Any

import structlog

from rollmesh.inference.decode_loans import DecodeLoanRoster
from rollmesh.bus.task_set import TaskSet
from rollmesh.dashboard.feed import POLL_TIMEOUT_S, RECONNECT_DELAY_S
from rollmesh.mesh_address import MeshAddress
from rollmesh.messages import SchedulerStatus, SchedulerStatusRequest
from rollmesh.messages.subjects import GPU_GRANTED, GPU_RELEASED, SCHED_STATUS, SCHED_UTILIZATION

_log = structlog.get_logger("rollmesh.serve")


class DecodeLoanFollower:
    def __init__(self, mesh: MeshAddress, roster: DecodeLoanRoster) -> None:
        self.mesh = mesh  # connected to as the watch-only "dashboard" role
        self.roster = roster
        self._tasks = TaskSet("decode-loans")
        self._nc: Any = None
        self._watcher: Any = None  # a BusWatcher once connected

    def start(self) -> None:
        """Follow the loans in a task of this follower (call from a running event loop)."""
        self._tasks.spawn(self._run(), name="follow")

    async def close(self) -> None:
        await self._tasks.close()
        if self._watcher is not None:
            await self._watcher.close()
        if self._nc is not None:
            await self._nc.close()

    async def _run(self) -> None:
        from rollmesh.bus.watcher import BusWatcher

        self._nc = await self.mesh.connect("rollmesh-serve-loans", role="dashboard", retry_every_s=RECONNECT_DELAY_S)
        self._watcher = BusWatcher(self._nc, self.mesh.namespace, name="rollmesh-serve-loans")
        await self._watcher.watch(GPU_GRANTED, self.roster.granted)
        await self._watcher.watch(GPU_RELEASED, self.roster.released)
        await self._watcher.watch(SCHED_UTILIZATION, self._on_status)
        await self._reconcile_at_start()

    async def _on_status(self, status: SchedulerStatus) -> None:
        await self.roster.reconcile(status.decode_loan_workers)

    async def _reconcile_at_start(self) -> None:
        try:
            reply = await self._nc.request(SCHED_STATUS.format(self.mesh.namespace),
                                           SCHED_STATUS.encode(SchedulerStatusRequest()), timeout=POLL_TIMEOUT_S)
            status = SCHED_STATUS.decode_reply(reply.data)
        except Exception as exc:  # no scheduler (rollmesh serve), a timeout, a bad reply
            _log.debug("decode_loan_status_failed", error=repr(exc))
            return  # its next published status reconciles, if there is a scheduler
        await self.roster.reconcile(status.decode_loan_workers)
