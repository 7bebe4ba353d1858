"""ActorShell: the one generic shell around a plain logic class (connect, subscribe, serve, stop).

Knows the bus (NATS), telemetry setup and the ports a logic class implements; knows no role and
does not import ray (a role module wraps a shell in a Ray actor at spawn time). Use::

    mesh = MeshAddress(nats_url=url, namespace=ns, run_dir=run_dir, telemetry=tc)
    shell = ActorShell("rollout-worker-0", mesh)
    publisher = await shell.connect()        # logging, tracing, NATS, JetStream streams
    await shell.serve(RolloutLogic(cfg, publisher=publisher))   # logic.start(), then subscribe
    ...
    await shell.stop()   # stop intake, let handlers finish, logic.stop(), close, flush spans

``start()`` does both steps when the logic was given to the constructor (logic that needs no
publisher). Messages are only delivered after ``logic.start()`` returned, so a handler never runs
against half-started logic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext

from rollmesh.bus.connection import flush_to_server
from rollmesh.bus.consumers import Consumer, open_consumer
from rollmesh.bus.dispatcher import MessageDispatcher
from rollmesh.bus.mesh_stores import MeshStores
from rollmesh.ports import ActorLogic
from rollmesh.bus.publisher import BusPublisher
from rollmesh.bus.streams import StreamLimits, ensure_streams
from rollmesh.bus.task_set import TaskSet
from rollmesh.mesh_address import MeshAddress
from rollmesh.messages.metrics import MetricsReported
from rollmesh.messages.subjects import METRICS_REPORTED
from rollmesh.telemetry.conventions import component_of
from rollmesh.telemetry.logging import setup_logging
from rollmesh.telemetry.metrics import setup_metrics
from rollmesh.telemetry.metrics_reporter import MetricsReporter
from rollmesh.telemetry.tracing import flush_tracing, setup_tracing

_log = structlog.get_logger("rollmesh.actors.shell")


class ActorShell:
    def __init__(self, actor_name: str, mesh: MeshAddress, logic: ActorLogic | None = None, *,
                 drain_timeout_s: float = 10.0, component: str | None = None) -> None:
        self.actor_name = actor_name
        # The service this actor reports as ("decode" -> service.name "rollmesh.decode"), and the
        # role it connects as; without one the actor's name stands in.
        self.component = component or actor_name
        # Its telemetry and NATS settings come with it; with credentials the actor connects as
        # its role, which may not create streams: the launcher's "mesh" user made them before
        # any actor started.
        self.mesh = mesh
        self.namespace = mesh.namespace
        self.run_dir = Path(mesh.run_dir)
        self.telemetry_config = mesh.telemetry
        self.nats_config = mesh.nats
        self.drain_timeout_s = drain_timeout_s
        self._logic = logic
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._publisher: BusPublisher | None = None
        self._tasks = TaskSet(actor_name)
        self._consumers: list[Consumer] = []
        self._serving = False
        self._stopped = False
        self._metrics: MetricsReporter | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def connect(self) -> BusPublisher:
        """Set up logging and tracing, connect to NATS, ensure the streams; returns the publisher."""
        if self._publisher is not None:
            return self._publisher
        setup_logging(self.actor_name, self.telemetry_config.log_level)
        setup_tracing(self.component, self.telemetry_config, self.run_dir, instance=self.actor_name)
        nc = await self.mesh.connect(self.actor_name, role=self.component)
        js = nc.jetstream()
        try:
            if not self.mesh.secured:
                await ensure_streams(js, self.namespace,
                                     StreamLimits(replicas=self.nats_config.replicas))
        except Exception:
            await nc.close()
            raise
        self._nc, self._js = nc, js
        self._publisher = BusPublisher(nc, js, self.namespace)
        # This process's metric snapshot goes to the hub in `rollmesh up` (docs/metrics.md).
        setup_metrics(component_of(self.component), actor=self.actor_name)
        self._metrics = MetricsReporter(self._send_metrics, interval_s=self.telemetry_config.metrics_report_s)
        self._metrics.start()
        self._log.info("shell_connected")
        return self._publisher

    async def serve(self, logic: ActorLogic) -> None:
        """Start ``logic``, then open every subscription it declares."""
        if self._publisher is None or self._nc is None or self._js is None:
            raise RuntimeError(f"{self.actor_name}: call connect() before serve()")
        if self._serving:
            raise RuntimeError(f"{self.actor_name}: already serving")
        subscriptions = logic.subscriptions()
        templates = [s.subject.template for s in subscriptions]
        if len(set(templates)) != len(templates):
            raise ValueError(f"{self.actor_name}: one subscription per subject, got {templates}")
        self._logic = logic
        self._serving = True
        start = getattr(logic, "start", None)
        if start is not None:
            await start()
        for subscription in subscriptions:
            dispatcher = MessageDispatcher(
                actor_name=self.actor_name, subscription=subscription,
                publisher=self._publisher, max_deliver=self.nats_config.max_deliver,
                ack_wait_s=self.nats_config.rollout_ack_wait_s,
            )
            self._consumers.append(await open_consumer(
                self._nc, self._js, self.namespace, dispatcher, self._tasks))
        # Every SUB is active at the server before serve() returns.
        await flush_to_server(self._nc)
        self._log.info("shell_serving", subjects=templates)

    async def start(self) -> None:
        """``connect()`` then ``serve()`` the logic given to the constructor."""
        if self._logic is None:
            raise RuntimeError(f"{self.actor_name}: no logic; use connect() then serve(logic)")
        await self.connect()
        await self.serve(self._logic)

    async def stop(self) -> None:
        """Stop intake, give handlers ``drain_timeout_s``, stop the logic, close, flush spans.

        JetStream messages whose handlers are cancelled here are nak'ed, so another replica
        takes them at once. Idempotent.
        """
        if self._stopped:
            return
        self._stopped = True
        for consumer in self._consumers:
            await consumer.unsubscribe()
        if not await self._tasks.wait(self.drain_timeout_s):
            self._log.warning("handlers_cancelled_at_stop", running=len(self._tasks))
        await self._tasks.close()
        stop = getattr(self._logic, "stop", None) if self._serving else None
        if stop is not None:
            try:
                await stop()
            except Exception as exc:
                self._log.error("logic_stop_failed", error=repr(exc), exc_info=exc)
        self._serving = False
        if self._metrics is not None:
            await self._metrics.stop()  # the last snapshot, while the connection is still open
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()
        flush_tracing()
        self._log.info("shell_stopped", stats=self.stats()["subjects"])

    async def _send_metrics(self, report: MetricsReported) -> None:
        # Core NATS, not the publisher: a span per snapshot would drown the traces.
        await self.nats_client.publish(METRICS_REPORTED.format(self.namespace), METRICS_REPORTED.encode(report))

    # -- state -----------------------------------------------------------------------------

    @property
    def _log(self) -> Any:
        # Bound per use, not once in __init__: a logger bound before setup_logging() ran would
        # keep structlog's default configuration.
        return _log.bind(actor=self.actor_name, namespace=self.namespace)

    @property
    def publisher(self) -> BusPublisher:
        if self._publisher is None:
            raise RuntimeError(f"{self.actor_name}: not connected; call connect() first")
        return self._publisher

    @property
    def stores(self) -> MeshStores:
        """The namespace's JetStream stores, on this shell's connection."""
        if self._js is None:
            raise RuntimeError(f"{self.actor_name}: not connected; call connect() first")
        return MeshStores(self._js, self.namespace, replicas=self.nats_config.replicas)

    @property
    def nats_client(self) -> Client:
        if self._nc is None:
            raise RuntimeError(f"{self.actor_name}: not connected")
        return self._nc

    def stats(self) -> dict[str, Any]:
        """Per subject template: received, handled, failed, dead_lettered; plus the logic's own."""
        result: dict[str, Any] = {
            "actor": self.actor_name,
            "subjects": {c.dispatcher.subscription.subject.template: c.dispatcher.counters.as_dict()
                         for c in self._consumers},
        }
        logic_stats = getattr(self._logic, "stats", None)
        if logic_stats is not None:
            result["logic"] = logic_stats()
        return result
