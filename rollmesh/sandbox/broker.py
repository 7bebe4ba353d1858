"""The sandbox broker's plain logic: leases, admission, heartbeats and reaping.

Knows the sandbox messages, its config slice, the runtime seam (``SandboxBackend``/``Sandbox``)
and a ``Publisher`` for exec output; nothing of NATS or Ray (its actor shell decodes requests,
calls these methods and sends the replies). Every failure is a reply with ``error_kind`` and
``error`` set, never an exception to the caller. What runs inside a leased sandbox (exec,
transfers, snapshots) is in ``workspace_ops.py``; where sandboxes come from (warm pools, creation
slots, the room under ``max_sandboxes``) is in ``sandbox_supply.py``; this module owns who holds
which sandbox.

Admission: leased sandboxes, warm ones and those being created never pass ``max_sandboxes``. A
refused lease says "capacity" with a retry hint. A released or expired lease's sandbox is
destroyed, never reused.

Overload: a lease request names when its requester stops waiting (``deadline``). Retries with the
same holder wait on the one pending grant (whose deadline becomes the latest of theirs); once that
passes, no sandbox is made for it and one already made is destroyed, so requests that queued past
their client's patience cost no creations (docs/sandbox.md, "Under overload").
"""

from __future__ import annotations

import asyncio
import ssl
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from rollmesh.config import SandboxConfig
from rollmesh.messages.sandbox import (
    ForkedLease,
    SandboxDownloadReply,
    SandboxDownloadRequest,
    SandboxErrorKind,
    SandboxExecReply,
    SandboxExecRequest,
    SandboxForkReply,
    SandboxForkRequest,
    SandboxHeartbeatReply,
    SandboxHeartbeatRequest,
    SandboxLeaseReply,
    SandboxLeaseRequest,
    SandboxReleaseReply,
    SandboxReleaseRequest,
    SandboxSnapshotReply,
    SandboxSnapshotRequest,
    SandboxUploadReply,
    SandboxUploadRequest,
)
from rollmesh.ports import Publisher
from rollmesh.sandbox.bulk_server import BulkServer
from rollmesh.sandbox.errors import LeaseAbandonedError, RequestRefusedError, SandboxCapacityError
from rollmesh.sandbox.exec_registry import ExecRegistry
from rollmesh.telemetry import metrics, metrics_catalog
from rollmesh.sandbox.lease_terms import LeaseTerms, limits_spec, resolve_terms
from rollmesh.sandbox.lease_store import LeaseJournal
from rollmesh.sandbox.leases import Lease, LeaseTable, PendingLease
from rollmesh.sandbox.sandbox_protocol import Sandbox, SandboxBackend
from rollmesh.sandbox.sandbox_supply import SandboxSupply
from rollmesh.sandbox.snapshots import SharedSnapshots, SnapshotStore
from rollmesh.sandbox.workspace_ops import WorkspaceOps, failure_of

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class SandboxBrokerStats:
    backend: str
    isolated: bool
    active_leases: int
    warm_sandboxes: dict[str, int]
    max_sandboxes: int
    running_execs: int
    snapshots: int
    snapshot_bytes: int
    counts: dict[str, int]


