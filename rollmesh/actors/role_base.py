"""What every role actor shares: the start/stop/stats lifecycle around its shell.

Each is handed the ``MeshAddress`` (``rollmesh.mesh_address``) with its roles' credentials only.
Knows the actor shell; does not import ray (the launcher applies ``ray.remote`` at
spawn time, so role classes stay plain classes that tests can also run in-process).
"""

from __future__ import annotations

import os
from typing import Any

from rollmesh.actors.shell import ActorShell
from rollmesh.mesh_address import MeshAddress
from rollmesh.moved_names import forward_moved_names
from rollmesh.ports import ActorLogic, Publisher
from rollmesh.telemetry.busy_clock import BusyClock

# Issue 24: one type for where the mesh is.
__getattr__ = forward_moved_names(__name__, {"MeshContext": "rollmesh.mesh_address:MeshAddress"})


class RoleActor:
    """Base for role actors: builds the shell, lets the subclass build its logic, serves it."""

    role = "actor"
    # The plain class this shell serves: ``<Role>Logic`` in the role's domain package
    # (CONTRIBUTING.md, "Roles"); start() refuses a built logic of another class.
    logic_class: type = object
    # Roles that hold accelerators (trainer, prefill, decode, resharder) report how long they
    # compute (``self.busy``): the GPU scheduler's busy time for what RL holds.
    holds_accelerators = False
    # How long in-flight handlers may finish at stop before they are cancelled (and their
    # JetStream messages handed back).
    drain_timeout_s = 10.0

    def __init__(self, name: str, mesh: MeshAddress, *, torch_threads: int | None = None) -> None:
        self.name = name
        self.mesh = mesh
        if torch_threads is not None:
            # Roles running torch share the machine's cores with the rest of the mesh; torch's
            # default of one thread per core makes them fight (imported only where used).
            import torch

            torch.set_num_threads(torch_threads)
        self.shell = ActorShell(name, mesh, drain_timeout_s=self.drain_timeout_s, component=self.role)
        self.logic: ActorLogic | None = None
        self.busy = BusyClock()

    async def start(self) -> str:
        publisher = await self.shell.connect()
        if self.holds_accelerators:
            self.busy.report_as(self.role)
        logic = await self.build_logic(publisher)
        if not isinstance(logic, self.logic_class):
            raise TypeError(f"{type(self).__name__} built a {type(logic).__name__}, "
                            f"not its {self.logic_class.__name__}")
        self.logic = logic
        await self.shell.serve(logic)
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
