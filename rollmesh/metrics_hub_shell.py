"""The metrics hub's shell: feeds ``MetricsHubLogic`` from NATS, in the ``rollmesh up`` process.

Knows nats-py, the streams layout and the hub's logic; not Ray (it is no actor, hence not in
``actors/``: the launcher runs it in its own process, so the URL it serves is known when
``mesh.json`` is written). Not an
``ActorShell`` either: that would install tracing and logging for the whole launcher process, and
the hub needs only one watched subject (a ``BusWatcher``: an undecodable snapshot is counted,
logged and dead-lettered there) and a timer. Every ``metrics_report_s`` the timer reads the
rollout work queue's depth from JetStream and lets the hub write TensorBoard scalars when due.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats.errors
import structlog
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from rollmesh.bus.streams import rollout_requests_stream
from rollmesh.bus.watcher import BusWatcher
from rollmesh.mesh_address import MeshAddress
from rollmesh.messages.subjects import METRICS_REPORTED
from rollmesh.telemetry.metrics_hub import MetricsHubLogic

_log = structlog.get_logger("rollmesh.metrics_hub")
HUB_NAME = "metrics-hub"
# The rollout workers' durable consumer (``Subscription.durable_name`` of rl.{ns}.rollout.requested):
# its undelivered messages are the queue.
ROLLOUT_WORKERS_DURABLE = "rollout_requested"


class MetricsHubShell:
    def __init__(self, mesh: MeshAddress) -> None:
        # Connects as the "mesh" user when the bus is secured; writes into the mesh's run dir.
        self.mesh = mesh
        self.namespace = mesh.namespace
        self.hub = MetricsHubLogic(mesh.telemetry, Path(mesh.run_dir))
        self.interval_s = mesh.telemetry.metrics_report_s
        self._nc: Client | None = None
        self._watcher: BusWatcher | None = None
        self._timer: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Connect, subscribe, serve ``/metrics``; returns its URL."""
        url = self.hub.start()
        try:
            nc = await self.mesh.connect(HUB_NAME, role="mesh")
            self._nc = nc
            self._watcher = BusWatcher(nc, self.namespace, name=HUB_NAME)
            await self._watcher.watch(METRICS_REPORTED, self.hub.receive)
        except BaseException:
            await self.stop()
            raise
        self._timer = asyncio.get_running_loop().create_task(self._every_interval(), name="metrics-hub-timer")
        _log.info("metrics_serving", url=url, tensorboard=str(self.hub.run_dir / "tensorboard"))
        return url

    async def stop(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            await asyncio.gather(timer, return_exceptions=True)
        if self._watcher is not None:
            # Drained: the last snapshots actors sent while stopping are still taken in.
            await self._watcher.close()
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()
        self._nc = None
        self.hub.close()

    async def _every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._read_queue_depth()
            # The write (a few hundred scalars, flushed) is file I/O: off the event loop.
            await asyncio.to_thread(self.hub.tick)

    async def _read_queue_depth(self) -> None:
        if self._nc is None:
            return
        js = self._nc.jetstream()
        stream = rollout_requests_stream(self.namespace)
        try:
            try:
                info = await js.consumer_info(stream, ROLLOUT_WORKERS_DURABLE, timeout=2.0)
                depth = info.num_pending or 0
            except NotFoundError:  # no rollout worker consumed yet: the whole stream waits
                depth = (await js.stream_info(stream)).state.messages
        except (nats.errors.Error, TimeoutError) as exc:
            _log.debug("queue_depth_unread", error=repr(exc))
            return
        self.hub.set_queue_depth("rollout_requests", depth)
