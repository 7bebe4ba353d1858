"""Routed-expert rows of MoE rollouts in a JetStream object store, one object per turn.

Knows nats-py's object store API, our bucket naming and the blob format of
``rollmesh.rollout.routed_experts``; implements ``rollmesh.ports.RoutedExpertsStore``. Objects are
named ``<rollout key>/turn-<n>`` in the bucket ``RL_<ns>_ROUTED_EXPERTS``; a rollout's reference is
``<bucket>/<rollout key>``. Rows are sidecars, not messages: they can pass the NATS max payload,
and the object store chunks them. Writes ride out NATS outages like every durable write.
"""

from __future__ import annotations

import nats.errors
import nats.js.errors
import numpy as np
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.object_store import ObjectStore

from rollmesh.bus.outage import retry_through_outage
from rollmesh.bus.rollout_states import state_key
from rollmesh.messages import check_namespace
from rollmesh.ports import StateStoreError
from rollmesh.rollout.routed_experts import decode_rows, encode_rows, join_turns, rollout_ref


def routed_experts_bucket(namespace: str) -> str:
    return f"RL_{check_namespace(namespace)}_ROUTED_EXPERTS"


class ObjectStoreRoutedExperts:
    def __init__(self, js: JetStreamContext, namespace: str, *, replicas: int = 1,
                 outage_retry_s: float = 60.0) -> None:
        self._js = js
        self.bucket = routed_experts_bucket(namespace)
        self.replicas = replicas
        self.outage_retry_s = outage_retry_s
        self._store: ObjectStore | None = None

    async def save_turn(self, rollout_id: str, turn: int, start: int, rows: np.ndarray) -> str:
        store = await self._bucket()
        key = state_key(rollout_id)
        data = encode_rows(start, rows)
        try:
            await retry_through_outage(lambda: store.put(f"{key}/turn-{turn}", data),
                                       within_s=self.outage_retry_s, what="routed experts put")
        except nats.errors.Error as exc:
            raise StateStoreError(f"cannot store the routed experts of {rollout_id!r}: {exc!r}") from exc
        return rollout_ref(self.bucket, key)

    async def load(self, ref: str) -> np.ndarray:
        """Turns 1, 2, ... until the first missing one (every turn stores its rows)."""
        bucket, _, key = ref.partition("/")
        if bucket != self.bucket:
            raise ValueError(f"{ref!r} is not in {self.bucket}")
        store = await self._bucket()
        turns, turn = [], 1
        while True:
            try:
                result = await store.get(f"{key}/turn-{turn}")
            except nats.js.errors.ObjectNotFoundError:
                break
            turns.append(decode_rows(result.data or b""))
            turn += 1
        return join_turns(turns)

    async def _bucket(self) -> ObjectStore:
        if self._store is None:
            async def open_or_create() -> ObjectStore:
                try:
                    return await self._js.object_store(self.bucket)
                except nats.js.errors.BucketNotFoundError:
                    return await self._js.create_object_store(self.bucket, config=ObjectStoreConfig(
                        bucket=self.bucket, storage=StorageType.FILE, replicas=self.replicas,
                        description="routed-expert rows of MoE rollouts, one object per turn"))
            try:
                self._store = await retry_through_outage(open_or_create, within_s=self.outage_retry_s,
                                                         what="routed experts bucket")
            except nats.errors.Error as exc:
                raise StateStoreError(f"no routed-experts bucket {self.bucket}: {exc!r}") from exc
        return self._store
