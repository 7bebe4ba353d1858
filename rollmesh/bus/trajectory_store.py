"""Long rollouts' TokenTraces in a JetStream object store: the blobs behind ``trajectory_ref``.

Knows our bucket naming and the blob format (a ``TokenTrace`` as msgpack); the object store
itself is ``object_bucket.ObjectBucket``. Implements ``rollmesh.ports.TrajectoryStore``. Objects
are named ``<rollout key>/<name>`` in the bucket ``RL_<ns>_TRAJECTORIES``, a reference is
``<bucket>/<rollout key>/<name>``. The bucket's TTL (``rollout.trajectory_ttl_s``) removes the
blobs of finished rollouts; see docs/long-trajectories.md for who deletes what, and when.
"""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext

from rollmesh.bus.object_bucket import ObjectBucket
from rollmesh.bus.rollout_states import state_key
from rollmesh.messages import TokenTrace, check_namespace
from rollmesh.ports import TrajectoryLostError

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TokenTrace)


def trajectories_bucket(namespace: str) -> str:
    return f"RL_{check_namespace(namespace)}_TRAJECTORIES"


class ObjectStoreTrajectories:
    def __init__(self, js: JetStreamContext, namespace: str, *, replicas: int = 1,
                 ttl_s: float | None = None, outage_retry_s: float = 60.0) -> None:
        self.objects = ObjectBucket(js, trajectories_bucket(namespace), replicas=replicas, ttl_s=ttl_s,
                                    outage_retry_s=outage_retry_s,
                                    description="token traces of rollouts too long to travel inline")
        self.bucket = self.objects.name

    async def save(self, rollout_id: str, name: str, trace: TokenTrace) -> str:
        key = f"{state_key(rollout_id)}/{name}"
        await self.objects.put(key, _encoder.encode(trace))
        return f"{self.bucket}/{key}"

    async def load(self, ref: str) -> TokenTrace:
        data = await self.objects.get(self._key(ref))
        if data is None:
            raise TrajectoryLostError(ref)
        try:
            return _decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TrajectoryLostError(ref, f"undecodable trajectory ({exc})") from exc

    async def delete(self, ref: str) -> None:
        await self.objects.delete(self._key(ref))

    def _key(self, ref: str) -> str:
        bucket, _, key = ref.partition("/")
        if bucket != self.bucket or not key:
            raise ValueError(f"{ref!r} is not a trajectory in {self.bucket}")
        return key
