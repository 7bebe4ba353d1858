"""The GPU scheduler actor: grants accelerators to roles from config, lends the idle ones to
simulation jobs, and takes them back when RL needs them.

The shell around ``rollmesh.scheduling.gpu_scheduler_logic.GpuSchedulerLogic``. Knows the
scheduling package, the shell and Ray (the job runner actors, the decode workers it places on
loans). The policy is ``LendingScheduler``, the same code ``rollmesh sched simulate`` runs;
``LendingService`` turns NATS events into its calls and its commands into the actions of the Ray
adapters (``rollmesh.scheduling.ray_jobs``):
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

import time
import uuid
from pathlib import Path
from typing import Any

from rollmesh.actors.role_base import RoleActor
from rollmesh.actors.role_memory import ActorRoleMemory, role_lending_refusals, role_workers_of
from rollmesh.actors.sim_job_runner import SimJobRunner
from rollmesh.config import InferenceConfig, ModelConfig, SchedulerConfig, TrainerConfig
from rollmesh.mesh_address import MeshAddress
from rollmesh.messages import GpuGranted
from rollmesh.moved_names import forward_moved_names
from rollmesh.ports import ActorLogic, Publisher
from rollmesh.scheduling.accounting import UtilizationAccount
from rollmesh.scheduling.errors import RoleLendingUnavailableError
from rollmesh.scheduling import gpu_scheduler_logic, ray_jobs
from rollmesh.scheduling.grants import GpuScheduler
from rollmesh.scheduling.lending import LendingScheduler
from rollmesh.scheduling.lending_service import JobLedger, LendingService, whole_start_grants
from rollmesh.scheduling.role_busy import RoleBusyRates
from rollmesh.scheduling.workload import RoleShare

# Deprecated: the logic and the Ray adapters moved into the scheduling package (used here through
# their modules, so these names warn).
__getattr__ = forward_moved_names(__name__, {
    "SchedulerLogic": "rollmesh.scheduling.gpu_scheduler_logic:GpuSchedulerLogic",
    "RL_ROLES": "rollmesh.scheduling.gpu_scheduler_logic",
    "RayJobHandle": "rollmesh.scheduling.ray_jobs",
    "RayJobLauncher": "rollmesh.scheduling.ray_jobs",
    "RoleGrantGroups": "rollmesh.scheduling.ray_jobs",
})


class GpuSchedulerActor(RoleActor):
    role = "gpu_scheduler"
    logic_class = gpu_scheduler_logic.GpuSchedulerLogic

    def __init__(self, name: str, mesh: MeshAddress, config: SchedulerConfig,
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
        self.logic_: gpu_scheduler_logic.GpuSchedulerLogic | None = None

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
                 for role in {*gpu_scheduler_logic.RL_ROLES, *start_grants}}
        launcher = ray_jobs.RayJobLauncher(resource=self.config.resource, jobs_dir=run_dir / "scheduler" / "jobs",
                                  runner_class=SimJobRunner,
                                  visible_devices=role_memory.visible_devices if role_memory else None)
        self.role_groups = ray_jobs.RoleGrantGroups(launcher, prefix=self.mesh.namespace, drain_s=self.config.decode_loan_drain_s,
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
        self.logic_ = gpu_scheduler_logic.GpuSchedulerLogic(self.scheduler, publisher, lending, self.config)
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
