"""The sandbox broker role's logic: serves a ``SandboxBroker`` on its request subjects.

Knows the broker, the placement directory, the bulk stream and the ``Publisher`` port; nothing of
NATS or Ray (``rollmesh.actors.sandbox_broker.SandboxBrokerActor`` connects, builds the backend
and the KV-backed journal, and serves this). One task, cancelled at stop, runs the broker's timers
(reaping, warm pools); with a broker id another reports its load every pool interval. A broker
with an id answers the shared lease subject in the brokers' queue group, placing each lease by
load and profile (``placement``: forwarded at most once to another broker's own lease subject),
and serves its own subjects ``rl.<ns>.sandbox.b.<id>.*`` for everything else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
import time
from typing import Any

import msgspec
import structlog

from rollmesh.messages.sandbox import SandboxLeaseReply, SandboxLeaseRequest, SandboxLoadReported
from rollmesh.messages.subjects import SANDBOX_EXEC, SANDBOX_LEASE, SANDBOX_LOAD, broker_subject
from rollmesh.ports import MessageContext, Publisher, RequestFailedError, Subscription
from rollmesh.sandbox.broker import SandboxBroker
from rollmesh.sandbox.bulk_server import BulkServer
from rollmesh.sandbox.in_process import broker_handlers
from rollmesh.sandbox.placement import BrokerDirectory

_log = structlog.get_logger("rollmesh.sandbox_broker")
# Requests handled at once per subject. Exec gets more than the broker admits, so a request past
# max_concurrent_execs is answered "capacity" at once instead of waiting unseen in a queue.
CONCURRENCY = 64


class SandboxBrokerLogic:
    """The broker role: binds each ``SandboxBroker`` operation to its request subject (with
    ``broker_id``: the shared lease subject, placed, and the broker's own subjects; ``publisher``
    forwards leases and reports load), and runs its timers and bulk stream from start to stop."""

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
            timeout_s = self.broker.config.start_timeout_s
            if request.deadline:  # as long as its requester waits: given up on sooner, the lease
                # would be made here too while the other broker still makes it (two sandboxes)
                timeout_s = max(0.001, request.deadline - self.broker.now())
            try:
                reply = await self._publisher.request(broker_subject(SANDBOX_LEASE, target), request,
                                                      timeout_s=timeout_s)
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
