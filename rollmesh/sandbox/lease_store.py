"""A broker's durable lease table, and re-adopting its leases and sandboxes after a restart.

Knows the lease record message, the lease table's ``Lease``, the supervisor client and a
``LeaseStore`` (JetStream KV in the mesh: ``rollmesh.bus.sandbox_leases``); nothing of NATS or
Ray. The journal writes a lease when it is granted, deletes it when it ends, and rewrites it
when its expiry moved a quarter TTL past what is stored (heartbeats would otherwise each cost a
write): a stored expiry lags the live one by at most ``expiry_slack_s``, so a restarted broker
counts a lease live until stored expiry + slack, and reaps it past that.

Failures to write are logged, never a lease refused: a lease the store missed is one that a
broker crash would lose, as every lease was before.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import structlog

from rollmesh.messages.sandbox import SandboxLeaseRecord
from rollmesh.sandbox.lease_terms import LeaseTerms, limits_spec
from rollmesh.sandbox.leases import Lease
from rollmesh.sandbox.sandbox_protocol import SandboxLimits

if TYPE_CHECKING:
    from rollmesh.sandbox.broker import SandboxBroker
    from rollmesh.sandbox.supervisor_client import SupervisorClient

log = structlog.get_logger(__name__)


class LeaseStore(Protocol):
    async def put(self, record: SandboxLeaseRecord) -> None: ...

    async def delete(self, broker: str, lease_id: str) -> None: ...

    async def load(self, broker: str) -> list[SandboxLeaseRecord]: ...


class LeaseJournal:
    """Keeps ``store`` in step with one broker's lease table. ``sync_interval_s`` is how often
    the broker calls ``sync`` (its reap interval): part of the slack."""

    def __init__(self, store: LeaseStore, broker: str, *, sync_interval_s: float) -> None:
        self.store = store
        self.broker = broker
        self.sync_interval_s = sync_interval_s
        self._stored: dict[str, float] = {}  # lease id -> the expiry written

    def slack(self, lease: Lease) -> float:
        return lease.terms.ttl_s / 4 + self.sync_interval_s

    async def granted(self, leases: list[Lease]) -> None:
        await asyncio.gather(*(self._write(lease) for lease in leases))

    async def ended(self, lease: Lease) -> None:
        await self.forget(lease.lease_id)

    async def forget(self, lease_id: str) -> None:
        self._stored.pop(lease_id, None)
        try:
            await self.store.delete(self.broker, lease_id)
        except Exception as exc:  # noqa: BLE001 - a stale record is reaped by the next broker
            log.warning("sandbox lease record not deleted", lease_id=lease_id, error=repr(exc))

    async def sync(self, leases: list[Lease], now: float) -> None:
        """Rewrite each lease whose expiry moved a quarter TTL past the stored one. A lease
        running an exec does not expire (``Lease.expired``): stored as a TTL from ``now``, so a
        restarted broker does not reap it under a command that outlived its holder's beats."""
        due = {lease.lease_id: max(lease.expires_at, now + lease.terms.ttl_s) if lease.running_execs
               else lease.expires_at for lease in leases}
        moved = [lease for lease in leases
                 if due[lease.lease_id] - self._stored.get(lease.lease_id, 0.0) >= lease.terms.ttl_s / 4]
        await asyncio.gather(*(self._write(lease, due[lease.lease_id]) for lease in moved))

    async def _write(self, lease: Lease, expires_at: float | None = None) -> None:
        expires_at = lease.expires_at if expires_at is None else expires_at
        try:
            await self.store.put(record_of(lease, self.broker, slack_s=self.slack(lease), expires_at=expires_at))
            self._stored[lease.lease_id] = expires_at
        except Exception as exc:  # noqa: BLE001
            log.warning("sandbox lease record not written", lease_id=lease.lease_id, error=repr(exc))


def record_of(lease: Lease, broker: str, *, slack_s: float, expires_at: float) -> SandboxLeaseRecord:
    return SandboxLeaseRecord(
        lease_id=lease.lease_id, holder=lease.holder, broker=broker, sandbox_id=lease.sandbox.info.sandbox_id,
        profile=lease.terms.profile, limits=limits_spec(lease.terms.limits), network=lease.terms.network,
        ttl_s=lease.terms.ttl_s, expires_at=expires_at, expiry_slack_s=slack_s,
        warmable=lease.terms.warmable, warm=lease.warm)


def lease_of(record: SandboxLeaseRecord, sandbox) -> Lease:  # noqa: ANN001 - a Sandbox
    limits = SandboxLimits(**{name: getattr(record.limits, name) for name in SandboxLimits.__dataclass_fields__})
    terms = LeaseTerms(record.profile, limits, record.network, record.ttl_s, warmable=record.warmable)
    # Live until the stored expiry plus its slack: past that it surely expired while no broker
    # was alive, and the broker's reaper ends it.
    return Lease(record.lease_id, record.holder, terms, sandbox, record.expires_at + record.expiry_slack_s,
                 warm=record.warm)


@dataclass(frozen=True, slots=True)
class AdoptionStats:
    adopted: int  # leases taken over with their live sandboxes
    reaped: int  # of those, expired while no broker was alive: ended at once
    orphans: int  # sandboxes held for this broker without a lease (warm, or mid-release): destroyed
    lost: int  # lease records whose sandbox is gone: deleted


async def readopt(broker: SandboxBroker, client: SupervisorClient, journal: LeaseJournal) -> AdoptionStats:
    """Take over what a previous broker of this name left: each live sandbox the supervisor holds
    for it with a lease record becomes that lease again; the rest is destroyed or forgotten."""
    records = {record.sandbox_id: record for record in await journal.store.load(journal.broker)}
    held = await asyncio.to_thread(client.held)
    leases, orphans = [], 0
    for entry in held:
        record = records.pop(entry["sandbox_id"], None)
        try:
            sandbox = await client.adopt(entry)  # a dead one fails here, and is cleaned up
        except Exception as exc:  # noqa: BLE001
            log.warning("sandbox not adopted", sandbox_id=entry["sandbox_id"], error=repr(exc))
            if record is not None:
                records[entry["sandbox_id"]] = record
            continue
        if record is None:
            orphans += 1
            await sandbox.destroy()
            continue
        leases.append(lease_of(record, sandbox))
    for record in records.values():
        await journal.forget(record.lease_id)
    reaped = await broker.adopt(leases)
    log.info("sandbox leases re-adopted", adopted=len(leases), reaped=reaped, orphans=orphans, lost=len(records))
    return AdoptionStats(adopted=len(leases), reaped=reaped, orphans=orphans, lost=len(records))

