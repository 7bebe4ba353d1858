"""The GPU scheduler actor: grants accelerators to roles from config and publishes the grants.

Knows the scheduling package and the shell; no ray import. Grants are declared counts expressed
as Ray resources, so the whole mesh schedules the same way with zero real GPUs.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from rollmesh.actors.role_base import MeshContext, RoleActor
from rollmesh.ports import ActorLogic, Publisher, Subscription
from rollmesh.config import SchedulerConfig
from rollmesh.messages import GpuGranted
from rollmesh.messages.subjects import GPU_GRANTED
from rollmesh.scheduling.grants import GpuScheduler


class GrantPublisher:
    """Nothing to consume yet (lending and preemption come later): it only announces grants."""

    def __init__(self, scheduler: GpuScheduler, publisher: Publisher) -> None:
        self.scheduler = scheduler
        self.publisher = publisher

    def subscriptions(self) -> list[Subscription]:
        return []

    async def grant(self, holders: dict[str, str]) -> list[GpuGranted]:
        granted = self.scheduler.initial_grants(holders)
        for grant in granted:
            await self.publisher.publish(GPU_GRANTED, grant)
        return granted

    def stats(self) -> dict[str, Any]:
        return {"grants": [grant.grant_id for grant in self.scheduler.grants()]}


class GpuSchedulerActor(RoleActor):
    role = "gpu_scheduler"

    def __init__(self, name: str, mesh: MeshContext, config: SchedulerConfig) -> None:
        super().__init__(name, mesh)
        self.scheduler = GpuScheduler(config, clock=time.time, new_id=lambda: uuid.uuid4().hex)
        self.grants: GrantPublisher | None = None

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        self.grants = GrantPublisher(self.scheduler, publisher)
        return self.grants

    async def grant(self, holders: dict[str, str]) -> list[GpuGranted]:
        assert self.grants is not None, "start() first"
        return await self.grants.grant(holders)

    async def actor_options(self, role: str) -> dict[str, Any]:
        return self.scheduler.actor_options(role)
