"""The live scheduler's logic (``LendingService``) around the real lending core, with a fake job
launcher (jobs that exit when told), a recording bus and a hand-driven clock: the preemption
protocol on the wire, kills at the deadline, rejections, the job ledger across a restart."""

from __future__ import annotations

import asyncio

import pytest

from support.fakes import RecordingPublisher
from support.waiting import wait_until
from rollmesh.messages import RoleDemandChanged, RunRegistered, SimJobSubmitted
from rollmesh.messages.subjects import (
    GPU_GRANTED,
    GPU_RELEASED,
    PREEMPTION_ACKNOWLEDGED,
    PREEMPTION_REQUESTED,
    SIM_ENDED,
    SIM_STARTED,
)
from rollmesh.ports import MessageContext
from rollmesh.scheduling.accounting import UtilizationAccount
from rollmesh.scheduling.lending import LendingScheduler
from rollmesh.scheduling.lending_service import JobLedger, LendingService, whole_start_grants
from rollmesh.scheduling.workload import RoleShare

pytestmark = pytest.mark.unit


class FakeJob:
    """A job process: exits 0 when asked to leave (unless it ignores that), -9 when killed."""

    def __init__(self, job: SimJobSubmitted, attempt: int, *, honours: bool) -> None:
        self.job, self.attempt, self.honours = job, attempt, honours
        self.exit_code: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.asked = self.killed = self.released = False

    async def request_preemption(self) -> None:
        self.asked = True
        if self.honours:
            self.exit_code.set_result(0)

    async def kill(self) -> None:
        self.killed = True
        if not self.exit_code.done():
            self.exit_code.set_result(-9)

    async def wait(self) -> int:
        # Shielded: a waiter cancelled (the service closing) does not end the process.
        return await asyncio.shield(self.exit_code)

    async def release(self) -> None:
        self.released = True

    def checkpointed_at(self) -> float | None:
        return None

    def finish(self, code: int = 0) -> None:
        self.exit_code.set_result(code)


class FakeLauncher:
    def __init__(self, ignoring: set[str] = frozenset()) -> None:
        self.ignoring = ignoring
        self.launched: list[FakeJob] = []

    async def launch(self, job: SimJobSubmitted, *, attempt: int, accelerators: int,
                     borrowed: list[str] = ()) -> FakeJob:
        assert accelerators == job.accelerators
        handle = FakeJob(job, attempt, honours=job.job_id not in self.ignoring)
        handle.borrowed = list(borrowed)
        self.launched.append(handle)
        return handle


class FakeRoleGroups:
    def __init__(self) -> None:
        self.held_ids: dict[str, list[str]] = {}
        self.released: list[str] = []
        self._count = 0

    async def grow(self, holder: str, accelerators: int) -> list[str]:
        ids = [f"{holder}-{self._count + i}" for i in range(accelerators)]
        self._count += accelerators
        self.held_ids.setdefault(holder, []).extend(ids)
        return ids

    def pick(self, holder: str, accelerators: int) -> list[str]:
        held = self.held_ids[holder]
        picked, self.held_ids[holder] = held[len(held) - accelerators:][::-1], held[:len(held) - accelerators]
        return picked

    async def release(self, holder: str, grant_ids: list[str]) -> None:
        self.released.extend(grant_ids)

    def held(self, holder: str) -> list[str]:
        return list(self.held_ids.get(holder, []))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def service(tmp_path, *, launcher=None, start_grants=None, capacity=4, elastic=0):
    clock = Clock()
    start_grants = {"decode": 1} if start_grants is None else start_grants
    roles = {"trainer": RoleShare(guaranteed=2),
             "decode": RoleShare(guaranteed=start_grants.get("decode", 0), elastic_limit=elastic)}
    bus = RecordingPublisher()
    logic = LendingService(LendingScheduler(capacity), run_id="ns", roles=roles, start_grants=start_grants,
                           launcher=launcher or FakeLauncher(), role_groups=FakeRoleGroups(), publisher=bus,
                           clock=clock, ledger=JobLedger(tmp_path / "jobs.jsonl"), resource="rollmesh_gpu",
                           account=UtilizationAccount(capacity, start=clock.now))
    return logic, bus, clock


def job(job_id: str, accelerators: int = 2, **fields) -> SimJobSubmitted:
    return SimJobSubmitted(job_id=job_id, command=["sim"], accelerators=accelerators, expected_duration_s=3600.0,
                           **{"grace_s": 10.0, "checkpoint_s": 2.0, **fields})


CONTEXT = MessageContext(subject="test")


