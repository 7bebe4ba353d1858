"""Workspace snapshots the broker keeps: tars on disk, capped in count and bytes, with a TTL.

Knows files and the runtime's ``SandboxLimits``; nothing of leases or the bus. A snapshot also
records the terms of the lease it was taken from (profile, limits, network), so leases forked
from it get the same. When a new snapshot does not fit, the least recently used ones are
dropped to make room; a snapshot unused for ``ttl_s`` expires. Forking a dropped snapshot is
answered "unknown_snapshot", never with a stale or partial tar.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from rollmesh.sandbox.errors import TransferError
from rollmesh.sandbox.lease_terms import LeaseTerms

log = structlog.get_logger(__name__)


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


class SnapshotStore:
    """``root`` belongs to the store: it is emptied at start (snapshots do not outlive the
    broker that took them)."""

    def __init__(self, root: Path, *, max_count: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float]) -> None:
        self.root = Path(root)
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._snapshots: dict[str, Snapshot] = {}
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True, mode=0o700)

    async def put(self, snapshot_id: str, data: bytes, *, sha256: str, terms: LeaseTerms,
                  source_lease: str) -> Snapshot:
        """Store ``data``; drops the least recently used snapshots when it would not fit.
        ``TransferError`` when it alone is larger than the byte cap."""
        if len(data) > self.max_bytes:
            raise TransferError(f"a snapshot of {len(data)} bytes is larger than "
                                f"sandbox.max_snapshot_bytes ({self.max_bytes})", path=".")
        self.expire()
        while self._snapshots and (len(self._snapshots) >= self.max_count
                                   or self.bytes_held() + len(data) > self.max_bytes):
            oldest = min(self._snapshots.values(), key=lambda snapshot: snapshot.last_used)
            log.info("sandbox snapshot evicted", snapshot_id=oldest.snapshot_id, size=oldest.size)
            self._drop(oldest.snapshot_id)
        path = self.root / f"{snapshot_id}.tar"
        await asyncio.to_thread(path.write_bytes, data)
        now = self._clock()
        snapshot = Snapshot(snapshot_id, path, len(data), sha256, terms, source_lease, now, now + self.ttl_s)
        self._snapshots[snapshot_id] = snapshot
        return snapshot

    def get(self, snapshot_id: str) -> Snapshot | None:
        """The snapshot (its TTL restarts), or None when unknown or expired."""
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

    def expire(self) -> int:
        now = self._clock()
        expired = [sid for sid, snapshot in self._snapshots.items() if now >= snapshot.expires_at]
        for snapshot_id in expired:
            self._drop(snapshot_id)
        return len(expired)

    def bytes_held(self) -> int:
        return sum(snapshot.size for snapshot in self._snapshots.values())

    def __len__(self) -> int:
        return len(self._snapshots)

    def clear(self) -> None:
        for snapshot_id in list(self._snapshots):
            self._drop(snapshot_id)

    def _drop(self, snapshot_id: str) -> None:
        snapshot = self._snapshots.pop(snapshot_id, None)
        if snapshot is not None:
            snapshot.path.unlink(missing_ok=True)
