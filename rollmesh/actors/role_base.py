"""What every role actor shares: where the mesh is, and the start/stop/stats lifecycle.

Knows the actor shell and the config; does not import ray (the launcher applies ``ray.remote`` at
spawn time, so role classes stay plain classes that tests can also run in-process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollmesh.actors.shell import ActorShell
from rollmesh.ports import ActorLogic, Publisher
from rollmesh.config import NatsConfig, TelemetryConfig


@dataclass(frozen=True)
class MeshContext:
    """The slice of the mesh every actor needs: the bus, the namespace, the run directory."""

    namespace: str
    nats_url: str
    run_dir: str
    telemetry: TelemetryConfig = TelemetryConfig()
    nats: NatsConfig = NatsConfig()


class RoleActor:
    """Base for role actors: builds the shell, lets the subclass build its logic, serves it."""

    role = "actor"
    # How long in-flight handlers may finish at stop before they are cancelled (and their
    # JetStream messages handed back).
    drain_timeout_s = 10.0

    def __init__(self, name: str, mesh: MeshContext, *, torch_threads: int | None = None) -> None:
        self.name = name
        self.mesh = mesh
        if torch_threads is not None:
            # Roles running torch share the machine's cores with the rest of the mesh; torch's
            # default of one thread per core makes them fight (imported only where used).
            import torch

            torch.set_num_threads(torch_threads)
        self.shell = ActorShell(
            name, mesh.namespace, mesh.nats_url, run_dir=Path(mesh.run_dir),
            telemetry_config=mesh.telemetry, nats_config=mesh.nats, drain_timeout_s=self.drain_timeout_s,
            component=self.role,
        )
        self.logic: ActorLogic | None = None

    async def start(self) -> str:
        publisher = await self.shell.connect()
        self.logic = await self.build_logic(publisher)
        await self.shell.serve(self.logic)
        return self.name

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        raise NotImplementedError

    async def stop(self) -> None:
        await self.shell.stop()

    async def ready(self) -> bool:
        return self.logic is not None

    async def stats(self) -> dict[str, Any]:
        return self.shell.stats()

    async def pid(self) -> int:
        """This actor's process id (fault-injection tests SIGKILL it)."""
        return os.getpid()