async def settle(logic: LendingService, *, running: int = 0) -> None:
    """Until the watchers of the jobs that exited have done their work (ledger writes in a thread,
    then messages and grants) and only the ``running`` jobs' watchers remain."""
    await wait_until(lambda: len(logic._watchers) == running, f"{running} job watchers left")


async def test_a_job_on_idle_accelerators_is_preempted_when_the_trainer_asks_and_runs_again_later(tmp_path):
    launcher = FakeLauncher()
    logic, bus, clock = service(tmp_path, launcher=launcher, capacity=3)
    await logic.start()
    await logic.handle_submitted(job("md-1"), CONTEXT)  # decode holds 1 of 3: the 2 idle are lent
    assert [m.job_id for m in bus.messages(SIM_STARTED)] == ["md-1"]

    clock.now += 60
    await logic.handle_demand(RoleDemandChanged(role="trainer", accelerators=2), CONTEXT)
    [request] = bus.messages(PREEMPTION_REQUESTED)
    assert request.holder == "md-1" and request.deadline == clock.now + 10.0 and launcher.launched[0].asked
    assert not bus.messages(GPU_GRANTED), "the trainer is granted only once the job has left"
    await settle(logic)
    assert [m.holder for m in bus.messages(PREEMPTION_ACKNOWLEDGED)] == ["md-1"]
    assert [(m.outcome, m.attempt) for m in bus.messages(SIM_ENDED)] == [("preempted", 1)]
    assert [(m.role, m.count) for m in bus.messages(GPU_GRANTED)] == [("trainer", 1), ("trainer", 1)]
    assert launcher.launched[0].released
    assert logic.status().jobs == {"md-1": "queued"}

    clock.now += 600
    await logic.handle_demand(RoleDemandChanged(role="trainer", accelerators=0), CONTEXT)
    assert [m.count for m in bus.messages(GPU_RELEASED)] == [1, 1]
    assert [(m.job_id, m.attempt) for m in bus.messages(SIM_STARTED)] == [("md-1", 1), ("md-1", 2)]
    launcher.launched[1].finish(0)
    await settle(logic)
    assert bus.messages(SIM_ENDED)[-1].outcome == "finished" and logic.status().jobs == {}
    status = logic.status()
    assert status.preemptions == 1 and 0 < status.allocated_utilization <= 1


async def test_a_job_that_ignores_the_request_is_killed_at_the_deadline_not_before(tmp_path):
    launcher = FakeLauncher(ignoring={"stubborn"})
    logic, bus, clock = service(tmp_path, launcher=launcher, capacity=3)
    await logic.start()
    await logic.handle_submitted(job("stubborn"), CONTEXT)
    await logic.handle_demand(RoleDemandChanged(role="trainer", accelerators=2), CONTEXT)
    [request] = bus.messages(PREEMPTION_REQUESTED)
    clock.now = request.deadline - 0.5
    await logic.tick()
    assert not launcher.launched[0].killed  # the grace period is honoured
    assert logic.next_wakeup() == request.deadline
    clock.now = request.deadline
    await logic.tick()
    await settle(logic)
    assert launcher.launched[0].killed
    assert [m.outcome for m in bus.messages(SIM_ENDED)] == ["killed"]
    assert [m.role for m in bus.messages(GPU_GRANTED)] == ["trainer", "trainer"]
    assert logic.status().kills == 1 and logic.status().jobs == {"stubborn": "queued"}


async def test_a_job_that_cannot_run_gets_a_rejection_with_its_reason_and_costs_nothing(tmp_path):
    logic, bus, _ = service(tmp_path)
    await logic.start()
    await logic.handle_submitted(job("huge", accelerators=9), CONTEXT)
    await logic.handle_submitted(job("md-1"), CONTEXT)
    await logic.handle_submitted(job("md-1"), CONTEXT)  # a redelivery: nothing new
    await logic.handle_submitted(job("md-1", accelerators=1), CONTEXT)  # another job, same id
    ended = bus.messages(SIM_ENDED)
    assert [(m.job_id, m.outcome) for m in ended] == [("huge", "rejected"), ("md-1", "rejected")]
    assert "9 of 4" in ended[0].reason and "id" in ended[1].reason
    assert [m.job_id for m in bus.messages(SIM_STARTED)] == ["md-1"]


async def test_a_restarted_scheduler_runs_the_unfinished_jobs_of_its_ledger_again(tmp_path):
    first, _, _ = service(tmp_path)
    await first.start()
    await first.handle_submitted(job("done"), CONTEXT)
    await first.handle_submitted(job("running", accelerators=1), CONTEXT)
    first.launcher.launched[0].finish(0)
    await settle(first, running=1)
    # The process dies here: "running" never ended. Its successor reads the ledger.
    launcher = FakeLauncher()
    second, bus, _ = service(tmp_path, launcher=launcher)
    await second.start()
    assert [(h.job.job_id, h.attempt) for h in launcher.launched] == [("running", 1)]
    assert [m.job_id for m in bus.messages(SIM_STARTED)] == ["running"]


