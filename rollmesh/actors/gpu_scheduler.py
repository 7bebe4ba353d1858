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
actor's resources for its whole life, so by default a role's demand never drops below its start
grant. With ``scheduler.lend_role_accelerators`` an idle role's own accelerators are lent too: its
workers release their memory (``role_memory.ActorRoleMemory``, the ``RoleMemory`` port) and a job
runs on their devices outside Ray's accounting (the workers keep the resource), its
``CUDA_VISIBLE_DEVICES`` naming them. Layouts that cannot do that are refused at start with
``RoleLendingUnavailableError`` naming why (``role_lending_refusals``).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from pathlib import Path
from typing import Any

from rollmesh.actors.role_base import MeshContext, RoleActor
from rollmesh.actors.role_memory import ActorRoleMemory, role_lending_refusals, role_workers_of
from rollmesh.actors.sim_job_runner import SimJobRunner
from rollmesh.config import InferenceConfig, ModelConfig, SchedulerConfig, TrainerConfig
from rollmesh.messages import GpuGranted, SchedulerStatus, SimJobSubmitted
from rollmesh.messages.sim_jobs import DECODE_LOAN_HOLDER
from rollmesh.messages.subjects import GPU_GRANTED
from rollmesh.ports import ActorLogic, Publisher, Subscription
from rollmesh.scheduling.accounting import UtilizationAccount
from rollmesh.scheduling.errors import RoleLendingUnavailableError
from rollmesh.scheduling.grants import GpuScheduler
from rollmesh.scheduling.lending import LendingScheduler
from rollmesh.scheduling.lending_service import JobLedger, LendingService, whole_start_grants
from rollmesh.scheduling.role_busy import RoleBusyRates
from rollmesh.scheduling.workload import RoleShare
from rollmesh.telemetry import metrics, metrics_catalog

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
        if self.group is not None:  # None: the job ran on borrowed devices only
            remove_placement_group(self.group)

    def checkpointed_at(self) -> float | None:
        times = [entry.stat().st_mtime for entry in self.checkpoint_dir.glob("*") if entry.is_file()]
        return max(times, default=None)


class RayJobLauncher:
    """``visible_devices``: a borrowed device (a role worker's name) -> the CUDA devices that
    worker sees (``ActorRoleMemory.visible_devices``)."""

    def __init__(self, *, resource: str, jobs_dir: Path, visible_devices: dict[str, str] | None = None) -> None:
        self.resource = resource
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
        runner = ray.remote(SimJobRunner).options(**options).remote(
            job.job_id, job.command, job_dir=str(job_dir), borrowed=list(borrowed),
            borrowed_cuda_devices=[self.visible_devices.get(device, "") for device in borrowed],
            ray_devices=free > 0 and self.resource == "GPU")
        await runner.start.remote(attempt)
        return RayJobHandle(runner, group, job_dir / "checkpoint")


