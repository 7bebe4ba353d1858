"""The shared sandbox-snapshot store: workspace tars in the JetStream object store, so a snapshot
outlives the broker (and node) that took it and any broker of the namespace can fork it.

Knows our bucket naming (``RL_<ns>_SANDBOX_SNAPSHOTS``) and the layout of a snapshot in it: the
tar under ``<snapshot id>/tar``, then its ``SandboxSnapshotRecord`` (msgpack) under
``<snapshot id>/record``. The record is written last and deleted first, so a record found names
a whole tar (and the reader checks its sha256 anyway); nothing of sandboxes. Implements
``rollmesh.sandbox.snapshots.SharedSnapshots``. The bucket is made by its first broker with
``sandbox.snapshot_ttl_s`` as its TTL: the server removes what a lost broker can no longer evict.
"""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext

from rollmesh.bus.object_bucket import ObjectBucket
from rollmesh.messages.sandbox import SandboxSnapshotRecord
from rollmesh.messages.subjects import check_namespace

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SandboxSnapshotRecord)


def sandbox_snapshots_bucket(namespace: str) -> str:
    return f"RL_{check_namespace(namespace)}_SANDBOX_SNAPSHOTS"


class ObjectStoreSandboxSnapshots:
    def __init__(self, js: JetStreamContext, namespace: str, *, ttl_s: float, replicas: int = 1,
                 outage_retry_s: float = 30.0) -> None:
        self.objects = ObjectBucket(js, sandbox_snapshots_bucket(namespace), replicas=replicas, ttl_s=ttl_s,
                                    outage_retry_s=outage_retry_s,
                                    description="sandbox workspace snapshots, readable by every broker")
        self.bucket = self.objects.name

    async def put(self, record: SandboxSnapshotRecord, data: bytes) -> None:
        await self.objects.put(f"{record.snapshot_id}/tar", data)
        await self.objects.put(f"{record.snapshot_id}/record", _encoder.encode(record))

    async def get(self, snapshot_id: str) -> tuple[SandboxSnapshotRecord, bytes] | None:
        """The record and the tar; None when either is missing or the record is undecodable."""
        raw = await self.objects.get(f"{snapshot_id}/record")
        if raw is None:
            return None
        try:
            record = _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        data = await self.objects.get(f"{snapshot_id}/tar")
        return None if data is None else (record, data)

    async def delete(self, snapshot_id: str) -> None:
        await self.objects.delete(f"{snapshot_id}/record")
        await self.objects.delete(f"{snapshot_id}/tar")