async def test_a_roles_demand_never_drops_below_what_its_own_actors_hold(tmp_path):
    logic, bus, _ = service(tmp_path, start_grants={"decode": 2})
    await logic.start()
    await logic.handle_demand(RoleDemandChanged(role="decode", accelerators=0), CONTEXT)
    await logic.handle_submitted(job("md-1", accelerators=3), CONTEXT)  # would need decode's
    assert not bus.messages(SIM_STARTED) and not bus.messages(GPU_RELEASED)
    assert logic.status().roles == {"decode": 2}


async def test_idle_accelerators_are_lent_to_decode_and_announced_gone_before_a_job_gets_them(tmp_path):
    logic, bus, _ = service(tmp_path, elastic=2, capacity=3)  # decode 1 of 3: 2 idle
    await logic.start()
    assert [(m.holder, m.count) for m in bus.messages(GPU_GRANTED)] == [("decode.elastic", 1)] * 2
    assert logic.status().roles == {"decode": 1, "decode.elastic": 2}
    assert logic.status().decode_loan_workers == [m.grant_id for m in bus.messages(GPU_GRANTED)]
    groups = logic.role_groups
    await logic.handle_submitted(job("md-1"), CONTEXT)
    released = [m.grant_id for m in bus.messages(GPU_RELEASED)]
    assert released == groups.released and len(released) == 2  # announced, then taken back
    assert [m.job_id for m in bus.messages(SIM_STARTED)] == ["md-1"]
    published = [subject for subject, _ in bus.published]
    assert published.index(GPU_RELEASED) < published.index(SIM_STARTED)


async def test_a_second_run_shares_the_accelerators_beyond_the_guarantees_by_weight(tmp_path):
    logic, bus, _ = service(tmp_path, start_grants={}, capacity=7)  # this run: trainer guaranteed 2
    await logic.start()
    await logic.handle_run_registered(RunRegistered(run_id="other", guaranteed={"trainer": 1}, weight=1.0), CONTEXT)
    await logic.handle_run_registered(RunRegistered(run_id="other", guaranteed={"trainer": 1}), CONTEXT)  # repeat
    await logic.handle_demand(RoleDemandChanged(role="trainer", accelerators=7), CONTEXT)
    assert logic.status().roles == {"trainer": 7}  # alone, it may have them all
    await logic.handle_demand(RoleDemandChanged(role="trainer", accelerators=7, run_id="other"), CONTEXT)
    # Guarantees first (2 and 1), the 4 others split by the equal weights.
    assert logic.status().roles == {"trainer": 4, "other/trainer": 3}
    assert {m.holder for m in bus.messages(GPU_GRANTED)} == {"trainer", "other/trainer"}
    assert {m.role for m in bus.messages(GPU_GRANTED)} == {"trainer"}


@pytest.mark.parametrize(("grants", "capacity", "expected"), [
    ({"decode": 1, "trainer": 1}, 2, {"decode": 1, "trainer": 1}),
    ({"decode": 0.5, "trainer": 0.5}, 1, {"decode": 0, "trainer": 1}),  # one accelerator, shared, once
    ({"decode": 1.5, "trainer": 1}, 4, {"decode": 2, "trainer": 1}),  # half of one is not lendable
    ({}, 3, {}),
])
def test_start_grants_count_whole_accelerators_once(grants, capacity, expected):
    assert whole_start_grants(grants, capacity) == expected



async def test_a_scheduler_with_no_accelerators_reports_zero_utilization_instead_of_failing(tmp_path):
    # scheduler.total_gpus = 0 is the default of a config file without [scheduler]: its status
    # must still be answered (it once raised ZeroDivisionError, so `rollmesh sched status` timed out).
    clock = Clock()
    logic = LendingService(LendingScheduler(0), run_id="ns", roles={}, start_grants={},
                           launcher=FakeLauncher(), role_groups=FakeRoleGroups(), publisher=RecordingPublisher(),
                           clock=clock, ledger=JobLedger(tmp_path / "jobs.jsonl"), resource="rollmesh_gpu",
                           account=UtilizationAccount(0, start=clock.now))
    await logic.start()
    clock.now += 60
    status = logic.status()
    assert (status.allocated_utilization, status.busy_utilization) == (0.0, 0.0)
