"""The checkpoint resharder actor: the shell around ``rollmesh.checkpoint.resharder.ResharderLogic``
(CheckpointSaved in, Hugging Face safetensors out).

Knows the checkpoint package and the shell; no ray import. Checkpoint events come from a
JetStream stream, so a checkpoint saved while the resharder is down is converted when it is back.
"""

from __future__ import annotations

from pathlib import Path

from rollmesh.actors.role_base import RoleActor
from rollmesh.checkpoint.resharder import ResharderLogic
from rollmesh.config import ResharderConfig
from rollmesh.mesh_address import MeshAddress
from rollmesh.moved_names import forward_moved_names
from rollmesh.ports import ActorLogic, Publisher

# Deprecated: the service was merged into the checkpoint package's resharder as the role's logic.
__getattr__ = forward_moved_names(__name__, {"ResharderService": "rollmesh.checkpoint.resharder:ResharderLogic"})


class ResharderActor(RoleActor):
    role = "resharder"
    logic_class = ResharderLogic
    holds_accelerators = True

    def __init__(self, name: str, mesh: MeshAddress, config: ResharderConfig) -> None:
        super().__init__(name, mesh)
        self.config = config

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        export_root = Path(self.mesh.run_dir) / "hf"
        return ResharderLogic(self.config, export_root=export_root, publisher=publisher, busy=self.busy)
