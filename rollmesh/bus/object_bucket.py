"""One JetStream object-store bucket of named blobs: open-or-create, put, get, delete.

Knows nats-py's object store API and our outage retries; nothing of what the blobs hold. The
sidecar stores (routed-expert rows, long trajectories) are built on it. Blobs are not messages:
they can pass the NATS max payload, and the object store chunks them. Writes ride out NATS
outages like every durable write; failures are ``StateStoreError``.
"""

from __future__ import annotations

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.object_store import ObjectStore

from rollmesh.bus.outage import retry_through_outage
from rollmesh.ports import StateStoreError


class ObjectBucket:
    """The bucket ``name``, created on first use with ``description`` (and ``ttl_s``: a blob
    older than that is removed by the server; None keeps blobs until deleted). A bucket that
    exists already keeps its own config."""

    def __init__(self, js: JetStreamContext, name: str, *, description: str, replicas: int = 1,
                 ttl_s: float | None = None, outage_retry_s: float = 60.0) -> None:
        self._js = js
        self.name = name
        self.description = description
        self.replicas = replicas
        self.ttl_s = ttl_s
        self.outage_retry_s = outage_retry_s
        self._store: ObjectStore | None = None

    async def put(self, key: str, data: bytes) -> None:
        store = await self._bucket()
        try:
            await retry_through_outage(lambda: store.put(key, data), within_s=self.outage_retry_s,
                                       what=f"{self.name} put")
        except nats.errors.Error as exc:
            raise StateStoreError(f"cannot store {key!r} in {self.name}: {exc!r}") from exc

    async def get(self, key: str) -> bytes | None:
        """The blob, or None when there is none."""
        store = await self._bucket()
        try:
            result = await retry_through_outage(lambda: store.get(key), within_s=self.outage_retry_s,
                                                what=f"{self.name} get")
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            return None
        except nats.errors.Error as exc:
            raise StateStoreError(f"cannot read {key!r} from {self.name}: {exc!r}") from exc
        return result.data or b""

    async def delete(self, key: str) -> None:
        store = await self._bucket()
        try:
            await retry_through_outage(lambda: store.delete(key), within_s=self.outage_retry_s,
                                       what=f"{self.name} delete")
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            return
        except nats.errors.Error as exc:
            raise StateStoreError(f"cannot delete {key!r} from {self.name}: {exc!r}") from exc

    async def _bucket(self) -> ObjectStore:
        if self._store is None:
            async def open_or_create() -> ObjectStore:
                try:
                    return await self._js.object_store(self.name)
                except nats.js.errors.BucketNotFoundError:
                    return await self._js.create_object_store(self.name, config=ObjectStoreConfig(
                        bucket=self.name, storage=StorageType.FILE, replicas=self.replicas,
                        ttl=self.ttl_s, description=self.description))
            try:
                self._store = await retry_through_outage(open_or_create, within_s=self.outage_retry_s,
                                                         what=f"{self.name} bucket")
            except nats.errors.Error as exc:
                raise StateStoreError(f"no object-store bucket {self.name}: {exc!r}") from exc
        return self._store
