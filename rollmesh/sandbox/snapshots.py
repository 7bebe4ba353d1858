"""Workspace snapshots the broker keeps: tars on disk, capped in count and bytes, with a TTL, and
(on the bus) a copy in the namespace's shared snapshot store, so a snapshot outlives its broker.

Knows files, the runtime's ``SandboxLimits`` and the ``SharedSnapshots`` seam; nothing of leases,
NATS or Ray. A snapshot also records the terms of the lease it was taken from (profile, limits,
network), so leases forked from it get the same. When a new snapshot does not fit, the least
recently used ones are dropped to make room; a snapshot unused for ``ttl_s`` expires. Both rules
count the snapshots this broker took, and dropping one here deletes its shared copy too (the shared
store's own TTL removes what a lost broker can no longer delete). A snapshot not held here (its
broker was lost, or another broker took it) is read from the shared store and checked against
its sha256, never cached here: it would count against this broker's caps. Forking a dropped
snapshot is answered "unknown_snapshot", never with a stale or partial tar.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from rollmesh.messages.sandbox import SandboxSnapshotRecord
from rollmesh.sandbox.errors import ChecksumMismatchError, TransferError
from rollmesh.sandbox.lease_terms import LeaseTerms, limits_spec
from rollmesh.sandbox.sandbox_protocol import SandboxLimits

log = structlog.get_logger(__name__)


class SharedSnapshots(Protocol):
    """The snapshot store every broker of a namespace reads (``rollmesh.bus.sandbox_snapshots``).
    ``put`` returns once the copy is durable; ``get`` is None when there is no such snapshot."""

    async def put(self, record: SandboxSnapshotRecord, data: bytes) -> None: ...

    async def get(self, snapshot_id: str) -> tuple[SandboxSnapshotRecord, bytes] | None: ...

    async def delete(self, snapshot_id: str) -> None: ...


@dataclass(slots=True)
class Snapshot:
    snapshot_id: str
    path: Path
    size: int
    sha256: str
    terms: LeaseTerms
    source_lease: str
    last_used: float
    expires_at: float


@dataclass(frozen=True, slots=True)
class SnapshotCopy:
    """What a fork needs of a snapshot, wherever it was found: its terms, tar and tar's sha256."""

    snapshot_id: str
    terms: LeaseTerms
    sha256: str
    data: bytes
    shared: bool  # read from the shared store (this broker did not hold it)


