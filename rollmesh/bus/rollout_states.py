"""The rollout-state KV bucket: one key per rollout, holding its ``RolloutState`` (msgpack).

Knows nats-py's KeyValue API, the bucket's name and our ``RolloutState``; nothing of rollouts'
logic. Implements ``rollmesh.ports.RolloutStateStore``. Writes ride out a NATS outage (a restart,
a cluster failover) like durable publishes do. msgpack rather than JSON: a long rollout's state
is mostly numbers, and msgpack stores them in about half the bytes.
"""

from __future__ import annotations

import hashlib
import re

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from rollmesh.bus.outage import retry_through_outage
from rollmesh.bus.streams import rollout_state_bucket
from rollmesh.messages import RolloutState
from rollmesh.ports import StateStoreError

# What NATS allows in a KV key (and no leading, trailing or doubled dot).
_SAFE_KEY = re.compile(r"^[A-Za-z0-9_=-]+(\.[A-Za-z0-9_=-]+)*$")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RolloutState)


def state_key(rollout_id: str) -> str:
    """The KV key of a rollout: its id when NATS accepts it as a key, else a digest of it."""
    if len(rollout_id) <= 200 and _SAFE_KEY.match(rollout_id) and not rollout_id.startswith("sha256="):
        return rollout_id
    return "sha256=" + hashlib.sha256(rollout_id.encode()).hexdigest()


class KvRolloutStates:
    def __init__(self, js: JetStreamContext, namespace: str, *, outage_retry_s: float = 60.0) -> None:
        self._js = js
        self.bucket = rollout_state_bucket(namespace)
        self.outage_retry_s = outage_retry_s
        self._kv: KeyValue | None = None

    async def load(self, rollout_id: str) -> RolloutState | None:
        kv = await self._bucket()
        try:
            entry = await retry_through_outage(lambda: kv.get(state_key(rollout_id)),
                                               within_s=self.outage_retry_s, what="rollout state get")
        except nats.js.errors.KeyNotFoundError:  # also KeyDeletedError, its subclass
            return None
        except nats.errors.Error as exc:
            raise StateStoreError(f"cannot read the state of {rollout_id!r}: {exc!r}") from exc
        if not entry.value:
            return None
        try:
            return _decoder.decode(entry.value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # Unreadable state is not a reason to lose the request: it runs again from the start.
            raise StateStoreError(f"the saved state of {rollout_id!r} does not decode: {exc}") from exc

    async def save(self, state: RolloutState) -> None:
        kv = await self._bucket()
        data = _encoder.encode(state)
        try:
            await retry_through_outage(lambda: kv.put(state_key(state.rollout_id), data),
                                       within_s=self.outage_retry_s, what="rollout state put")
        except nats.errors.Error as exc:
            raise StateStoreError(f"cannot save the state of {state.rollout_id!r}: {exc!r}") from exc

    async def delete(self, rollout_id: str) -> None:
        kv = await self._bucket()
        try:
            await retry_through_outage(lambda: kv.delete(state_key(rollout_id)),
                                       within_s=self.outage_retry_s, what="rollout state delete")
        except nats.errors.Error as exc:
            raise StateStoreError(f"cannot delete the state of {rollout_id!r}: {exc!r}") from exc

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            try:
                self._kv = await retry_through_outage(lambda: self._js.key_value(self.bucket),
                                                      within_s=self.outage_retry_s, what="rollout state bucket")
            except nats.errors.Error as exc:
                raise StateStoreError(f"no rollout-state bucket {self.bucket}: {exc!r}") from exc
        return self._kv
