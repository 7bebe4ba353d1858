"""The GPU scheduler actor: grants accelerators to roles from config, lends the idle ones to
simulation jobs, and takes them back when RL needs them.

Knows the scheduling package, the shell and Ray (placement groups, the job runners). The policy is
``LendingScheduler``, the same code ``rollmesh sched simulate`` runs; ``LendingService`` turns
NATS events into its calls and its commands into the actions here:
- a job attempt is a ``SimJobRunner`` actor in a placement group of the job's accelerators
  (resource ``scheduler.resource``: "GPU" on a GPU cluster, a declared custom resource
  elsewhere), so Ray itself refuses to place more than the cluster has;
- accelerators granted to a role beyond what its actors hold from the start are a placement group
  too, which the role's extra workers (e.g. a trainer's additional ranks) schedule into, and which
  is removed when the role gives them back.
What the mesh's own actors hold from config (``scheduler.grants``) stays theirs: Ray keeps an
actor's resources for its whole life, so a role's demand never drops below its start grant.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from pathlib import Path
from typing import Any

from rollmesh.actors.role_base import MeshContext, RoleActor
from rollmesh.actors.sim_job_runner import SimJobRunner
from rollmesh.config import SchedulerConfig
from rollmesh.messages import GpuGranted, SimJobSubmitted
from rollmesh.messages.subjects import GPU_GRANTED
from rollmesh.ports import ActorLogic, Publisher, Subscription
from rollmesh.scheduling.accounting import UtilizationAccount
from rollmesh.scheduling.grants import GpuScheduler
from rollmesh.scheduling.lending import LendingScheduler
from rollmesh.scheduling.lending_service import JobLedger, LendingService, whole_start_grants
from rollmesh.scheduling.workload import RoleShare

RL_ROLES = ("trainer", "prefill", "decode", "resharder")


class RayJobHandle:
    """One attempt's runner actor and the placement group it holds."""

    def __init__(self, runner: Any, group: Any, checkpoint_dir: Path) -> None:
        self.runner = runner
        self.group = group
        self.checkpoint_dir = checkpoint_dir

    async def request_preemption(self) -> None:
        await self.runner.request_preemption.remote()

    async def kill(self) -> None:
        await self.runner.kill.remote()

    async def wait(self) -> int:
        return await self.runner.wait.remote()

    async def release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        ray.kill(self.runner)
        remove_placement_group(self.group)

    def checkpointed_at(self) -> float | None:
        times = [entry.stat().st_mtime for entry in self.checkpoint_dir.glob("*") if entry.is_file()]
        return max(times, default=None)


class RayJobLauncher:
    def __init__(self, *, resource: str, jobs_dir: Path) -> None:
        self.resource = resource
        self.jobs_dir = jobs_dir

    def bundle(self, accelerators: int) -> dict[str, float]:
        return {self.resource: float(accelerators)}

    async def launch(self, job: SimJobSubmitted, *, attempt: int, accelerators: int) -> RayJobHandle:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # One bundle on one node: the job's accelerators are where its process runs.
        group = placement_group([self.bundle(accelerators)], strategy="STRICT_PACK")
        await group.ready()
        job_dir = self.jobs_dir / job.job_id
        resources = {"num_gpus": accelerators} if self.resource == "GPU" else {"resources": self.bundle(accelerators)}
        runner = ray.remote(SimJobRunner).options(
            num_cpus=0, **resources, scheduling_strategy=PlacementGroupSchedulingStrategy(group),
        ).remote(job.job_id, job.command, job_dir=str(job_dir))
        await runner.start.remote(attempt)
        return RayJobHandle(runner, group, job_dir / "checkpoint")


