"""Lending a role's own accelerator (``scheduler.lend_role_accelerators``), the whole protocol on
CPU: the live scheduler's logic (``LendingService``) around the real lending core, a real local
engine as the decode role's worker, a fake job launcher (jobs that exit when asked) and a
recording bus. The role goes idle, its engine releases its memory, a job runs on its device; the
role's demand returns, the job is preempted, and only then does the engine resume and serve."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine_models import babbling_model, model_tokenizer, prefer_tokens
from fakes import RecordingPublisher
from rollmesh.config import InferenceConfig, ModelConfig
from rollmesh.engine.errors import MemoryReleasedError
from rollmesh.engine.local_engine import LocalEngine
from rollmesh.messages import RoleDemandChanged, SimJobSubmitted
from rollmesh.messages.subjects import PREEMPTION_REQUESTED, SIM_STARTED
from rollmesh.ports import MessageContext
from rollmesh.scheduling.accounting import UtilizationAccount
from rollmesh.scheduling.lending import LendingScheduler
from rollmesh.scheduling.lending_service import JobLedger, LendingService
from rollmesh.scheduling.workload import RoleShare
from test_scheduling_lending_service import Clock, FakeLauncher, FakeRoleGroups

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

CONTEXT = MessageContext(subject="test")
GREEDY_PROMPT = [5, 6, 7, 8]


class EngineRoleMemory:
    """The decode role's workers: one local engine per device, named by the device. Records
    every call in ``events`` (shared with the launcher's jobs), to check the order."""

    def __init__(self, engines: dict[str, LocalEngine], events: list[str]) -> None:
        self.engines = engines
        self.events = events

    async def release(self, role: str, count: int) -> list[str]:
        idle = [device for device, engine in self.engines.items() if not engine.memory_released][:count]
        for device in idle:
            await self.engines[device].release_memory()
            self.events.append(f"released {device}")
        return idle

    async def resume(self, role: str, devices: list[str]) -> None:
        for device in devices:
            await self.engines[device].resume_memory()
            self.events.append(f"resumed {device}")


class OrderedLauncher(FakeLauncher):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    async def launch(self, job, *, attempt, accelerators, borrowed=()):
        handle = await super().launch(job, attempt=attempt, accelerators=accelerators, borrowed=borrowed)
        self.events.append(f"started {job.job_id} on {list(borrowed)}")
        original = handle.release

        async def release() -> None:
            self.events.append(f"{job.job_id} left")
            await original()

        handle.release = release
        return handle


def engine(model_dir: Path) -> LocalEngine:
    tokenizer = model_tokenizer(model_dir)
    model = prefer_tokens(babbling_model(model_dir), sorted(tokenizer.end_of_turn_ids), by=-100.0)
    return LocalEngine(ModelConfig(path=str(model_dir)), InferenceConfig(max_batch=2), model=model,
                       tokenizer=tokenizer)


async def until(condition, timeout_s: float = 30.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.005)  # the job watchers' ledger writes run in a thread

    await asyncio.wait_for(poll(), timeout_s)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


async def test_an_idle_roles_accelerator_is_lent_and_taken_back_preempt_then_resume(tmp_path, demo_model_dir):
    from rollmesh.messages.base import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    events: list[str] = []
    decode = engine(demo_model_dir)
    memory = EngineRoleMemory({"gpu0": decode}, events)
    launcher = OrderedLauncher(events)
    clock, bus = Clock(), RecordingPublisher()
    # Two accelerators: decode's own (its start grant) and one nobody owns.
    logic = LendingService(
        LendingScheduler(2, role_devices_pinned=True), run_id="ns", roles={"decode": RoleShare(guaranteed=1)},
        start_grants={"decode": 1}, launcher=launcher, role_groups=FakeRoleGroups(), publisher=bus, clock=clock,
        ledger=JobLedger(tmp_path / "jobs.jsonl"), resource="rollmesh_gpu",
        account=UtilizationAccount(2, start=clock.now), role_memory=memory)
    async with decode:
        before = await decode.generate(GREEDY_PROMPT, greedy, request_id="before")
        await logic.start()
        job = dict(command=["sim"], accelerators=1, expected_duration_s=3600.0, grace_s=10.0, checkpoint_s=2.0)
        await logic.handle_submitted(SimJobSubmitted(job_id="on-free", **job), CONTEXT)
        await logic.handle_submitted(SimJobSubmitted(job_id="on-decode", **job), CONTEXT)
        assert [m.job_id for m in bus.messages(SIM_STARTED)] == ["on-free"]  # decode keeps its own

        clock.now += 60
        await logic.handle_demand(RoleDemandChanged(role="decode", accelerators=0), CONTEXT)
        assert events == ["started on-free on []", "released gpu0", "started on-decode on ['gpu0']"]
        with pytest.raises(MemoryReleasedError):
            await decode.generate(GREEDY_PROMPT, greedy, request_id="while-lent")

        clock.now += 600
        await logic.handle_demand(RoleDemandChanged(role="decode", accelerators=1), CONTEXT)
        # The job on decode's device goes, not the other one (which is as cheap to preempt).
        assert [m.holder for m in bus.messages(PREEMPTION_REQUESTED)] == ["on-decode"]
        await until(lambda: "resumed gpu0" in events)
        assert events[3:] == ["on-decode left", "resumed gpu0"]
        after = await decode.generate(GREEDY_PROMPT, greedy, request_id="after")
        assert after.token_ids == before.token_ids
        assert logic.status().jobs == {"on-free": "running", "on-decode": "queued"}
        await logic.close(wait_s=5.0)


async def test_without_role_memory_a_role_keeps_its_start_grant_whatever_it_demands(tmp_path):
    clock, bus = Clock(), RecordingPublisher()
    launcher = FakeLauncher()
    logic = LendingService(
        LendingScheduler(2), run_id="ns", roles={"decode": RoleShare(guaranteed=1)}, start_grants={"decode": 1},
        launcher=launcher, role_groups=FakeRoleGroups(), publisher=bus, clock=clock,
        ledger=JobLedger(tmp_path / "jobs.jsonl"), resource="rollmesh_gpu", account=UtilizationAccount(2, start=clock.now))
    await logic.start()
    await logic.handle_demand(RoleDemandChanged(role="decode", accelerators=0), CONTEXT)
    job = dict(command=["sim"], accelerators=1, expected_duration_s=3600.0)
    await logic.handle_submitted(SimJobSubmitted(job_id="a", **job), CONTEXT)
    await logic.handle_submitted(SimJobSubmitted(job_id="b", **job), CONTEXT)
    assert [m.job_id for m in bus.messages(SIM_STARTED)] == ["a"]
    assert logic.status().roles == {"decode": 1}
    with pytest.raises(ValueError):
        LendingService(LendingScheduler(2), run_id="ns", roles={}, start_grants={}, launcher=launcher,
                       role_groups=FakeRoleGroups(), publisher=bus, clock=clock,
                       ledger=JobLedger(tmp_path / "other.jsonl"), resource="rollmesh_gpu",
                       account=UtilizationAccount(2, start=clock.now), role_memory=object())
    await logic.close(wait_s=1.0)


async def test_the_live_scheduler_refuses_role_lending_naming_what_the_mesh_lacks(tmp_path):
    from rollmesh.actors.gpu_scheduler import GpuSchedulerActor
    from rollmesh.actors.role_base import MeshContext
    from rollmesh.config import SchedulerConfig
    from rollmesh.scheduling import RoleLendingUnavailableError

    mesh = MeshContext(namespace="ns", nats_url="nats://127.0.0.1:1", run_dir=str(tmp_path))
    actor = GpuSchedulerActor("gpu-scheduler", mesh, SchedulerConfig(total_gpus=2, lend_role_accelerators=True))
    with pytest.raises(RoleLendingUnavailableError) as refused:
        await actor.build_logic(RecordingPublisher())
    assert any("release_memory" in missing for missing in refused.value.missing)
