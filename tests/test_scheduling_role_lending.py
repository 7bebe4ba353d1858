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

from support.engine_models import babbling_model, model_tokenizer, prefer_tokens
from support.fakes import RecordingPublisher
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


async def test_the_live_scheduler_refuses_role_lending_where_a_role_cannot_lend_naming_why(tmp_path):
    from rollmesh.actors.gpu_scheduler import GpuSchedulerActor
    from rollmesh.mesh_address import MeshAddress
    from rollmesh.config import SchedulerConfig, TrainerConfig
    from rollmesh.scheduling import RoleLendingUnavailableError

    mesh = MeshAddress(namespace="ns", nats_url="nats://127.0.0.1:1", run_dir=str(tmp_path))
    lending = SchedulerConfig(total_gpus=4, lend_role_accelerators=True,
                              grants={"trainer": 1, "decode": 1, "resharder": 1})
    actor = GpuSchedulerActor("gpu-scheduler", mesh, lending, None, InferenceConfig(backend="sglang"),
                              TrainerConfig(backend="megatron"))
    with pytest.raises(RoleLendingUnavailableError) as refused:
        await actor.build_logic(RecordingPublisher())
    missing = " ".join(refused.value.missing)
    assert "megatron" in missing and "SGLang" in missing and "'resharder'" in missing


def test_role_lending_needs_one_worker_per_accelerator_of_a_lent_role():
    from rollmesh.actors.role_memory import role_lending_refusals, role_workers_of

    workers = role_workers_of(InferenceConfig(num_decode_workers=2))
    assert workers["decode"] == ["decode-0", "decode-1"] and workers["trainer"] == ["trainer"]
    fine = role_lending_refusals({"decode": 2, "prefill": 0}, workers, inference_backend="local",
                                 trainer_backend="torch")
    assert fine == []
    (trainer,) = role_lending_refusals({"trainer": 1}, workers, inference_backend="local", trainer_backend="torch")
    assert "TrainerOffloadedError" in trainer
    (refusal,) = role_lending_refusals({"decode": 1}, workers, inference_backend="local", trainer_backend="torch")
    assert "2 worker(s) on 1 accelerator(s)" in refusal


async def test_the_trainer_actor_lends_the_torch_backends_memory_and_refuses_for_megatron(tmp_path, demo_model_dir):
    from rollmesh.mesh_address import MeshAddress
    from rollmesh.actors.trainer import TrainerActor
    from rollmesh.config import TrainerConfig
    from rollmesh.scheduling import RoleLendingUnavailableError
    from rollmesh.training.torch_backend import TorchTrainerBackend

    mesh = MeshAddress(namespace="ns", nats_url="nats://127.0.0.1:1", run_dir=str(tmp_path))
    model = ModelConfig(path=str(demo_model_dir))
    actor = TrainerActor("trainer", mesh, TrainerConfig(), model)
    actor.backend = TorchTrainerBackend(model, TrainerConfig())
    released = await actor.release_memory()
    assert actor.backend.offloaded and released["bytes_moved"] == 0  # on CPU it lives in host memory
    await actor.resume_memory()
    assert not actor.backend.offloaded
    megatron = TrainerActor("trainer", mesh, TrainerConfig(backend="megatron"), model)
    megatron.backend = object()  # what build_trainer_backend makes for megatron is not a torch backend
    with pytest.raises(RoleLendingUnavailableError, match="megatron"):
        await megatron.release_memory()


def test_a_job_on_borrowed_devices_sees_exactly_them_and_ray_given_ones(tmp_path, monkeypatch):
    from rollmesh.actors.sim_job_runner import SimJobRunner

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # what Ray gave the runner for a free GPU
    borrowed_only = SimJobRunner("j", ["true"], job_dir=str(tmp_path), borrowed=["decode-0", "trainer"],
                                 borrowed_cuda_devices=["2", "3"])
    env = borrowed_only.job_environment(1)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["ROLLMESH_JOB_BORROWED"] == "decode-0,trainer"
    mixed = SimJobRunner("j", ["true"], job_dir=str(tmp_path), borrowed=["decode-0"], borrowed_cuda_devices=["2"],
                         ray_devices=True)
    assert mixed.job_environment(1)["CUDA_VISIBLE_DEVICES"] == "2,5"
    free_only = SimJobRunner("j", ["true"], job_dir=str(tmp_path)).job_environment(1)
    assert free_only["CUDA_VISIBLE_DEVICES"] == "5" and "ROLLMESH_JOB_BORROWED" not in free_only


async def test_a_worker_releasing_its_memory_refuses_new_requests_and_waits_for_accepted_ones():
    from rollmesh.actors.role_memory import MemoryGate

    gate, finish = MemoryGate(), asyncio.Event()

    async def request(request_id: str) -> None:
        with gate.accept(request_id):
            await finish.wait()

    accepted = asyncio.create_task(request("accepted"))
    await asyncio.sleep(0)  # it is in flight
    gate.releasing = True
    with pytest.raises(MemoryReleasedError):
        await request("new")
    drained = asyncio.create_task(gate.wait_idle())
    await asyncio.sleep(0)
    assert not drained.done()  # the accepted request still holds the memory
    finish.set()
    await asyncio.wait_for(asyncio.gather(accepted, drained), 10)