class RoleGrantGroups:
    """Placement groups holding what roles were granted beyond their start grants."""

    def __init__(self, launcher: RayJobLauncher) -> None:
        self.launcher = launcher
        self.groups: dict[str, list[tuple[Any, int]]] = {}

    async def grow(self, role: str, accelerators: int) -> None:
        from ray.util.placement_group import placement_group

        group = placement_group([self.launcher.bundle(accelerators)], strategy="STRICT_PACK")
        await group.ready()
        self.groups.setdefault(role, []).append((group, accelerators))

    def shrink(self, role: str, accelerators: int) -> None:
        from ray.util.placement_group import remove_placement_group

        held = self.groups.get(role, [])
        while accelerators > 0 and held:
            group, count = held.pop()
            remove_placement_group(group)
            if count > accelerators:  # give back part of a group: keep the rest as a new one
                asyncio.get_running_loop().create_task(self.grow(role, count - accelerators))
            accelerators -= count


class SchedulerLogic:
    """The actor's logic: start grants (``GpuScheduler``) plus lending (``LendingService``)."""

    def __init__(self, scheduler: GpuScheduler, publisher: Publisher, lending: LendingService,
                 config: SchedulerConfig) -> None:
        self.scheduler = scheduler
        self.publisher = publisher
        self.lending = lending
        self.config = config
        self._timer: asyncio.Task | None = None

    def subscriptions(self) -> list[Subscription]:
        return self.lending.subscriptions()

    async def grant(self, holders: dict[str, str]) -> list[GpuGranted]:
        granted = self.scheduler.initial_grants(holders)
        for grant in granted:
            await self.publisher.publish(GPU_GRANTED, grant)
        return granted

    async def start_lending(self) -> None:
        await self.lending.start()
        self._timer = asyncio.get_running_loop().create_task(self._run_timers())

    async def _run_timers(self) -> None:
        next_report = time.time() + self.config.report_every_s
        while True:
            wakeup = self.lending.next_wakeup()
            now = time.time()
            delay = min(self.config.tick_s, max(0.0, (wakeup or math.inf) - now), max(0.0, next_report - now))
            await asyncio.sleep(delay)
            await self.lending.tick()
            if time.time() >= next_report:
                await self.lending.report()
                next_report = time.time() + self.config.report_every_s

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        await self.lending.close()

    def stats(self) -> dict[str, Any]:
        return {"grants": [grant.grant_id for grant in self.scheduler.grants()],
                "jobs": self.lending.status().jobs}


class GpuSchedulerActor(RoleActor):
    role = "gpu_scheduler"

    def __init__(self, name: str, mesh: MeshContext, config: SchedulerConfig) -> None:
        super().__init__(name, mesh)
        self.config = config
        self.scheduler = GpuScheduler(config, clock=time.time, new_id=lambda: uuid.uuid4().hex)
        self.logic_: SchedulerLogic | None = None

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        run_dir = Path(self.mesh.run_dir)
        start_grants = whole_start_grants(self.config.grants, self.config.total_gpus)
        roles = {role: RoleShare(guaranteed=start_grants.get(role, 0)) for role in {*RL_ROLES, *start_grants}}
        launcher = RayJobLauncher(resource=self.config.resource, jobs_dir=run_dir / "scheduler" / "jobs")
        now = time.time()
        lending = LendingService(
            LendingScheduler(self.config.total_gpus, max_loan_grace_s=self.config.max_loan_grace_s,
                             rl_wait_budget=self.config.rl_wait_budget),
            run_id=self.mesh.namespace, roles=roles, start_grants=start_grants, launcher=launcher,
            role_groups=RoleGrantGroups(launcher), publisher=publisher, clock=time.time,
            ledger=JobLedger(run_dir / "scheduler" / "jobs.jsonl"), resource=self.config.resource,
            account=UtilizationAccount(self.config.total_gpus, start=now))
        self.logic_ = SchedulerLogic(self.scheduler, publisher, lending, self.config)
        await self.logic_.start_lending()
        return self.logic_

    async def stop(self) -> None:
        if self.logic_ is not None:
            await self.logic_.close()
        await super().stop()

    async def grant(self, holders: dict[str, str]) -> list[GpuGranted]:
        assert self.logic_ is not None, "start() first"
        return await self.logic_.grant(holders)

    async def actor_options(self, role: str) -> dict[str, Any]:
        return self.scheduler.actor_options(role)

    async def status(self) -> dict[str, Any]:
        assert self.logic_ is not None, "start() first"
        import msgspec

        return msgspec.to_builtins(self.logic_.lending.status())

