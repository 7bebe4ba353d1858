"""The sandbox broker actor: serves the broker's request/reply subjects over NATS.

Knows the sandbox package and the shell; no ray import. Tool code runs in sandboxes made by the
backend, never in this actor's process. One task (owned by the service, cancelled at stop) runs
the broker's timers: reaping expired leases and resizing warm pools. At stop every sandbox,
leased or warm, is destroyed. With ``sandbox.supervisor`` the node's supervisor holds them and
the leases are journaled in KV, so a broker that crashed (no stop) leaves both to its restarted
self, which re-adopts them before it serves (``rollmesh.sandbox.lease_store``).

A broker with an id (the launcher gives each one, ``sandbox.brokers``) answers the shared lease
subject in the brokers' queue group, placing each lease by load and profile
(``rollmesh.sandbox.placement``: it may forward it once to another broker's own lease subject),
serves its own subjects ``rl.<ns>.sandbox.b.<id>.*`` for everything else, makes ids that name it,
and publishes its load every pool interval. Without an id it serves the shared subjects alone, as
a single broker always did.

From start to stop it also serves the bulk data path (``rollmesh.sandbox.bulk_server``): a Unix
socket, and TCP on sandbox.bulk_bind_host with TLS from security.nats_tls when NATS uses TLS.
With security but no TLS certificate to serve, only the Unix socket (clients on other nodes then
move files over NATS).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import structlog

from rollmesh.actors.role_base import MeshContext, RoleActor
from rollmesh.bus.tls import server_tls_context
from rollmesh.config import SandboxConfig
from rollmesh.messages.sandbox import SandboxLeaseReply, SandboxLeaseRequest, SandboxLoadReported
from rollmesh.ports import ActorLogic, MessageContext, Publisher, RequestFailedError, Subscription
from rollmesh.sandbox import SandboxBroker
from rollmesh.sandbox.backends import select_configured_backend
from rollmesh.sandbox.bulk_server import BulkServer
from rollmesh.sandbox.in_process import broker_handlers
from rollmesh.sandbox.lease_store import LeaseJournal, readopt
from rollmesh.sandbox.supervisor_client import SupervisorClient
from rollmesh.sandbox.placement import BrokerDirectory, broker_ids
from rollmesh.messages.subjects import SANDBOX_EXEC, SANDBOX_LEASE, SANDBOX_LOAD, broker_subject

_log = structlog.get_logger("rollmesh.sandbox_broker")
# Requests handled at once per subject. Exec gets more than the broker admits, so a request past
# max_concurrent_execs is answered "capacity" at once instead of waiting unseen in a queue.
CONCURRENCY = 64


class SandboxBrokerService:
    """Binds each broker operation to its request subject (with ``broker_id``: the shared lease
    subject, placed, and the broker's own subjects; ``publisher`` forwards leases and reports
    load)."""

    # The bulk stream's TLS and whether it offers TCP at all (set by the actor, from security).
    bulk_tls: ssl.SSLContext | None = None
    bulk_tcp: bool = True
    _bulk: BulkServer | None = None

    def __init__(self, broker: SandboxBroker, *, broker_id: str = "", publisher: Publisher | None = None,
                 node: str = "") -> None:
        self.broker = broker
        self.broker_id = broker_id
        self.node = node
        self._publisher = publisher
        self.directory = BrokerDirectory(broker_id, report_interval_s=broker.config.pool_interval_s,
                                         clock=time.monotonic) if broker_id else None
        self.forwarded = 0  # leases this broker placed on another
        self._timers: asyncio.Task[None] | None = None
        self._reports: asyncio.Task[None] | None = None

    def subscriptions(self) -> list[Subscription]:
        exec_slots = self.broker.config.max_concurrent_execs + CONCURRENCY
        handlers = broker_handlers(self.broker)
        if self.broker_id:  # its own subjects (its leases named); the shared lease subject is placed
            handlers = {broker_subject(subject, self.broker_id): method for subject, method in handlers.items()}
            handlers[broker_subject(SANDBOX_LEASE, self.broker_id)] = self._lease_here
        served = [
            Subscription(subject, _handler(method), "request",
                         max_concurrent=exec_slots if subject.type is SANDBOX_EXEC.type else CONCURRENCY)
            for subject, method in handlers.items()
        ]
        if not self.broker_id:
            return served
        return [*served, Subscription(SANDBOX_LEASE, self._placed_lease, "request", max_concurrent=CONCURRENCY),
                Subscription(SANDBOX_LOAD, self._heard, "core", max_concurrent=CONCURRENCY)]

    async def start(self) -> None:
        self._timers = asyncio.create_task(self.broker.run_timers(), name="sandbox-broker-timers")
        self._bulk = await self.broker.serve_bulk(tls=self.bulk_tls, tcp=self.bulk_tcp)
        if self.broker_id and self._publisher is not None:
            self._reports = asyncio.create_task(self._report_forever(), name="sandbox-broker-load")

    async def stop(self) -> None:
        for task in (self._reports, self._timers):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._bulk is not None:
            await self._bulk.close()
        await self.broker.close()

    def stats(self) -> dict[str, Any]:
        stats = dataclasses.asdict(self.broker.stats())
        if self.directory is not None:
            stats.update(broker=self.broker_id, node=self.node, brokers_live=self.directory.live(),
                         leases_forwarded=self.forwarded)
        return stats

    # -- placement across brokers ------------------------------------------------------------

    def load(self) -> SandboxLoadReported:
        stats = self.broker.stats()
        return SandboxLoadReported(broker=self.broker_id, leases=stats.active_leases,
                                   live_sandboxes=self.broker.live_sandboxes(),
                                   max_sandboxes=stats.max_sandboxes, warm=stats.warm_sandboxes,
                                   running_execs=stats.running_execs, node=self.node)

    async def _placed_lease(self, request: SandboxLeaseRequest, ctx: MessageContext) -> SandboxLeaseReply:
        """A lease from the shared subject: here, or forwarded once to a better broker's own
        subject; here again when that broker cannot be reached or has no room."""
        assert self.directory is not None and self._publisher is not None
        target = self.broker_id
        if not self.broker.holds(request.holder):  # a retry stays with the lease it retries
            target = self.directory.choose(request.profile, self.load())
        if target != self.broker_id:
            self.directory.placed(target, request.profile)
            try:
                reply = await self._publisher.request(broker_subject(SANDBOX_LEASE, target), request,
                                                      timeout_s=self.broker.config.start_timeout_s)
            except RequestFailedError as exc:
                _log.warning("sandbox_lease_forward_failed", broker=target, error=str(exc))
                self.directory.lost(target)
            else:
                if reply.error_kind != "capacity":  # type: ignore[attr-defined]
                    self.forwarded += 1
                    return reply  # type: ignore[return-value]
        return await self._lease_here(request)

    async def _lease_here(self, request: SandboxLeaseRequest) -> SandboxLeaseReply:
        return msgspec.structs.replace(await self.broker.lease(request), broker=self.broker_id)

    async def _heard(self, report: SandboxLoadReported, ctx: MessageContext) -> None:
        assert self.directory is not None
        self.directory.heard(report)

    async def _report_forever(self) -> None:
        assert self._publisher is not None
        while True:
            try:
                await self._publisher.publish(SANDBOX_LOAD, self.load())
            except Exception as exc:  # noqa: BLE001 - a lost report is made good by the next
                _log.warning("sandbox_load_report_failed", error=repr(exc))
            await asyncio.sleep(self.broker.config.pool_interval_s)


def _handler(method: Any) -> Any:
    async def handle(request: Any, ctx: MessageContext) -> Any:
        return await method(request)

    handle.__name__ = f"handle_{method.__name__}"
    return handle


class SandboxBrokerActor(RoleActor):
    role = "sandbox_broker"

    def __init__(self, name: str, mesh: MeshContext, config: SandboxConfig, broker_id: str = "",
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
        service = SandboxBrokerService(broker, broker_id=self.broker_id, publisher=publisher, node=self.node)
        service.bulk_tls = server_tls_context(self.mesh.nats_tls)
        # Under security, bulk bytes never cross a network in plaintext.
        service.bulk_tcp = service.bulk_tls is not None or not (self.mesh.credentials or self.mesh.nats_tls.enabled)
        return service

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