class RoleGrantGroups:
    """What roles hold beyond their start grants: a placement group of one accelerator each,
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


class SchedulerLogic:
    """The actor's logic: start grants (``GpuScheduler``) plus lending (``LendingService``)."""

    def __init__(self, scheduler: GpuScheduler, publisher: Publisher, lending: LendingService,
                 config: SchedulerConfig) -> None:
        self.scheduler = scheduler
        self.publisher = publisher
        self.lending = lending
        self.config = config
        self._timer: asyncio.Task | None = None
        _observe_accelerators(self)

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

    def __init__(self, name: str, mesh: MeshContext, config: SchedulerConfig,
                 model_config: ModelConfig | None = None, inference_config: InferenceConfig | None = None,
                 trainer_config: TrainerConfig | None = None, role_workers: dict[str, list[str]] | None = None,
                 ) -> None:
        """``trainer_config`` and ``role_workers`` (each role's worker actors' names; default: the
        launcher's) matter only with ``scheduler.lend_role_accelerators``."""
        super().__init__(name, mesh)
        self.config = config
        # What a lent decode worker serves (decode loans); None: no decode loans.
        self.model_config = model_config
        self.inference_config = inference_config
        self.trainer_config = trainer_config
        self.role_workers = role_workers if role_workers is not None else role_workers_of(inference_config)
        self.scheduler = GpuScheduler(config, clock=time.time, new_id=lambda: uuid.uuid4().hex)
        self.logic_: SchedulerLogic | None = None

    async def build_logic(self, publisher: Publisher) -> ActorLogic:
        run_dir = Path(self.mesh.run_dir)
        start_grants = whole_start_grants(self.config.grants, self.config.total_gpus)
        role_memory = None
        if self.config.lend_role_accelerators:
            refusals = role_lending_refusals(
                start_grants, self.role_workers,
                inference_backend=self.inference_config.backend if self.inference_config else "local",
                trainer_backend=self.trainer_config.backend if self.trainer_config else None)
            if refusals:
                raise RoleLendingUnavailableError(refusals)
            # The role workers live in the Ray job's namespace (the launcher's), found when lent.
            role_memory = ActorRoleMemory(self.role_workers)
        elastic = self.config.decode_loans if self.model_config is not None else 0
        roles = {role: RoleShare(guaranteed=start_grants.get(role, 0), elastic_limit=elastic if role == "decode" else 0)
                 for role in {*RL_ROLES, *start_grants}}
        launcher = RayJobLauncher(resource=self.config.resource, jobs_dir=run_dir / "scheduler" / "jobs",
                                  visible_devices=role_memory.visible_devices if role_memory else None)
        self.role_groups = RoleGrantGroups(launcher, prefix=self.mesh.namespace,
                                           drain_s=self.config.decode_loan_drain_s,
                                           start_decode_worker=self._start_decode_worker if elastic else None)
        now = time.time()
        lending = LendingService(
            LendingScheduler(self.config.total_gpus, max_loan_grace_s=self.config.max_loan_grace_s,
                             rl_wait_budget=self.config.rl_wait_budget,
                             role_devices_pinned=role_memory is not None),
            run_id=self.mesh.namespace, roles=roles, start_grants=start_grants, launcher=launcher,
            role_groups=self.role_groups, publisher=publisher, clock=time.time,
            ledger=JobLedger(run_dir / "scheduler" / "jobs.jsonl"), resource=self.config.resource,
            account=UtilizationAccount(self.config.total_gpus, start=now),
            # A process unheard of for three snapshot intervals no longer says how busy its role is.
            busy_rates=RoleBusyRates(stale_s=3 * self.mesh.telemetry.metrics_report_s), role_memory=role_memory)
        self.logic_ = SchedulerLogic(self.scheduler, publisher, lending, self.config)
        await self.logic_.start_lending()
        return self.logic_

    async def _start_decode_worker(self, name: str, group: Any) -> Any:
        """A decode worker in ``group``, named ``name``, started (it loads the latest weights)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rollmesh.actors.inference_workers import DecodeWorkerActor

        worker = ray.remote(DecodeWorkerActor).options(
            name=name, num_cpus=0, **self.role_groups.launcher.actor_resources(1),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group),
        ).remote(name, self.mesh, self.model_config, self.inference_config)
        await worker.start.remote()
        return worker

    async def stop(self) -> None:
        if self.logic_ is not None:
            await self.logic_.close()
            await self.role_groups.close()
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


class _StatusPerCollection:
    """The scheduler's status, made once per metrics collection rather than once per metric: a
    collection runs the observers back to back, so a status younger than ``FRESH_S`` is reused."""

    FRESH_S = 0.5

    def __init__(self) -> None:
        self._status: SchedulerStatus | None = None
        self._made_at = -math.inf

    def __call__(self, logic: SchedulerLogic) -> SchedulerStatus:
        now = time.monotonic()
        if self._status is None or now - self._made_at > self.FRESH_S:
            self._status, self._made_at = logic.lending.status(), now
        return self._status


def _observe_accelerators(logic: SchedulerLogic) -> None:
    """Capacity, grants by holder and the utilization figures, read at every metrics collection."""
    status = _StatusPerCollection()
    metrics.observe(metrics_catalog.ACCELERATORS_CAPACITY, logic, lambda lg: [(status(lg).capacity, {})])
    metrics.observe(metrics_catalog.ACCELERATORS_ALLOCATED, logic, lambda lg: [  # every RL role, 0 too
        (count, {"holder": holder})
        for holder, count in ({role: 0 for role in RL_ROLES} | status(lg).roles).items()])
    # Fractions, and the cumulative totals of the scheduler's accounting (observable counters).
    for spec, field in ((metrics_catalog.ACCELERATOR_ALLOCATED_FRACTION, "allocated_utilization"),
                        (metrics_catalog.ACCELERATOR_BUSY_FRACTION, "busy_utilization"),
                        (metrics_catalog.PREEMPTIONS, "preemptions"), (metrics_catalog.PREEMPTION_KILLS, "kills"),
                        (metrics_catalog.PREEMPTION_LOST, "lost_accelerator_s"),
                        (metrics_catalog.RL_QUEUEING, "rl_queueing_s")):
        metrics.observe(spec, logic, lambda lg, field=field: [(getattr(status(lg), field), {})])
