"""The sandbox broker actor: the shell around ``rollmesh.sandbox.broker_logic.SandboxBrokerLogic``.

Knows the sandbox package, the bus (the KV lease journal, the snapshot object store, TLS) and the
shell; no ray import. Tool code runs in sandboxes made by the backend, never in this actor's
process. At stop every sandbox, leased or warm, is destroyed. With ``sandbox.supervisor`` the
node's supervisor holds them and the leases are journaled in KV, so a broker that crashed (no
stop) leaves both to its restarted self, which re-adopts them before it serves
(``rollmesh.sandbox.lease_store``).

A broker with an id (the launcher gives each one, ``sandbox.brokers``) makes ids that name it and
keeps its snapshots apart; the logic places leases among the brokers. Without an id it serves the
shared subjects alone, as a single broker always did.

From start to stop it also serves the bulk data path (``rollmesh.sandbox.bulk_server``): a Unix
socket, and TCP on sandbox.bulk_bind_host with TLS from security.nats_tls when NATS uses TLS.
With security but no TLS certificate to serve, only the Unix socket (clients on other nodes then
move files over NATS).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import structlog

from rollmesh.actors.role_base import RoleActor
from rollmesh.bus.tls import server_tls_context
from rollmesh.config import SandboxConfig
from rollmesh.mesh_address import MeshAddress
from rollmesh.moved_names import forward_moved_names
from rollmesh.ports import ActorLogic, Publisher
from rollmesh.sandbox import SandboxBroker
from rollmesh.sandbox.backends import select_configured_backend
from rollmesh.sandbox.broker_logic import SandboxBrokerLogic
from rollmesh.sandbox.lease_store import LeaseJournal, readopt
from rollmesh.sandbox.placement import broker_ids
from rollmesh.sandbox.supervisor_client import SupervisorClient

_log = structlog.get_logger("rollmesh.sandbox_broker")

# Deprecated: the service moved into the sandbox package as the role's logic.
__getattr__ = forward_moved_names(__name__, {
    "SandboxBrokerService": "rollmesh.sandbox.broker_logic:SandboxBrokerLogic",
    "CONCURRENCY": "rollmesh.sandbox.broker_logic",
})


class SandboxBrokerActor(RoleActor):
    role = "sandbox_broker"
    logic_class = SandboxBrokerLogic

    def __init__(self, name: str, mesh: MeshAddress, config: SandboxConfig, broker_id: str = "",
                 node: str = "") -> None:
        super().__init__(name, mesh)
        self.config = config
        self.broker_id = broker_id
        self.node = node

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        run_dir = Path(self.mesh.run_dir)
        # Profile images are made ready (unpacked, environments built) and the backend chosen
        # (its self-test is a sandbox start) before any lease: off the event loop.
        backend = await asyncio.to_thread(select_configured_backend, self.config, run_dir=run_dir)
        _log.info("sandbox_backend", backend=backend.name, isolated=backend.isolated, broker=self.broker_id)
        # Each broker empties its snapshot directory at start: brokers sharing a run directory
        # (one host, or a shared file system) each get their own.
        snapshots = run_dir / "sandbox-snapshots"
        new_id = lambda: uuid.uuid4().hex  # noqa: E731
        if self.broker_id:
            snapshots, new_id = snapshots / self.broker_id, broker_ids(new_id, self.broker_id)
        supervisor, journal = await self._supervision(backend)
        # Snapshots also go to the namespace's object store, so one outlives this broker and its
        # node: a rollout whose broker was lost forks its last snapshot on another broker.
        shared_snapshots = self.shell.stores.sandbox_snapshots(ttl_s=self.config.snapshot_ttl_s)
        broker = SandboxBroker(self.config, backend, snapshot_dir=snapshots, publisher=publisher, new_id=new_id,
                               journal=journal, shared_snapshots=shared_snapshots)
        if supervisor is not None and journal is not None:  # before serving: a request may name them
            await readopt(broker, supervisor, journal)
        logic = SandboxBrokerLogic(broker, broker_id=self.broker_id, publisher=publisher, node=self.node)
        logic.bulk_tls = server_tls_context(self.mesh.nats_tls)
        # Under security, bulk bytes never cross a network in plaintext.
        logic.bulk_tcp = logic.bulk_tls is not None or not (self.mesh.credentials or self.mesh.nats_tls.enabled)
        return logic

    async def _supervision(self, backend: Any) -> tuple[SupervisorClient | None, LeaseJournal | None]:
        """With ``sandbox.supervisor``: the node's supervisor (started, or found running) holds
        this broker's sandboxes, and its leases are journaled in JetStream KV under its name
        (stable across Ray's restarts of it). runsc sandboxes stay the broker's children."""
        if not self.config.supervisor or backend.name not in ("bwrap", "process"):
            return None, None
        supervisor = SupervisorClient(self.mesh.run_dir, broker=self.name,
                                      idle_exit_s=self.config.supervisor_idle_exit_s,
                                      keep_s=self.config.exec_result_keep_s)
        await asyncio.to_thread(supervisor.ensure_running)
        backend.supervisor = supervisor
        return supervisor, LeaseJournal(self.shell.stores.sandbox_leases(), self.name,
                                        sync_interval_s=self.config.reap_interval_s)
