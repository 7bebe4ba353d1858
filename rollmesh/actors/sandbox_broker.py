"""The sandbox broker actor: serves the broker's request/reply subjects over NATS.

Knows the sandbox package and the shell; no ray import. Tool code runs in sandboxes made by the
backend, never in this actor's process. One task (owned by the service, cancelled at stop) runs
the broker's timers: reaping expired leases and resizing warm pools. At stop every sandbox,
leased or warm, is destroyed.

From start to stop it also serves the bulk data path (``rollmesh.sandbox.bulk_server``): a Unix
socket, and TCP on sandbox.bulk_bind_host with TLS from security.nats_tls when NATS uses TLS.
With security but no TLS certificate to serve, only the Unix socket (clients on other nodes then
move files over NATS).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
from pathlib import Path
from typing import Any

import structlog

from rollmesh.actors.role_base import MeshContext, RoleActor
from rollmesh.bus.tls import server_tls_context
from rollmesh.config import SandboxConfig
from rollmesh.ports import ActorLogic, MessageContext, Publisher, Subscription
from rollmesh.sandbox import SandboxBroker
from rollmesh.sandbox.backends import select_configured_backend
from rollmesh.sandbox.bulk_server import BulkServer
from rollmesh.sandbox.in_process import broker_handlers
from rollmesh.messages.subjects import SANDBOX_EXEC

_log = structlog.get_logger("rollmesh.sandbox_broker")
# Requests handled at once per subject. Exec gets more than the broker admits, so a request past
# max_concurrent_execs is answered "capacity" at once instead of waiting unseen in a queue.
CONCURRENCY = 64


class SandboxBrokerService:
    """Binds each broker operation to its request subject."""

    # The bulk stream's TLS and whether it offers TCP at all (set by the actor, from security).
    bulk_tls: ssl.SSLContext | None = None
    bulk_tcp: bool = True
    _bulk: BulkServer | None = None

    def __init__(self, broker: SandboxBroker) -> None:
        self.broker = broker
        self._timers: asyncio.Task[None] | None = None

    def subscriptions(self) -> list[Subscription]:
        exec_slots = self.broker.config.max_concurrent_execs + CONCURRENCY
        return [
            Subscription(subject, _handler(method), "request",
                         max_concurrent=exec_slots if subject is SANDBOX_EXEC else CONCURRENCY)
            for subject, method in broker_handlers(self.broker).items()
        ]

    async def start(self) -> None:
        self._timers = asyncio.create_task(self.broker.run_timers(), name="sandbox-broker-timers")
        self._bulk = await self.broker.serve_bulk(tls=self.bulk_tls, tcp=self.bulk_tcp)

    async def stop(self) -> None:
        if self._timers is not None:
            self._timers.cancel()
            await asyncio.gather(self._timers, return_exceptions=True)
        if self._bulk is not None:
            await self._bulk.close()
        await self.broker.close()

    def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.broker.stats())


def _handler(method: Any) -> Any:
    async def handle(request: Any, ctx: MessageContext) -> Any:
        return await method(request)

    handle.__name__ = f"handle_{method.__name__}"
    return handle


class SandboxBrokerActor(RoleActor):
    role = "sandbox_broker"

    def __init__(self, name: str, mesh: MeshContext, config: SandboxConfig) -> None:
        super().__init__(name, mesh)
        self.config = config

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        run_dir = Path(self.mesh.run_dir)
        # Profile images are made ready (unpacked, environments built) and the backend chosen
        # (its self-test is a sandbox start) before any lease: off the event loop.
        backend = await asyncio.to_thread(select_configured_backend, self.config, run_dir=run_dir)
        _log.info("sandbox_backend", backend=backend.name, isolated=backend.isolated)
        broker = SandboxBroker(self.config, backend, snapshot_dir=run_dir / "sandbox-snapshots",
                               publisher=publisher)
        service = SandboxBrokerService(broker)
        service.bulk_tls = server_tls_context(self.mesh.nats_tls)
        # Under security, bulk bytes never cross a network in plaintext.
        service.bulk_tcp = service.bulk_tls is not None or not (self.mesh.credentials or self.mesh.nats_tls.enabled)
        return service
