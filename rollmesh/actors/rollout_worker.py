"""The rollout worker actor: runs agent loops for rollout requests taken from the JetStream queue.

Knows the rollout package, the inference router, the shell and the rollout-state KV store; no ray
import (it receives the prefill/decode actor handles from the launcher).
"""

from __future__ import annotations

from typing import Any

from rollmesh.actors.inference_router import InferenceRouter
from rollmesh.actors.role_base import MeshContext, RoleActor
from rollmesh.bus.publisher import BusPublisher
from rollmesh.bus.rollout_states import KvRolloutStates
from rollmesh.bus.routed_experts_store import ObjectStoreRoutedExperts
from rollmesh.engine.paged_model import describe_served_model
from rollmesh.ports import ActorLogic, Publisher
from rollmesh.config import ModelConfig, RolloutConfig
from rollmesh.rollout.agent_loop import RolloutRunner
from rollmesh.rollout.tasks import TaskRegistry
from rollmesh.sandbox.broker_client import SandboxBrokerClient


class RolloutWorkerActor(RoleActor):
    role = "rollout_worker"
    # A rollout may run for an hour: at stop (`rollmesh down`) it is not waited for but handed
    # back to the work queue at once, to resume from its last saved turn.
    drain_timeout_s = 0.5

    def __init__(self, name: str, mesh: MeshContext, config: RolloutConfig, model_config: ModelConfig,
                 prefill_workers: list[Any], decode_workers: list[Any]) -> None:
        super().__init__(name, mesh)
        self.config = config
        self.model_config = model_config
        self.router = InferenceRouter(prefill_workers, decode_workers)

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        assert isinstance(publisher, BusPublisher), "the shell's publisher is a BusPublisher"
        routes_experts = describe_served_model(self.model_config).routes_experts
        return RolloutRunner(
            self.config, self.model_config, tasks=TaskRegistry.from_import_paths(self.config.tasks),
            engine=self.router, publisher=publisher, worker=self.name,
            # One lease per rollout (token: the rollout id), heartbeated while it runs.
            sandbox=SandboxBrokerClient(publisher),
            # Saved after every turn, so whoever takes over a dead worker's rollout resumes it.
            states=KvRolloutStates(publisher.jetstream, publisher.namespace),
            # MoE models: each turn's routed-expert rows, kept for routing replay in training.
            routed_experts=ObjectStoreRoutedExperts(publisher.jetstream, publisher.namespace,
                                                    replicas=self.mesh.nats.replicas) if routes_experts else None,
        )
