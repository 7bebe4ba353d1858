"""The rollout worker actor: runs agent loops for rollout requests taken from the JetStream queue.

Knows the rollout package, the inference router, the shell and the rollout-state KV store. It
receives the mesh's prefill/decode actor handles from the launcher; decode workers the GPU
scheduler lends idle accelerators (decode loans) it looks up by name as their grants arrive
(``RolloutDecodeLoanFollower``, with ``rollmesh.inference.decode_loans.DecodeLoanRoster``), the one place it asks Ray
for a handle.
"""

from __future__ import annotations

from typing import Any

from rollmesh.actors.role_base import MeshContext, RoleActor
from rollmesh.bus.tls import client_tls_context
from rollmesh.engine.paged_model import describe_served_model
from rollmesh.inference.decode_loans import DecodeLoanRoster
from rollmesh.inference.router import InferenceRouter
from rollmesh.bus.errors import BusRequestError
from rollmesh.chat import ChatModel
from rollmesh.messages import GpuGranted, GpuReleased, SchedulerStatusRequest
from rollmesh.messages.subjects import GPU_GRANTED, GPU_RELEASED, SCHED_STATUS
from rollmesh.moved_names import forward_moved_names
from rollmesh.ports import ActorLogic, MessageContext, Publisher, Subscription
from rollmesh.config import ModelConfig, RolloutConfig
from rollmesh.rollout.agent_loop import RolloutRunner
from rollmesh.rollout.tasks import TaskRegistry
from rollmesh.sandbox.broker_client import SandboxBrokerClient


class RolloutDecodeLoanFollower:
    """Keeps a rollout worker's router in step with the GPU scheduler's decode loans: the loan
    events arrive through the shell; at start, the scheduler's status lists the loans made
    before this worker existed."""

    def __init__(self, router: InferenceRouter, publisher: Publisher) -> None:
        self.router = router
        self.publisher = publisher
        self.roster = DecodeLoanRoster(router, ray_actor_by_name)

    def subscriptions(self) -> list[Subscription]:
        return [Subscription(GPU_GRANTED, self.handle_granted, "core"),
                Subscription(GPU_RELEASED, self.handle_released, "core")]

    async def start(self) -> None:
        try:
            status = await self.publisher.request(SCHED_STATUS, SchedulerStatusRequest(), 5.0)
        except BusRequestError:
            return  # no scheduler answering: nothing lent
        await self.roster.reconcile(status.decode_loan_workers)

    async def handle_granted(self, message: GpuGranted, context: MessageContext) -> None:
        await self.roster.granted(message)

    async def handle_released(self, message: GpuReleased, context: MessageContext) -> None:
        self.roster.released(message)


def ray_actor_by_name(name: str) -> Any:
    """A named actor of the caller's own Ray namespace (the mesh's); ValueError when none."""
    import ray

    return ray.get_actor(name)


class RolloutWorkerLogic:
    """The rollout runner, and the follower of decode loans beside it."""

    def __init__(self, runner: RolloutRunner, follower: RolloutDecodeLoanFollower) -> None:
        self.runner = runner
        self.follower = follower

    def subscriptions(self) -> list[Subscription]:
        return self.runner.subscriptions() + self.follower.subscriptions()

    async def start(self) -> None:
        await self.follower.start()

    def stats(self) -> dict[str, Any]:
        return {**self.runner.stats(), "lent_decode_workers": len(self.follower.router.lent_decode_workers())}


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
        self.router = InferenceRouter(prefill_workers, decode_workers,
                                      model_name=describe_served_model(model_config).name)

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        stores = self.shell.stores
        routes_experts = describe_served_model(self.model_config).routes_experts
        runner = RolloutRunner(
            self.config, self.model_config,
            # The model's tokenizer, chat template and tool-call format, loaded once per worker.
            chat=ChatModel.from_config(self.model_config),
            tasks=TaskRegistry.from_import_paths(self.config.tasks),
            engine=self.router, publisher=publisher, worker=self.name,
            # One lease per rollout (token: the rollout id), heartbeated while it runs.
            # Files above the bulk threshold go over the broker's bulk stream, TLS as NATS is.
            sandbox=SandboxBrokerClient(publisher, bulk_tls=client_tls_context(self.mesh.nats_tls)),
            # Saved after every turn, so whoever takes over a dead worker's rollout resumes it.
            states=stores.rollout_states(),
            # MoE models: each turn's routed-expert rows, kept for routing replay in training.
            routed_experts=stores.routed_experts() if routes_experts else None,
            # Long rollouts: traces past rollout.inline_trajectory_bytes, for the completed
            # message and the saved state.
            trajectories=stores.trajectories(ttl_s=self.config.trajectory_ttl_s),
        )
        return RolloutWorkerLogic(runner, RolloutDecodeLoanFollower(self.router, publisher))


# ElasticDecodeFollower was renamed (the feature is "decode loans"); the old name warns for one release.
__getattr__ = forward_moved_names(__name__, {
    "ElasticDecodeFollower": "rollmesh.actors.rollout_worker:RolloutDecodeLoanFollower"})
