"""MeshStores: the JetStream-backed stores of one namespace, as an actor hands them to its logic.

Knows the store modules of this package and nats-py's JetStream context; nothing of Ray or of a
role's logic. An actor asks its shell for these instead of reaching through the publisher for a
JetStream context: the publisher only publishes, and each store comes built on the shell's
connection with the mesh's replica count. What the logic then sees are the ports'
``RolloutStateStore``, ``RoutedExpertsStore`` and ``TrajectoryStore``.
"""

from __future__ import annotations

from nats.js import JetStreamContext

from rollmesh.bus.last_message import last_message
from rollmesh.bus.rollout_states import KvRolloutStates
from rollmesh.bus.routed_experts_store import ObjectStoreRoutedExperts
from rollmesh.bus.sandbox_leases import KvSandboxLeases
from rollmesh.bus.sandbox_snapshots import ObjectStoreSandboxSnapshots
from rollmesh.bus.trajectory_store import ObjectStoreTrajectories
from rollmesh.messages import WeightsPublished
from rollmesh.messages.subjects import WEIGHTS_PUBLISHED


class MeshStores:
    def __init__(self, js: JetStreamContext, namespace: str, *, replicas: int = 1) -> None:
        self._js = js
        self.namespace = namespace
        self.replicas = replicas

    def rollout_states(self) -> KvRolloutStates:
        return KvRolloutStates(self._js, self.namespace)

    def routed_experts(self) -> ObjectStoreRoutedExperts:
        return ObjectStoreRoutedExperts(self._js, self.namespace, replicas=self.replicas)

    def trajectories(self, *, ttl_s: float | None = None) -> ObjectStoreTrajectories:
        return ObjectStoreTrajectories(self._js, self.namespace, replicas=self.replicas, ttl_s=ttl_s)

    def sandbox_snapshots(self, *, ttl_s: float) -> ObjectStoreSandboxSnapshots:
        return ObjectStoreSandboxSnapshots(self._js, self.namespace, ttl_s=ttl_s, replicas=self.replicas)

    def sandbox_leases(self) -> KvSandboxLeases:
        return KvSandboxLeases(self._js, self.namespace, replicas=self.replicas)

    async def latest_weights(self) -> WeightsPublished | None:
        """The newest weight version the weights stream holds: how a restarted inference worker
        or trainer catches up on what was published while it was down."""
        found = await last_message(self._js, self.namespace, WEIGHTS_PUBLISHED)
        return found if isinstance(found, WeightsPublished) else None
