"""Routed-expert rows of MoE rollouts in a JetStream object store, one object per turn.

Knows our bucket naming and the blob format of ``rollmesh.routed_expert_rows``; the object
store itself is ``object_bucket.ObjectBucket``. Implements ``rollmesh.ports.RoutedExpertsStore``.
Objects are named ``<rollout key>/turn-<n>`` in the bucket ``RL_<ns>_ROUTED_EXPERTS``; a rollout's
reference is ``<bucket>/<rollout key>``.
"""

from __future__ import annotations

import numpy as np
from nats.js import JetStreamContext

from rollmesh.bus.object_bucket import ObjectBucket
from rollmesh.bus.rollout_states import state_key
from rollmesh.messages import check_namespace
from rollmesh.routed_expert_rows import decode_rows, encode_rows, join_turns, rollout_ref


def routed_experts_bucket(namespace: str) -> str:
    return f"RL_{check_namespace(namespace)}_ROUTED_EXPERTS"


class ObjectStoreRoutedExperts:
    def __init__(self, js: JetStreamContext, namespace: str, *, replicas: int = 1,
                 outage_retry_s: float = 60.0) -> None:
        self.objects = ObjectBucket(js, routed_experts_bucket(namespace), replicas=replicas,
                                    outage_retry_s=outage_retry_s,
                                    description="routed-expert rows of MoE rollouts, one object per turn")
        self.bucket = self.objects.name

    async def save_turn(self, rollout_id: str, turn: int, start: int, rows: np.ndarray) -> str:
        key = state_key(rollout_id)
        await self.objects.put(f"{key}/turn-{turn}", encode_rows(start, rows))
        return rollout_ref(self.bucket, key)

    async def load(self, ref: str) -> np.ndarray:
        """Turns 1, 2, ... until the first missing one (every turn stores its rows)."""
        bucket, _, key = ref.partition("/")
        if bucket != self.bucket:
            raise ValueError(f"{ref!r} is not in {self.bucket}")
        turns, turn = [], 1
        while (data := await self.objects.get(f"{key}/turn-{turn}")) is not None:
            turns.append(decode_rows(data))
            turn += 1
        return join_turns(turns)