class SandboxBroker:
    """``snapshot_dir`` belongs to the broker (emptied at start). ``publisher`` publishes the
    output chunks of execs that ask for streaming (None: they are not streamed)."""

    def __init__(
        self,
        config: SandboxConfig,
        backend: SandboxBackend,
        *,
        snapshot_dir: Path,
        publisher: Publisher | None = None,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
        journal: LeaseJournal | None = None,
        shared_snapshots: SharedSnapshots | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self._clock = clock
        self._new_id = new_id
        self._leases = LeaseTable()
        self._snapshots = SnapshotStore(snapshot_dir, max_count=config.max_snapshots,
                                        max_bytes=config.max_snapshot_bytes,
                                        ttl_s=config.snapshot_ttl_s, clock=clock, shared=shared_snapshots)
        self.counts: Counter[str] = Counter()
        self._supply = SandboxSupply(config, backend, leased=lambda: len(self._leases), counts=self.counts,
                                     clock=clock, new_id=new_id)
        self._ops = WorkspaceOps(config, self._snapshots, publisher=publisher, new_id=new_id,
                                 counts=self.counts)
        self._pending: dict[str, PendingLease] = {}
        self._journal = journal  # the durable lease table (lease_store), if any
        self._execs = ExecRegistry()  # running and recently ended execs, by exec_id
        _observe_broker(self)

    # -- leases ----------------------------------------------------------------------------

    async def lease(self, req: SandboxLeaseRequest) -> SandboxLeaseReply:
        held = self._leases.of_holder(req.holder)
        if held is not None:
            if not held.expired(self._clock()) and not held.died:
                # Idempotent by token: a retried request (its first reply was lost or late, or
                # the rollout was redelivered) gets the same sandbox, never a second one.
                held.extend(self._clock())
                return self._granted(held)
            await self._end(held, "expired" if not held.died else "died")
        pending = self._pending.get(req.holder)
        if pending is not None:
            pending.attach(req.deadline)
            return await asyncio.shield(pending.reply)
        if req.deadline and self._clock() >= req.deadline:
            # Queued longer than its requester waits (the broker is behind): nobody reads the
            # reply, and a sandbox made for it would sit unused until its TTL.
            self.counts["lease_requests_dropped"] += 1
            return self._refused_lease("capacity", f"the request for {req.holder!r} waited past its "
                                                   "deadline before the broker could serve it")
        pending = PendingLease(asyncio.get_running_loop().create_future())
        pending.attach(req.deadline)
        self._pending[req.holder] = pending
        try:
            reply = await self._new_lease(req, pending)
            pending.reply.set_result(reply)
            return reply
        except BaseException:
            pending.reply.cancel()
            raise
        finally:
            del self._pending[req.holder]

    async def _new_lease(self, req: SandboxLeaseRequest, pending: PendingLease) -> SandboxLeaseReply:
        try:
            terms = resolve_terms(self.config, profile=req.profile, overrides=req.limits,
                                  network=req.network, ttl_s=req.ttl_s)
        except RequestRefusedError as exc:
            return self._refused_lease("invalid_request", str(exc))
        self._supply.pool.record_lease(terms.profile)

        def still_wanted() -> None:
            if self._clock() >= pending.wanted_until:
                self.counts["leases_abandoned"] += 1
                raise LeaseAbandonedError(f"every request for {req.holder!r} gave up waiting before its "
                                          "sandbox was ready", holder=req.holder, deadline=pending.wanted_until)

        try:
            (lease,) = await self._grant([req.holder], terms, still_wanted=still_wanted)
        except SandboxCapacityError as exc:
            return self._refused_lease("capacity", str(exc))
        except Exception as exc:  # noqa: BLE001 - a runtime failure is a reply, by contract
            kind, text = failure_of(exc)
            return self._refused_lease(kind, f"no sandbox could be created: {text}")
        return self._granted(lease)

    async def fork(self, req: SandboxForkRequest) -> SandboxForkReply:
        try:  # held here, or (its broker lost, or another one) read from the shared store
            snapshot = await self._snapshots.load(req.snapshot_id)
        except Exception as exc:  # noqa: BLE001 - a failure is a reply, by contract
            kind, text = failure_of(exc)
            return SandboxForkReply(error_kind=kind, error=f"snapshot {req.snapshot_id!r} unreadable: {text}")
        if snapshot is None:
            return SandboxForkReply(error_kind="unknown_snapshot",
                                    error=f"no snapshot {req.snapshot_id!r} (expired, evicted or never taken)")
        if snapshot.shared:
            self.counts["forks_from_shared_store"] += 1
        ttl = self.config.default_lease_ttl_s if req.ttl_s is None else req.ttl_s
        if ttl > self.config.max_lease_ttl_s:
            return SandboxForkReply(error_kind="invalid_request",
                                    error=f"ttl_s = {ttl:g} is above the maximum {self.config.max_lease_ttl_s:g}")
        terms = LeaseTerms(snapshot.terms.profile, snapshot.terms.limits, snapshot.terms.network, ttl,
                           warmable=snapshot.terms.warmable)
        now = self._clock()
        holders = [f"{req.holder}/{index}" for index in range(req.count)]
        leases: dict[str, Lease] = {}
        for holder in holders:  # forks already granted to a retried request are kept
            held = self._leases.of_holder(holder)
            if held is not None and not held.expired(now) and not held.died:
                leases[holder] = held
        missing = [holder for holder in holders if holder not in leases]
        if missing:
            for _ in missing:
                self._supply.pool.record_lease(terms.profile)
            try:
                tar, sha256 = snapshot.data, snapshot.sha256
                created = await self._grant(missing, terms,
                                            seed=lambda sandbox: self._ops.restore(sandbox, tar, sha256))
            except SandboxCapacityError as exc:
                return SandboxForkReply(error_kind="capacity", error=str(exc),
                                        retry_after_s=self.config.capacity_retry_after_s)
            except Exception as exc:  # noqa: BLE001
                kind, text = failure_of(exc)
                return SandboxForkReply(error_kind=kind, error=f"fork of {req.snapshot_id!r} failed: {text}")
            leases.update(zip(missing, created, strict=True))
        self.counts["forks"] += len(missing)
        return SandboxForkReply(leases=[
            ForkedLease(lease_id=leases[h].lease_id, holder=h, expires_at=leases[h].expires_at) for h in holders
        ])

    async def heartbeat(self, req: SandboxHeartbeatRequest) -> SandboxHeartbeatReply:
        lease, kind, text = await self._live(req.lease_id)
        if lease is None:
            return SandboxHeartbeatReply(error_kind=kind, error=text)
        if lease.died:  # the holder learns now, not at its next exec
            return SandboxHeartbeatReply(error_kind="sandbox_died",
                                         error=f"the sandbox of lease {req.lease_id!r} died")
        lease.extend(self._clock())
        # A client waiting for that exec's reply asks: unknown here, it sends it again.
        known = bool(req.exec_id) and self._execs.known((req.lease_id, req.exec_id))
        return SandboxHeartbeatReply(expires_at=lease.expires_at, exec_known=known)

    async def release(self, req: SandboxReleaseRequest) -> SandboxReleaseReply:
        lease = self._leases.get(req.lease_id)
        if lease is None:
            # Also what a second release gets: releasing is idempotent in effect.
            return SandboxReleaseReply(error_kind="unknown_lease", error=f"no lease {req.lease_id!r}")
        await self._end(lease, "released")
        return SandboxReleaseReply(released=True)

    # -- what runs in a leased sandbox ------------------------------------------------------

    async def exec(self, req: SandboxExecRequest) -> SandboxExecReply:
        # A retried request (same exec_id) waits for the running exec instead of starting it
        # again; across a broker restart the supervisor attaches it the same way (by key).
        if not req.exec_id:
            return await self._exec(req)
        key = (req.lease_id, req.exec_id)
        running = self._execs.running(key)
        if running is not None:
            self.counts["execs_reattached"] += 1
            return await asyncio.shield(running)
        return await asyncio.shield(self._execs.start(key, lambda: self._exec(req)))

    async def _exec(self, req: SandboxExecRequest) -> SandboxExecReply:
        started = time.monotonic()
        lease, kind, text = await self._live(req.lease_id)
        if lease is None:
            reply = SandboxExecReply(error_kind=kind, error=text, exec_id=req.exec_id)
        else:
            reply = await self._ops.exec(lease, req, now=self._clock)
        # Recorded at the next metrics collection: the caller is waiting for this reply.
        metrics.record_deferred(metrics_catalog.SANDBOX_EXEC_DURATION, time.monotonic() - started,
                                {"result": reply.error_kind or reply.result})
        return reply

    async def upload(self, req: SandboxUploadRequest) -> SandboxUploadReply:
        lease, kind, text = await self._live(req.lease_id)
        if lease is None:
            return SandboxUploadReply(error_kind=kind, error=text)
        lease.extend(self._clock())
        return await self._ops.upload(lease, req)

    async def download(self, req: SandboxDownloadRequest) -> SandboxDownloadReply:
        lease, kind, text = await self._live(req.lease_id)
        if lease is None:
            return SandboxDownloadReply(error_kind=kind, error=text)
        lease.extend(self._clock())
        return await self._ops.download(lease, req)

    async def snapshot(self, req: SandboxSnapshotRequest) -> SandboxSnapshotReply:
        lease, kind, text = await self._live(req.lease_id)
        if lease is None:
            return SandboxSnapshotReply(error_kind=kind, error=text)
        lease.extend(self._clock())
        return await self._ops.snapshot(lease, self._new_id())

    # -- timers ----------------------------------------------------------------------------

    async def run_timers(self) -> None:
        """Reap expired leases and resize warm pools until cancelled (the shell owns the task)."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._every(self.config.reap_interval_s, self.reap_expired))
            group.create_task(self._supply.pools_forever())

    async def _every(self, interval_s: float, action: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await action()
            except Exception as exc:  # noqa: BLE001 - a failed round must not stop the timer
                log.error("sandbox broker timer failed", action=action.__name__, error=repr(exc))

    async def reap_expired(self) -> int:
        """End every lease whose holder stopped heartbeating; returns how many."""
        expired = self._leases.expired(self._clock())
        for lease in expired:
            await self._end(lease, "expired")
        await self._snapshots.expire()
        self._execs.forget_ended()
        self._ops.bulk_tokens.drop_lapsed()
        if self._journal is not None:
            await self._journal.sync(self._leases.all(), self._clock())
        return len(expired)

    async def resize_pools(self) -> None:
        """Bring each profile's warm pool to its demand-sized target."""
        await self._supply.resize_pools()

    async def serve_bulk(self, *, tls: ssl.SSLContext | None = None, tcp: bool = True) -> BulkServer:
        """Start the bulk data path's server (files above sandbox.bulk_threshold_bytes move over
        it); the caller closes it before ``close``. Until then, uploads go over NATS."""
        return await BulkServer.start(self._ops, bind_host=self.config.bulk_bind_host, tls=tls, tcp=tcp)

    async def adopt(self, leases: list[Lease]) -> int:
        """Leases a previous broker of this name granted, whose sandboxes live on
        (``lease_store.readopt``); those that expired meanwhile are reaped at once (how many)."""
        for lease in leases:
            self._leases.add(lease)
        self.counts["leases_adopted"] += len(leases)
        return await self.reap_expired()

    async def close(self) -> None:
        """Destroy every sandbox, leased and warm (the broker is stopping)."""
        await self._supply.close()  # first: no warm sandbox is made while the leases end
        for lease in self._leases.all():
            await self._end(lease, "broker stopped")
        self._snapshots.clear()

    # -- state -----------------------------------------------------------------------------

    def holds(self, holder: str) -> bool:
        """Whether ``holder`` has a live lease here, or one being granted: its retried lease
        requests stay here whatever the placement across brokers would say."""
        held = self._leases.of_holder(holder)
        live = held is not None and not held.died and not held.expired(self._clock())
        return live or holder in self._pending

    def now(self) -> float:
        """The broker's wall clock, which lease requests' deadlines are read against."""
        return self._clock()

    def live_sandboxes(self) -> int:
        return self._supply.live()

    def stats(self) -> SandboxBrokerStats:
        return SandboxBrokerStats(
            backend=self.backend.name, isolated=self.backend.isolated, active_leases=len(self._leases),
            warm_sandboxes={name: self._supply.pool.ready(name) for name in self._supply.pool.profiles()},
            max_sandboxes=self.config.max_sandboxes, running_execs=self._ops.running_execs,
            snapshots=len(self._snapshots), snapshot_bytes=self._snapshots.bytes_held(),
            counts=dict(self.counts),
        )

    # -- internals -------------------------------------------------------------------------

    async def _grant(self, holders: list[str], terms: LeaseTerms,
                     seed: Callable[[Sandbox], Any] | None = None,
                     still_wanted: Callable[[], None] = lambda: None) -> list[Lease]:
        """One new lease per holder (all or none): warm sandboxes first, then new ones.
        ``still_wanted`` raises (``LeaseAbandonedError``) once nobody waits for them: asked
        before a warm sandbox is taken, and before and after a creation (one ready too late is
        destroyed at once rather than leased to nobody until its TTL)."""
        leased = len(self._leases) + self._supply.reserved
        if leased + len(holders) > self.config.max_sandboxes:
            self.counts["leases_refused"] += len(holders)
            raise SandboxCapacityError(f"{leased} of {self.config.max_sandboxes} sandboxes are leased; "
                                       f"{len(holders)} more do not fit")
        # Reserved before the first await, so concurrent requests see the room as taken; a warm
        # sandbox taken moves from the pool's count to this one.
        self._supply.reserved += len(holders)
        try:
            obtained = await asyncio.gather(*(self._supply.obtain(terms, still_wanted) for _ in holders),
                                            return_exceptions=True)
            sandboxes = [item for item in obtained if not isinstance(item, BaseException)]
            failure = next((item for item in obtained if isinstance(item, BaseException)), None)
            if failure is None and seed is not None:
                seeded = await asyncio.gather(*(seed(sandbox) for sandbox, _ in sandboxes),
                                              return_exceptions=True)
                failure = next((item for item in seeded if isinstance(item, BaseException)), None)
            if failure is not None:
                for sandbox, _ in sandboxes:
                    await self._supply.destroy(sandbox, "its lease could not be completed")
                raise failure
            now = self._clock()
            leases = []
            for holder, (sandbox, warm) in zip(holders, sandboxes, strict=True):
                lease = Lease(self._new_id(), holder, terms, sandbox, now + terms.ttl_s, warm=warm)
                self._leases.add(lease)
                leases.append(lease)
                self.counts["leases_granted"] += 1
                self.counts["leases_warm" if warm else "leases_cold"] += 1
                log.debug("sandbox leased", lease_id=lease.lease_id, holder=holder, warm=warm)
            if self._journal is not None:
                await self._journal.granted(leases)
            return leases
        finally:
            self._supply.reserved -= len(holders)

    async def _live(self, lease_id: str) -> tuple[Lease | None, SandboxErrorKind, str]:
        lease = self._leases.get(lease_id)
        if lease is None:
            return None, "unknown_lease", f"no lease {lease_id!r} (released, reaped or never granted)"
        if lease.expired(self._clock()):
            await self._end(lease, "expired")
            return None, "lease_expired", f"lease {lease_id!r} expired: no heartbeat within its TTL"
        if not lease.died and not lease.sandbox.alive():
            lease.died = True
            log.warning("leased sandbox died", lease_id=lease_id, holder=lease.holder)
        return lease, "", ""

    async def _end(self, lease: Lease, why: str) -> None:
        # Forget the lease first, so no concurrent request can use a sandbox being destroyed.
        if self._leases.remove(lease.lease_id) is None:
            return
        lease.transfers.clear()
        self.counts[{"released": "leases_released", "expired": "leases_expired"}.get(why, "leases_ended")] += 1
        log.info("sandbox lease ended", lease_id=lease.lease_id, holder=lease.holder, why=why)
        if self._journal is not None:
            await self._journal.ended(lease)
        await self._supply.destroy(lease.sandbox, why)

    def _granted(self, lease: Lease) -> SandboxLeaseReply:
        return SandboxLeaseReply(
            lease_id=lease.lease_id, backend=self.backend.name, isolated=self.backend.isolated,
            expires_at=lease.expires_at, profile=lease.terms.profile, ttl_s=lease.terms.ttl_s,
            limits=limits_spec(lease.terms.limits), warm=lease.warm,
        )

    def _refused_lease(self, kind: SandboxErrorKind, text: str) -> SandboxLeaseReply:
        log.info("sandbox lease refused", error_kind=kind, error=text)
        retry = self.config.capacity_retry_after_s if kind in ("capacity", "infra_error") else 0.0
        return SandboxLeaseReply(error_kind=kind, error=text, retry_after_s=retry)


def _observe_broker(broker: SandboxBroker) -> None:
    """The broker's pool, leases and grants, read at every metrics collection."""
    metrics.observe(metrics_catalog.SANDBOX_POOL_SIZE, broker, lambda b: [  # every configured profile
        (b._supply.pool.ready(profile) if profile in b._supply.pool.profiles() else 0, {"profile": profile})
        for profile in b.config.profiles])
    metrics.observe(metrics_catalog.SANDBOX_LEASES_ACTIVE, broker, lambda b: [(len(b._leases), {})])
    metrics.observe(metrics_catalog.SANDBOX_LEASES_GRANTED, broker,
                    lambda b: [(b.counts["leases_granted"], {})])
