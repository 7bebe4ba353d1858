"""DashboardFeed: what keeps a ``DashboardState`` live, inside the Serve app's replica.

Knows the bus (a ``BusWatcher``: watching never takes work off a queue or holds an ack), the wire
contract and Ray actor handles (duck-typed ``.method.remote()``); not HTTP. Events arrive as they
are published; what nobody publishes is asked for every ``dashboard.poll_s``: the GPU scheduler's
status (NATS request), the sandbox broker's numbers and the inference workers' weight versions
(their actors). A message that does not decode is dead-lettered by the watcher and counted on the
page; a poll that fails is skipped until the next one. With several
replicas each follows the bus itself, so any replica answers the page.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from rollmesh.bus.task_set import TaskSet
from rollmesh.config import DashboardConfig
from rollmesh.dashboard.state import DashboardState
from rollmesh.dashboard.views import SandboxPoolView
from rollmesh.mesh_address import MeshAddress
from rollmesh.messages import SchedulerStatusRequest, Subject
from rollmesh.messages.subjects import (
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_PROGRESSED,
    ROLLOUT_REQUESTED,
    SCHED_STATUS,
    SCHED_UTILIZATION,
    TRAINER_STEPPED,
    WEIGHTS_ACTIVATED,
    WEIGHTS_PUBLISHED,
)
from rollmesh.moved_names import forward_moved_names

_log = structlog.get_logger("rollmesh.dashboard")

FOLLOWED: tuple[Subject, ...] = (
    ROLLOUT_REQUESTED, ROLLOUT_PROGRESSED, ROLLOUT_COMPLETED, ROLLOUT_FAILED, TRAINER_STEPPED,
    WEIGHTS_ACTIVATED, WEIGHTS_PUBLISHED, SCHED_UTILIZATION,
)
SANDBOX_BROKER = "sandbox-broker"
# One poll's answers must come within this; a busy mesh answers on the next poll instead.
POLL_TIMEOUT_S = 5.0
# The mesh may still be starting when the Serve replica does: its first connect is tried again.
RECONNECT_DELAY_S = 2.0

# Issue 24: one type for where the mesh is; the dashboard's own settings are handed beside it.
__getattr__ = forward_moved_names(__name__, {"DashboardSource": "rollmesh.mesh_address:MeshAddress"})


async def connect_to_mesh(source: MeshAddress, *, name: str,
                          on_unreachable: Callable[[Exception], None] = lambda exc: None) -> Any:
    """Deprecated (removed in the next release): ``source.connect(name, role="dashboard",
    retry_every_s=RECONNECT_DELAY_S, on_unreachable=...)``."""
    warnings.warn("rollmesh.dashboard.feed.connect_to_mesh is deprecated: use MeshAddress.connect "
                  "(rollmesh.mesh_address) with retry_every_s", DeprecationWarning, stacklevel=2)
    return await source.connect(name, role="dashboard", retry_every_s=RECONNECT_DELAY_S,
                                on_unreachable=on_unreachable)


@dataclass(frozen=True)
class WorkerHandle:
    """An inference worker whose weight versions the feed asks for."""

    name: str
    role: str
    actor: Any


class DashboardFeed:
    def __init__(self, mesh: MeshAddress, state: DashboardState, *, config: DashboardConfig = DashboardConfig(),
                 workers: Sequence[WorkerHandle] = (),
                 find_actor: Callable[[str, str], Any] | None = None) -> None:
        # The mesh the Serve app's replica follows, as the watch-only "dashboard" role (it may
        # watch its subjects, decode loans among them, and ask the scheduler's status).
        self.mesh = mesh
        self.config = config
        self.state = state
        self.workers = list(workers)
        # (name, ray namespace) -> actor handle; raises when there is none (ray.get_actor).
        self.find_actor = find_actor
        self._tasks = TaskSet("dashboard")
        self._nc: Any = None
        self._watcher: Any = None  # a BusWatcher once connected

    def start(self) -> None:
        """Follow the bus and poll, in tasks of this feed (call from a running event loop)."""
        self._tasks.spawn(self._run(), name="feed")

    async def close(self) -> None:
        await self._tasks.close()
        if self._watcher is not None:
            await self._watcher.close()
        if self._nc is not None:
            await self._nc.close()

    async def _run(self) -> None:
        from rollmesh.bus.watcher import BusWatcher

        def unreachable(exc: Exception) -> None:
            self.state.feed = f"error: {exc}"  # the page shows why it has no data

        self._nc = await self.mesh.connect("rollmesh-dashboard", role="dashboard", retry_every_s=RECONNECT_DELAY_S,
                                           on_unreachable=unreachable)
        self._watcher = BusWatcher(self._nc, self.mesh.namespace, name="rollmesh-dashboard",
                                   on_dead_lettered=self.state.record_malformed)
        for subject in FOLLOWED:
            await self._watcher.watch(subject, self.state.record)
        self.state.feed = "connected"
        while True:
            await asyncio.gather(self._poll_scheduler(), self._poll_sandbox_pool(),
                                 self._poll_weights())
            await asyncio.sleep(self.config.poll_s)

    async def _poll_scheduler(self) -> None:
        try:
            reply = await self._nc.request(
                SCHED_STATUS.format(self.mesh.namespace),
                SCHED_STATUS.encode(SchedulerStatusRequest()), timeout=POLL_TIMEOUT_S)
            self.state.record(SCHED_STATUS.decode_reply(reply.data))
        except Exception as exc:  # no scheduler (rollmesh serve), a timeout, a bad reply
            _log.debug("dashboard_poll_failed", source="scheduler", error=repr(exc))

    async def _poll_sandbox_pool(self) -> None:
        if self.find_actor is None:
            return
        try:
            broker = self.find_actor(SANDBOX_BROKER, self.mesh.ray_namespace)
            stats = await asyncio.wait_for(broker.stats.remote(), timeout=POLL_TIMEOUT_S)
            self.state.record_sandbox_pool(msgspec.convert(stats.get("logic", {}), SandboxPoolView,
                                                           strict=False))
        except Exception as exc:  # no broker (rollmesh serve), one restarting, a timeout
            _log.debug("dashboard_poll_failed", source="sandbox_broker", error=repr(exc))

    async def _poll_weights(self) -> None:
        for worker in self.workers:
            try:
                answer = await asyncio.wait_for(worker.actor.weight_versions.remote(),
                                                timeout=POLL_TIMEOUT_S)
                self.state.record_worker_version(worker.name, worker.role, answer["current"],
                                                 answer.get("staged"))
            except Exception as exc:  # a worker restarting: its row keeps its last version
                _log.debug("dashboard_poll_failed", source=worker.name, error=repr(exc))
