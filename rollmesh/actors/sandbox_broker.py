"""The sandbox broker actor: serves lease / exec / release requests over NATS request/reply.

Knows the sandbox package and the shell; no ray import. Tool code runs in sandbox subprocesses
spawned by the backend, never in this actor's process. A reaper task frees expired leases.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import structlog

from rollmesh.actors.role_base import MeshContext, RoleActor
from rollmesh.ports import ActorLogic, MessageContext, Publisher, Subscription
from rollmesh.config import SandboxConfig
from rollmesh.messages import SandboxExecRequest, SandboxLeaseRequest, SandboxReleaseRequest
from rollmesh.messages.subjects import SANDBOX_EXEC, SANDBOX_LEASE, SANDBOX_RELEASE
from rollmesh.sandbox import SandboxBroker, select_backend

_log = structlog.get_logger("rollmesh.sandbox_broker")
REAP_EVERY_S = 5.0
# Requests handled at once per subject; each exec mostly waits on its sandbox subprocess.
CONCURRENCY = 64


class SandboxBrokerService:
    """Binds the broker's three operations to their request subjects."""

    def __init__(self, broker: SandboxBroker) -> None:
        self.broker = broker
        self._reaper: asyncio.Task[None] | None = None

    def subscriptions(self) -> list[Subscription]:
        return [
            Subscription(SANDBOX_LEASE, self.handle_lease, "request", max_concurrent=CONCURRENCY),
            Subscription(SANDBOX_EXEC, self.handle_exec, "request", max_concurrent=CONCURRENCY),
            Subscription(SANDBOX_RELEASE, self.handle_release, "request", max_concurrent=CONCURRENCY),
        ]

    async def handle_lease(self, request: SandboxLeaseRequest, ctx: MessageContext):
        return await self.broker.lease(request)

    async def handle_exec(self, request: SandboxExecRequest, ctx: MessageContext):
        return await self.broker.exec(request)

    async def handle_release(self, request: SandboxReleaseRequest, ctx: MessageContext):
        return await self.broker.release(request)

    async def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_forever(), name="sandbox-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)

    def stats(self) -> dict[str, Any]:
        stats = self.broker.stats()
        return {name: getattr(stats, name) for name in stats.__dataclass_fields__}

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_EVERY_S)
            reaped = await self.broker.reap_expired()
            if reaped:
                _log.info("sandbox_leases_reaped", count=reaped)


class SandboxBrokerActor(RoleActor):
    role = "sandbox_broker"

    def __init__(self, name: str, mesh: MeshContext, config: SandboxConfig) -> None:
        super().__init__(name, mesh)
        self.config = config

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        backend = select_backend(self.config.backend, readonly_paths=self.config.readonly_paths)
        root = Path(self.mesh.run_dir) / "sandboxes"
        root.mkdir(parents=True, exist_ok=True)
        _log.info("sandbox_backend", backend=backend.name, isolated=backend.isolated)
        return SandboxBrokerService(SandboxBroker(self.config, backend, root_dir=root))
