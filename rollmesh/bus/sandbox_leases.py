"""The sandbox-lease KV bucket: one key per lease (``<broker>.<lease id>``), holding its
``SandboxLeaseRecord`` (msgpack), so a restarted broker finds the leases it granted.

Knows nats-py's KeyValue API, the bucket's name and the record's type; nothing of sandboxes.
Implements ``rollmesh.sandbox.lease_store.LeaseStore``. The bucket is made on first use (file
storage, history 1), like the rollout-state bucket but by its user: only sandbox brokers touch it.
"""

from __future__ import annotations

import hashlib
import re

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from rollmesh.bus.errors import StreamSetupError
from rollmesh.bus.outage import retry_through_outage
from rollmesh.messages.subjects import check_namespace
from rollmesh.messages.sandbox import SandboxLeaseRecord

_SAFE = re.compile(r"^[A-Za-z0-9_=-]{1,120}$")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SandboxLeaseRecord)


def sandbox_lease_bucket(namespace: str) -> str:
    return f"RL_{check_namespace(namespace)}_SANDBOX_LEASES"


def _part(text: str) -> str:
    """A key part NATS accepts: the text itself when it is plain, else a digest of it."""
    return text if _SAFE.match(text) else "sha256=" + hashlib.sha256(text.encode()).hexdigest()[:40]


class KvSandboxLeases:
    def __init__(self, js: JetStreamContext, namespace: str, *, replicas: int = 1,
                 outage_retry_s: float = 30.0) -> None:
        self._js = js
        self.bucket = sandbox_lease_bucket(namespace)
        self.replicas = replicas
        self.outage_retry_s = outage_retry_s
        self._kv: KeyValue | None = None

    async def put(self, record: SandboxLeaseRecord) -> None:
        kv = await self._bucket()
        data = _encoder.encode(record)
        key = f"{_part(record.broker)}.{_part(record.lease_id)}"
        await retry_through_outage(lambda: kv.put(key, data), within_s=self.outage_retry_s, what="lease put")

    async def delete(self, broker: str, lease_id: str) -> None:
        kv = await self._bucket()
        key = f"{_part(broker)}.{_part(lease_id)}"
        try:
            await retry_through_outage(lambda: kv.purge(key), within_s=self.outage_retry_s, what="lease delete")
        except nats.js.errors.KeyNotFoundError:
            pass

    async def load(self, broker: str) -> list[SandboxLeaseRecord]:
        """Every lease ``broker`` recorded; an undecodable value is skipped (and stays)."""
        kv = await self._bucket()
        # A watch on this broker's keys (nats-py's keys() filters by substring, after listing all).
        watcher = await kv.watch(f"{_part(broker)}.>", ignore_deletes=True)
        records = []
        try:
            async for entry in watcher:
                if entry is None:  # the end of what is stored now
                    break
                try:
                    records.append(_decoder.decode(entry.value or b""))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
        finally:
            await watcher.stop()
        return records

    async def _bucket(self) -> KeyValue:
        if self._kv is not None:
            return self._kv
        try:
            self._kv = await self._js.key_value(self.bucket)
        except nats.js.errors.BucketNotFoundError:
            try:
                self._kv = await self._js.create_key_value(KeyValueConfig(
                    bucket=self.bucket, history=1, storage=StorageType.FILE, replicas=self.replicas,
                    description="sandbox brokers' leases, one key per lease"))
            except nats.errors.Error as exc:
                raise StreamSetupError(f"cannot create KV: {exc}", stream=self.bucket) from exc
        return self._kv
