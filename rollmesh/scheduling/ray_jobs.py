"""The GPU scheduler's Ray adapters: ``RayJobLauncher`` (the ``JobLauncher`` port: a job attempt
is a runner actor in a placement group of the job's accelerators) and ``RoleGrantGroups`` (the
``RoleGroups`` port: what a role holds beyond its start grant is a placement group per
accelerator, which its extra workers schedule into).

The one module of this package that knows Ray, imported lazily inside each call, so the policy and
``GpuSchedulerLogic`` stay testable without it; the actor (``rollmesh.actors.gpu_scheduler``)
builds these and hands them in. Placement groups use ``scheduler.resource`` ("GPU" on a GPU
cluster, a declared custom resource elsewhere), so Ray itself refuses to place more than the
cluster has.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rollmesh.messages import SimJobSubmitted
from rollmesh.messages.sim_jobs import DECODE_LOAN_HOLDER


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
        if self.group is not None:  # None: the job ran on borrowed devices only
            remove_placement_group(self.group)

    def checkpointed_at(self) -> float | None:
        times = [entry.stat().st_mtime for entry in self.checkpoint_dir.glob("*") if entry.is_file()]
        return max(times, default=None)


class RayJobLauncher:
    """The ``JobLauncher`` port over Ray: each attempt is a ``runner_class`` actor (the actors'
    ``SimJobRunner``, handed in so this package never imports the actors). ``visible_devices``: a
    borrowed device (a role worker's name) -> the CUDA devices that worker sees
    (``ActorRoleMemory.visible_devices``)."""

    def __init__(self, *, resource: str, jobs_dir: Path, runner_class: type,
                 visible_devices: dict[str, str] | None = None) -> None:
        self.resource = resource
        self.runner_class = runner_class
        self.jobs_dir = jobs_dir
        self.visible_devices = visible_devices if visible_devices is not None else {}

    def bundle(self, accelerators: int) -> dict[str, float]:
        return {self.resource: float(accelerators)}

    def actor_resources(self, accelerators: int) -> dict[str, Any]:
        """``.options(...)`` kwargs for an actor using ``accelerators`` of the bundle (Ray refuses
        "GPU" among custom resources: it is ``num_gpus``)."""
        if self.resource == "GPU":
            return {"num_gpus": accelerators}
        return {"resources": self.bundle(accelerators)}

    async def launch(self, job: SimJobSubmitted, *, attempt: int, accelerators: int,
                     borrowed: list[str] = ()) -> RayJobHandle:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # Borrowed devices stay in their role workers' Ray resources: the job uses them outside
        # Ray's accounting (the scheduler guarantees the workers released their memory first).
        free = accelerators - len(borrowed)
        options: dict[str, Any] = {"num_cpus": 0}
        group = None
        if free > 0:
            # One bundle on one node: the job's accelerators are where its process runs. (With
            # borrowed devices too, they are assumed on that node: not checked on a cluster.)
            group = placement_group([self.bundle(free)], strategy="STRICT_PACK")
            await group.ready()
            options |= {**self.actor_resources(free), "scheduling_strategy": PlacementGroupSchedulingStrategy(group)}
        job_dir = self.jobs_dir / job.job_id
        runner = ray.remote(self.runner_class).options(**options).remote(
            job.job_id, job.command, job_dir=str(job_dir), borrowed=list(borrowed),
            borrowed_cuda_devices=[self.visible_devices.get(device, "") for device in borrowed],
            ray_devices=free > 0 and self.resource == "GPU")
        await runner.start.remote(attempt)
        return RayJobHandle(runner, group, job_dir / "checkpoint")


class RoleGrantGroups:
    """The ``RoleGroups`` port over Ray. What roles hold beyond their start grants: a placement group of one accelerator each,
    named by its grant id, which the role's extra workers schedule into. A loan to decode
    ("decode.elastic") also places a decode worker in it, named by the grant id, which rollout
    workers look up and route to; given back, the worker is stopped after ``drain_s`` (the
    routers drop it when the release is announced) and its group removed."""

    def __init__(self, launcher: RayJobLauncher, *, prefix: str, drain_s: float,
                 start_decode_worker: Any = None) -> None:
        self.launcher = launcher
        self.prefix = prefix
        self.drain_s = drain_s
        self.start_decode_worker = start_decode_worker
        self.holdings: dict[str, list[str]] = {}
        self.groups: dict[str, Any] = {}
        self.workers: dict[str, Any] = {}
        self._count = 0

    async def grow(self, holder: str, accelerators: int) -> list[str]:
        from ray.util.placement_group import placement_group

        grant_ids = []
        for _ in range(accelerators):
            grant_id = f"{self.prefix}-{holder.replace('.', '-').replace('/', '-')}-{self._count}"
            self._count += 1
            group = placement_group([self.launcher.bundle(1)], strategy="STRICT_PACK", name=grant_id)
            await group.ready()
            self.groups[grant_id] = group
            if holder == DECODE_LOAN_HOLDER and self.start_decode_worker is not None:
                self.workers[grant_id] = await self.start_decode_worker(grant_id, group)
            self.holdings.setdefault(holder, []).append(grant_id)
            grant_ids.append(grant_id)
        return grant_ids

    def held(self, holder: str) -> list[str]:
        return list(self.holdings.get(holder, []))

    def pick(self, holder: str, accelerators: int) -> list[str]:
        held = self.holdings.get(holder, [])
        picked = held[len(held) - accelerators:][::-1]
        del held[len(held) - len(picked):]
        return picked

    async def release(self, holder: str, grant_ids: list[str]) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        workers = [self.workers.pop(grant_id) for grant_id in grant_ids if grant_id in self.workers]
        if workers:
            await asyncio.sleep(self.drain_s)  # requests already sent there finish meanwhile
            for worker in workers:
                try:
                    await asyncio.wait_for(worker.stop.remote(), 10)
                except Exception:  # noqa: BLE001 - it is killed next anyway
                    pass
                ray.kill(worker)
        for grant_id in grant_ids:
            remove_placement_group(self.groups.pop(grant_id))

    async def close(self) -> None:
        for holder, held in list(self.holdings.items()):
            await self.release(holder, self.pick(holder, len(held)))
