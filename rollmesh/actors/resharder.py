"""The checkpoint resharder actor: CheckpointSaved in, Hugging Face safetensors out
(CheckpointConverted), or CheckpointConversionFailed with the reason when it cannot be.

Knows the checkpoint package and the shell; no ray import. Checkpoint events come from a
JetStream stream, so a checkpoint saved while the resharder is down is converted when it is back.
"""

from __future__ import annotations

from pathlib import Path

from rollmesh.actors.role_base import MeshContext, RoleActor
from rollmesh.ports import ActorLogic, MessageContext, Publisher, Subscription
from rollmesh.checkpoint.resharder import PERMANENT_CONVERSION_ERRORS, CheckpointResharder, conversion_failed
from rollmesh.config import ResharderConfig
from rollmesh.messages import CheckpointSaved
from rollmesh.messages.subjects import CHECKPOINT_CONVERTED, CHECKPOINT_FAILED, CHECKPOINT_SAVED
from rollmesh.telemetry.busy_clock import BusyClock


class ResharderService:
    def __init__(self, resharder: CheckpointResharder, publisher: Publisher,
                 busy: BusyClock | None = None) -> None:
        self.resharder = resharder
        self.publisher = publisher
        self.busy = busy or BusyClock()  # conversions: the resharder's compute

    def subscriptions(self) -> list[Subscription]:
        return [Subscription(CHECKPOINT_SAVED, self.handle_saved, "jetstream", durable="resharder")]

    async def handle_saved(self, message: CheckpointSaved, ctx: MessageContext) -> None:
        try:
            with self.busy.busy():
                converted = await self.resharder.handle_checkpoint_saved(message)
        except PERMANENT_CONVERSION_ERRORS as exc:
            # Retrying cannot help: say why once and settle the event. Write errors (a full
            # disk) are not in the list: they raise, and JetStream redelivers later.
            await self.publisher.publish(CHECKPOINT_FAILED, conversion_failed(message, exc))
            return
        await self.publisher.publish(CHECKPOINT_CONVERTED, converted)


class ResharderActor(RoleActor):
    role = "resharder"
    holds_accelerators = True

    def __init__(self, name: str, mesh: MeshContext, config: ResharderConfig) -> None:
        super().__init__(name, mesh)
        self.config = config

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        export_root = Path(self.mesh.run_dir) / "hf"
        return ResharderService(CheckpointResharder(self.config, export_root=export_root), publisher, self.busy)