class SnapshotStore:
    """``root`` belongs to the store: it is emptied at start (the local copies do not outlive the
    broker that took them; the shared ones do, until their TTL)."""

    def __init__(self, root: Path, *, max_count: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float], shared: SharedSnapshots | None = None) -> None:
        self.root = Path(root)
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.shared = shared
        self._clock = clock
        self._snapshots: dict[str, Snapshot] = {}
        self._unshared: list[str] = []  # dropped here, their shared copies still to delete
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True, mode=0o700)

    async def put(self, snapshot_id: str, data: bytes, *, sha256: str, terms: LeaseTerms,
                  source_lease: str) -> Snapshot:
        """Store ``data`` (here, then in the shared store: the reply waits until it is durable);
        drops the least recently used snapshots when it would not fit. ``TransferError`` when it
        alone is larger than the byte cap; the shared store's own error when it cannot keep it."""
        if len(data) > self.max_bytes:
            raise TransferError(f"a snapshot of {len(data)} bytes is larger than "
                                f"sandbox.max_snapshot_bytes ({self.max_bytes})", path=".")
        self._expire_here()
        while self._snapshots and (len(self._snapshots) >= self.max_count
                                   or self.bytes_held() + len(data) > self.max_bytes):
            oldest = min(self._snapshots.values(), key=lambda snapshot: snapshot.last_used)
            log.info("sandbox snapshot evicted", snapshot_id=oldest.snapshot_id, size=oldest.size)
            self._drop(oldest.snapshot_id)
        await self._delete_shared()
        path = self.root / f"{snapshot_id}.tar"
        await asyncio.to_thread(path.write_bytes, data)
        if self.shared is not None:
            try:
                await self.shared.put(_record(snapshot_id, len(data), sha256, terms, source_lease), data)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        now = self._clock()
        snapshot = Snapshot(snapshot_id, path, len(data), sha256, terms, source_lease, now, now + self.ttl_s)
        self._snapshots[snapshot_id] = snapshot
        return snapshot

    def get(self, snapshot_id: str) -> Snapshot | None:
        """The snapshot held here (its TTL restarts), or None when unknown or expired."""
        snapshot = self._snapshots.get(snapshot_id)
        now = self._clock()
        if snapshot is None or now >= snapshot.expires_at:
            if snapshot is not None:
                self._drop(snapshot_id)
            return None
        snapshot.last_used, snapshot.expires_at = now, now + self.ttl_s
        return snapshot

    async def read(self, snapshot: Snapshot) -> bytes:
        return await asyncio.to_thread(snapshot.path.read_bytes)

    async def load(self, snapshot_id: str) -> SnapshotCopy | None:
        """The snapshot's copy, from here or else from the shared store; None when neither has
        it. ``ChecksumMismatchError`` when the shared bytes are not the snapshot's."""
        held = self.get(snapshot_id)
        if held is not None:
            return SnapshotCopy(snapshot_id, held.terms, held.sha256, await self.read(held), shared=False)
        if self.shared is None:
            return None
        found = await self.shared.get(snapshot_id)
        if found is None:
            return None
        record, data = found
        digest = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        if len(data) != record.size or digest != record.sha256:
            raise ChecksumMismatchError(f"the shared copy of snapshot {snapshot_id!r} ({len(data)} bytes, "
                                        f"sha256 {digest}) is not the snapshot taken ({record.size} bytes, "
                                        f"sha256 {record.sha256})", path=".")
        limits = SandboxLimits(**{name: getattr(record.limits, name)
                                  for name in SandboxLimits.__dataclass_fields__})
        # The TTL is the forked lease's own (the fork request's); the snapshot's plays no part.
        terms = LeaseTerms(record.profile, limits, record.network, 0.0, warmable=record.warmable)
        log.info("sandbox snapshot read from the shared store", snapshot_id=snapshot_id, size=len(data))
        return SnapshotCopy(snapshot_id, terms, record.sha256, data, shared=True)

    async def expire(self) -> int:
        expired = self._expire_here()
        await self._delete_shared()
        return expired

    def bytes_held(self) -> int:
        return sum(snapshot.size for snapshot in self._snapshots.values())

    def __len__(self) -> int:
        return len(self._snapshots)

    def clear(self) -> None:
        """Drop the local copies (the broker is stopping); shared copies stay until their TTL,
        for rollouts that resume on another broker or after a restart."""
        for snapshot_id in list(self._snapshots):
            snapshot = self._snapshots.pop(snapshot_id)
            snapshot.path.unlink(missing_ok=True)

    def _expire_here(self) -> int:
        now = self._clock()
        expired = [sid for sid, snapshot in self._snapshots.items() if now >= snapshot.expires_at]
        for snapshot_id in expired:
            self._drop(snapshot_id)
        return len(expired)

    def _drop(self, snapshot_id: str) -> None:
        snapshot = self._snapshots.pop(snapshot_id, None)
        if snapshot is not None:
            snapshot.path.unlink(missing_ok=True)
            if self.shared is not None:
                self._unshared.append(snapshot_id)

    async def _delete_shared(self) -> None:
        while self.shared is not None and self._unshared:
            snapshot_id = self._unshared.pop()
            try:
                await self.shared.delete(snapshot_id)
            except Exception as exc:  # noqa: BLE001 - the shared store's TTL removes it anyway
                log.warning("sandbox shared snapshot not deleted", snapshot_id=snapshot_id, error=repr(exc))


def _record(snapshot_id: str, size: int, sha256: str, terms: LeaseTerms, source_lease: str) -> SandboxSnapshotRecord:
    return SandboxSnapshotRecord(snapshot_id=snapshot_id, size=size, sha256=sha256, profile=terms.profile,
                                 limits=limits_spec(terms.limits), network=terms.network,
                                 warmable=terms.warmable, source_lease=source_lease)
