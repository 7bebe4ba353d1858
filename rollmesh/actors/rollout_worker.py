"""The rollout worker actor: the shell around ``rollmesh.rollout.agent_loop.RolloutWorkerLogic``,
which runs agent loops for rollout requests taken from the JetStream queue.

Knows the rollout package, the inference router, the shell and the namespace's stores (rollout
state KV, routed experts, trajectories: ``self.shell.stores``). It receives the mesh's prefill/decode actor handles from the
launcher; decode workers the GPU scheduler lends idle accelerators (decode loans) it looks up
by name as their grants arrive (``ray_actor_by_name``, handed to the logic's
``rollmesh.rollout.decode_loan_follower.RolloutDecodeLoanFollower``), the one place it asks Ray for a handle.
"""

from __future__ import annotations

from typing import Any

from rollmesh.actors.role_base import RoleActor
from rollmesh.bus.tls import client_tls_context
from rollmesh.engine.served_model import describe_served_model
from rollmesh.inference.router import InferenceRouter
from rollmesh.chat import ChatModel
from rollmesh.config import ModelConfig, RolloutConfig
from rollmesh.mesh_address import MeshAddress
from rollmesh.moved_names import forward_moved_names
from rollmesh.ports import ActorLogic, Publisher
from rollmesh.rollout import agent_loop, decode_loan_follower
from rollmesh.rollout.tasks import TaskRegistry
from rollmesh.sandbox.broker_client import SandboxBrokerClient
from rollmesh.sandbox_config import SandboxConfig

# Deprecated: the logic (merged with the rollout package's RolloutRunner) and the loan follower
# moved into the rollout package (used here through their modules, so these names warn).
__getattr__ = forward_moved_names(__name__, {
    "RolloutWorkerLogic": "rollmesh.rollout.agent_loop",
    "ElasticDecodeFollower": "rollmesh.rollout.decode_loan_follower:RolloutDecodeLoanFollower",
})


def ray_actor_by_name(name: str) -> Any:
    """A named actor of the caller's own Ray namespace (the mesh's); ValueError when none."""
    import ray

    return ray.get_actor(name)


class RolloutWorkerActor(RoleActor):
    role = "rollout_worker"
    logic_class = agent_loop.RolloutWorkerLogic
    # A rollout may run for an hour: at stop (`rollmesh down`) it is not waited for but handed
    # back to the work queue at once, to resume from its last saved turn.
    drain_timeout_s = 0.5

    def __init__(self, name: str, mesh: MeshAddress, config: RolloutConfig, model_config: ModelConfig,
                 prefill_workers: list[Any], decode_workers: list[Any],
                 sandbox: SandboxConfig = SandboxConfig()) -> None:
        super().__init__(name, mesh)
        self.config = config
        self.sandbox_config = sandbox
        self.model_config = model_config
        self.router = InferenceRouter(prefill_workers, decode_workers,
                                      model_name=describe_served_model(model_config).name)

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        stores = self.shell.stores
        routes_experts = describe_served_model(self.model_config).routes_experts
        return agent_loop.RolloutWorkerLogic(
            self.config, self.model_config,
            # The model's tokenizer, chat template and tool-call format, loaded once per worker.
            chat=ChatModel.from_config(self.model_config),
            tasks=TaskRegistry.from_import_paths(self.config.tasks),
            engine=self.router, publisher=publisher, worker=self.name,
            # One lease per rollout (token: the rollout id), heartbeated while it runs.
            # Files above the bulk threshold go over the broker's bulk stream, TLS as NATS is.
            sandbox=SandboxBrokerClient.from_config(publisher, self.sandbox_config,
                                                    bulk_tls=client_tls_context(self.mesh.nats_tls)),
            # Saved after every turn, so whoever takes over a dead worker's rollout resumes it.
            states=stores.rollout_states(),
            # MoE models: each turn's routed-expert rows, kept for routing replay in training.
            routed_experts=stores.routed_experts() if routes_experts else None,
            # Long rollouts: traces past rollout.inline_trajectory_bytes, for the completed
            # message and the saved state.
            trajectories=stores.trajectories(ttl_s=self.config.trajectory_ttl_s),
            decode_loans=decode_loan_follower.RolloutDecodeLoanFollower(self.router, publisher, ray_actor_by_name),
        )
