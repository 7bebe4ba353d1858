"""The lending core with pinned role devices (``role_devices_pinned``, the live scheduler lending
roles' own accelerators): a role gets back its own devices, so the jobs on them are the ones
preempted, and only unowned accelerators go past a guarantee or to elastic loans."""

from __future__ import annotations

import pytest

from rollmesh.scheduling import GrantRole, LendingScheduler, ReclaimRole, RequestPreemption, RoleShare, SimJob, StartJob

pytestmark = pytest.mark.unit


def job(job_id: str, accelerators: int, expected: float = 10_000.0, **spec) -> SimJob:
    spec.setdefault("grace_s", 30.0)
    spec.setdefault("checkpoint_s", 5.0)
    return SimJob(job_id=job_id, accelerators=accelerators, expected_duration_s=expected, **spec)


def pinned(capacity: int = 6) -> LendingScheduler:
    """decode owns 2 devices, trainer 2; 2 belong to no role."""
    scheduler = LendingScheduler(capacity, role_devices_pinned=True)
    scheduler.register_run("rl", {"decode": RoleShare(guaranteed=2, priority=0),
                                  "trainer": RoleShare(guaranteed=2, priority=1)}, 0.0)
    scheduler.set_demand("rl", {"decode": 2, "trainer": 2}, 0.0)
    return scheduler


def starts(commands) -> dict[str, tuple]:
    return {c.job_id: c.borrowed for c in commands if isinstance(c, StartJob)}


def test_jobs_take_unowned_accelerators_first_then_idle_roles_own_devices():
    scheduler = pinned()
    assert starts(scheduler.submit(job("free", 2), 1.0)) == {"free": ()}
    assert scheduler.set_demand("rl", {"decode": 0}, 2.0) == [ReclaimRole("rl", "decode", 2, 0)]
    assert starts(scheduler.submit(job("lent", 2), 3.0)) == {"lent": (("rl", "decode", 2),)}
    assert starts(scheduler.submit(job("waits", 1), 4.0)) == {}  # the trainer's devices are in use


def test_a_role_whose_demand_returns_preempts_the_jobs_on_its_own_devices_not_the_cheapest():
    scheduler = pinned()
    scheduler.set_demand("rl", {"decode": 0}, 0.0)
    # "cheap" runs on the unowned accelerators and restarts for free; "lent", on decode's own
    # devices, would cost a long reload: by cost alone "cheap" would go.
    assert starts(scheduler.submit(job("cheap", 2), 0.0)) == {"cheap": ()}
    assert starts(scheduler.submit(job("lent", 2, restart_cost_s=600.0), 0.0)) == {"lent": (("rl", "decode", 2),)}
    assert starts(scheduler.submit(job("other", 1), 100.0)) == {}
    commands = scheduler.set_demand("rl", {"decode": 2}, 200.0)
    assert commands == [RequestPreemption("lent", deadline=230.0, reason="RL demand")]
    # Released: decode gets back exactly its two devices, nothing else moves.
    assert scheduler.acknowledged("lent", 210.0) == [GrantRole("rl", "decode", 2, 2)]


def test_an_unowned_accelerator_never_stands_in_for_a_roles_own_device():
    scheduler = pinned()
    scheduler.set_demand("rl", {"trainer": 0}, 0.0)
    assert starts(scheduler.submit(job("first", 2, expected=5.0), 0.0)) == {"first": ()}
    assert starts(scheduler.submit(job("lent", 2), 0.0)) == {"lent": (("rl", "trainer", 2),)}
    scheduler.finished("first", 6.0)  # two unowned accelerators free again
    # They are free, but the trainer's own devices are what it can run on.
    commands = scheduler.set_demand("rl", {"trainer": 2}, 10.0)
    assert not any(isinstance(c, GrantRole) for c in commands)
    assert [c.job_id for c in commands if isinstance(c, RequestPreemption)] == ["lent"]


def test_without_pinning_any_free_accelerator_serves_a_returning_role():
    scheduler = LendingScheduler(6)
    scheduler.register_run("rl", {"trainer": RoleShare(guaranteed=2)}, 0.0)
    assert starts(scheduler.submit(job("a", 2), 0.0)) == {"a": ()}
    assert scheduler.set_demand("rl", {"trainer": 2}, 1.0) == [GrantRole("rl", "trainer", 2, 2)]


def test_announced_demand_asks_the_jobs_on_the_roles_own_devices_a_grace_ahead():
    scheduler = pinned()
    scheduler.set_demand("rl", {"decode": 0}, 0.0)
    assert starts(scheduler.submit(job("cheap", 2), 0.0)) == {"cheap": ()}
    assert starts(scheduler.submit(job("lent", 2, restart_cost_s=600.0), 0.0)) == {"lent": (("rl", "decode", 2),)}
    assert scheduler.reserve("rl", {"decode": 2}, at=500.0, now=10.0) == []
    assert scheduler.next_wakeup() == 470.0  # grace 30 before the reservation
    assert scheduler.tick(470.0) == [RequestPreemption("lent", deadline=500.0, reason="announced RL demand")]
    assert scheduler.acknowledged("lent", 495.0) == []  # its devices wait for decode
    assert scheduler.set_demand("rl", {"decode": 2}, 500.0) == [GrantRole("rl", "decode", 2, 2)]
