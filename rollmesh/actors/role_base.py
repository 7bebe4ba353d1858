"""What every role actor shares: where the mesh is, and the start/stop/stats lifecycle.

Knows the actor shell and the config; does not import ray (the launcher applies ``ray.remote`` at
spawn time, so role classes stay plain classes that tests can also run in-process).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rollmesh.actors.shell import ActorShell
from rollmesh.bus.errors import BusSecurityError
from rollmesh.bus.permissions import ACTOR_ROLES
from rollmesh.bus.security import BusCredentials
from rollmesh.ports import ActorLogic, Publisher
from rollmesh.config import NatsConfig, NatsTlsConfig, TelemetryConfig
from rollmesh.telemetry.busy_clock import BusyClock


@dataclass(frozen=True)
class MeshContext:
    """The slice of the mesh every actor needs: the bus, the namespace, the run directory."""

    namespace: str
    nats_url: str
    run_dir: str
    telemetry: TelemetryConfig = TelemetryConfig()
    nats: NatsConfig = NatsConfig()
    # security.enabled: NATS role -> credentials (paths and variable names, no secrets); each
    # actor is handed only the roles it connects as (``only``). Empty: an open NATS.
    credentials: Mapping[str, BusCredentials] = field(default_factory=dict)
    nats_tls: NatsTlsConfig = NatsTlsConfig()

    def only(self, *roles: str) -> MeshContext:
        """This context with the credentials of ``roles`` only."""
        return replace(self, credentials={r: c for r, c in self.credentials.items() if r in roles})

    def credentials_for(self, actor_role: str) -> BusCredentials | None:
        """The credentials an actor of ``actor_role`` connects with (None: an open NATS)."""
        if not self.credentials:
            return None
        role = ACTOR_ROLES.get(actor_role, actor_role)
        found = self.credentials.get(role)
        if found is None:
            raise BusSecurityError("no NATS credentials handed to this actor", role=role)
        return found


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
            component=self.role, credentials=mesh.credentials_for(self.role), tls_config=mesh.nats_tls,
        )
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
