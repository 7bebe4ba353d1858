"""The lending scheduler's policy on hand-made scenarios: plain logic, a clock passed by hand."""

from __future__ import annotations

import pytest

from rollmesh.scheduling import (
    GrantRole,
    GrowDecode,
    InvalidJobError,
    KillJob,
    LendingScheduler,
    OverCommittedError,
    ReclaimRole,
    RequestPreemption,
    RoleShare,
    RunAlreadyRegisteredError,
    ShrinkDecode,
    SimJob,
    StartJob,
    UnknownJobError,
    UnknownRoleError,
    UtilizationAccount,
)
from rollmesh.scheduling.fair_share import RoleDemand, fair_targets
from rollmesh.scheduling.job_progress import JobProgress, ReleaseLeads, choose_victims

pytestmark = pytest.mark.unit


def job(job_id: str, accelerators: int, expected: float, **spec) -> SimJob:
    spec.setdefault("grace_s", 30.0)
    spec.setdefault("checkpoint_s", 5.0)
    return SimJob(job_id=job_id, accelerators=accelerators, expected_duration_s=expected, **spec)


def scheduler_with_trainer(capacity: int = 8, guaranteed: int = 8) -> LendingScheduler:
    scheduler = LendingScheduler(capacity)
    scheduler.register_run("rl", {"trainer": RoleShare(guaranteed=guaranteed, priority=1)}, 0.0)
    return scheduler


def started(commands) -> list[str]:
    return [c.job_id for c in commands if isinstance(c, StartJob)]


def test_backfill_never_delays_a_reserved_role_past_its_reservation():
    scheduler = scheduler_with_trainer()
    assert scheduler.reserve("rl", {"trainer": 8}, at=100.0, now=0.0) == []
    # Ends before the reservation: starts as is.
    assert started(scheduler.submit(job("short", 4, 50.0), 0.0)) == ["short"]
    # Runs past it but can be asked to leave in time and saves first: lent until then.
    assert started(scheduler.submit(job("loan", 4, 1000.0, grace_s=30.0), 0.0)) == ["loan"]
    # Could not be asked in time (grace longer than what is left before the reservation): waits.
    assert started(scheduler.submit(job("slow", 1, 1000.0, grace_s=200.0), 0.0)) == []
    assert scheduler.next_wakeup() == 70.0  # the loan is asked exactly grace_s ahead
    assert started(scheduler.finished("short", 50.0)) == []  # the freed 4 wait for the trainer
    assert scheduler.tick(70.0) == [RequestPreemption("loan", deadline=100.0, reason="announced RL demand")]
    assert scheduler.checkpointed("loan", 95.0) == []
    assert scheduler.acknowledged("loan", 95.0) == []
    assert scheduler.set_demand("rl", {"trainer": 8}, 100.0) == [GrantRole("rl", "trainer", 8, 8)]
    assert scheduler.stats().rl_queueing_s == {}  # granted the moment it asked


def test_a_job_that_cannot_save_before_the_reservation_is_not_lent():
    scheduler = scheduler_with_trainer()
    scheduler.reserve("rl", {"trainer": 8}, at=100.0, now=0.0)
    # Neither saves on request nor checkpoints periodically: everything it did would be lost.
    assert started(scheduler.submit(job("fragile", 4, 1000.0, checkpoint_s=None), 0.0)) == []


def test_a_preemption_honours_its_grace_period():
    scheduler = scheduler_with_trainer()
    scheduler.submit(job("sim", 8, 1000.0, grace_s=30.0), 0.0)
    commands = scheduler.set_demand("rl", {"trainer": 4}, 10.0)
    assert commands == [RequestPreemption("sim", deadline=40.0, reason="RL demand")]
    assert scheduler.next_wakeup() == 40.0
    assert scheduler.tick(39.0) == []  # no kill inside the grace period
    assert scheduler.acknowledged("sim", 35.0) == [GrantRole("rl", "trainer", 4, 4)]
    assert scheduler.stats().rl_queueing_s == {"rl/trainer": 25.0}
    assert scheduler.stats().kills == 0


def test_a_job_that_ignores_preemption_is_killed_at_the_deadline_and_requeued():
    scheduler = scheduler_with_trainer()
    scheduler.submit(job("deaf", 8, 1000.0, grace_s=30.0), 0.0)
    scheduler.set_demand("rl", {"trainer": 8}, 10.0)
    assert scheduler.tick(40.0) == [KillJob("deaf", reason="no release by the preemption deadline"),
                                    GrantRole("rl", "trainer", 8, 8)]
    assert scheduler.stats().kills == 1
    assert scheduler.stats().queued == 1
    # It runs again once the trainer gives its accelerators back.
    commands = scheduler.set_demand("rl", {"trainer": 0}, 500.0)
    assert commands == [ReclaimRole("rl", "trainer", 8, 0), StartJob("deaf", 8)]


def test_victims_are_the_cheapest_to_preempt():
    scheduler = scheduler_with_trainer()
    scheduler.submit(job("slow-restart", 4, 1000.0, restart_cost_s=300.0), 0.0)
    scheduler.submit(job("quick-restart", 4, 1000.0, restart_cost_s=10.0), 0.0)
    commands = scheduler.set_demand("rl", {"trainer": 4}, 100.0)
    assert [c.job_id for c in commands if isinstance(c, RequestPreemption)] == ["quick-restart"]


def test_unsaved_work_makes_a_job_a_dear_victim():
    def running(job_id: str, *, saved_at: float, **spec) -> JobProgress:
        progress = JobProgress(job(job_id, 2, 10_000.0, **spec), seq=0)
        progress.start(0.0)
        progress.checkpoint(saved_at)
        return progress

    # Neither saves on request; one checkpointed at 900, the other at 100: preempting that one
    # at 1000 throws 900 s of work away.
    recent = running("recent", saved_at=900.0, checkpoint_s=None, checkpoint_interval_s=3600.0)
    stale = running("stale", saved_at=100.0, checkpoint_s=None, checkpoint_interval_s=3600.0)
    assert stale.preemption_cost(1000.0) == 2 * 900.0
    assert choose_victims([stale, recent], 2, lambda p: 1000.0) == [recent]


def test_victim_choice_does_not_preempt_a_big_job_to_free_one_accelerator():
    big, small = (JobProgress(job(name, size, 1000.0), seq=i) for i, name, size in ((0, "big", 8), (1, "small", 1)))
    for progress in (big, small):
        progress.start(0.0)
    assert choose_victims([big, small], 1, lambda p: 10.0) == [small]


def test_victims_of_equal_cost_are_the_jobs_expected_to_end_soonest():
    soon, late = (JobProgress(job(name, 2, expected), seq=i) for i, name, expected in ((0, "soon", 500.0),
                                                                                      (1, "late", 5000.0)))
    for progress in (soon, late):
        progress.start(0.0)
    assert choose_victims([late, soon], 2, lambda p: 10.0) == [soon]


def test_release_leads_are_learned_in_save_times_and_a_kill_counts_as_none():
    leads = ReleaseLeads()
    saver = job("saver", 1, 100.0, grace_s=60.0, checkpoint_s=10.0)
    assert leads.expected(saver) == 0.0  # nothing seen yet
    leads.released(job("quick", 1, 100.0, grace_s=60.0, checkpoint_s=4.0), 4.0)
    assert leads.expected(saver) == 10.0  # one save time early, like the job before it
    # It saves for checkpoint_s after the request: never earlier than grace - checkpoint_s.
    assert leads.expected(job("tight", 1, 100.0, grace_s=12.0, checkpoint_s=10.0)) == 2.0
    assert leads.expected(job("fragile", 1, 100.0, checkpoint_s=None)) == 0.0
    leads.released(saver, 0.0)  # killed at its deadline
    assert leads.expected(saver) == 0.0


def lead_learned(budget: float) -> LendingScheduler:
    """A trainer of 8 and job "a" (8 accelerators, grace 30, saves in 5) that, preempted once,
    released 5 s before its deadline; at 200 it runs again."""
    scheduler = LendingScheduler(8, rl_wait_budget=budget)
    scheduler.register_run("rl", {"trainer": RoleShare(guaranteed=8)}, 0.0)
    scheduler.submit(job("a", 8, 10_000.0, grace_s=30.0, checkpoint_s=5.0), 0.0)
    assert scheduler.set_demand("rl", {"trainer": 8}, 100.0) == [
        RequestPreemption("a", deadline=130.0, reason="RL demand")]
    scheduler.acknowledged("a", 125.0)
    assert started(scheduler.set_demand("rl", {"trainer": 0}, 200.0)) == ["a"]
    return scheduler


def test_a_job_that_releases_early_is_asked_that_much_later_so_it_leaves_as_rl_starts():
    scheduler = lead_learned(budget=0.02)
    scheduler.reserve("rl", {"trainer": 8}, at=1000.0, now=200.0)
    assert scheduler.next_wakeup() == 975.0  # grace 30 before the reservation plus its 5 s lead
    assert scheduler.tick(975.0) == [RequestPreemption("a", deadline=1005.0, reason="announced RL demand")]
    assert scheduler.acknowledged("a", 1000.0) == []
    assert scheduler.set_demand("rl", {"trainer": 8}, 1000.0) == [GrantRole("rl", "trainer", 8, 8)]
    assert scheduler.stats().rl_queueing_s == {"rl/trainer": 25.0}  # the unannounced wait only


def test_without_an_rl_wait_budget_a_deadline_never_runs_past_the_reservation():
    scheduler = lead_learned(budget=0.0)
    scheduler.reserve("rl", {"trainer": 8}, at=1000.0, now=200.0)
    assert scheduler.next_wakeup() == 970.0
    assert scheduler.tick(970.0) == [RequestPreemption("a", deadline=1000.0, reason="announced RL demand")]


def test_rl_slack_stays_within_its_budget():
    # 0.1% of the 1000 s up to the reservation: 1 s past it at most, though the job leaves 5 s early.
    scheduler = lead_learned(budget=0.001)
    scheduler.reserve("rl", {"trainer": 8}, at=1000.0, now=200.0)
    assert scheduler.tick(971.0) == [RequestPreemption("a", deadline=1001.0, reason="announced RL demand")]
    # A second reservation has only what the first did not take (2 s by 2000, 1 s spent).
    scheduler.acknowledged("a", 996.0)
    scheduler.set_demand("rl", {"trainer": 8}, 1000.0)
    scheduler.set_demand("rl", {"trainer": 0}, 1100.0)
    scheduler.reserve("rl", {"trainer": 8}, at=2000.0, now=1100.0)
    assert scheduler.next_wakeup() == 1971.0


def test_a_job_still_there_past_its_expected_release_is_not_lent_out():
    scheduler = LendingScheduler(10)
    scheduler.register_run("rl", {"trainer": RoleShare(guaranteed=8)}, 0.0)
    scheduler.submit(job("a", 4, 5000.0, grace_s=30.0, checkpoint_s=5.0), 0.0)
    scheduler.submit(job("c", 4, 10_000.0, grace_s=30.0, checkpoint_s=5.0), 0.0)
    scheduler.set_demand("rl", {"trainer": 4}, 100.0)  # "a" (ends sooner) is asked, leaves 5 s early
    scheduler.acknowledged("a", 125.0)
    scheduler.set_demand("rl", {"trainer": 0}, 200.0)
    scheduler.reserve("rl", {"trainer": 4}, at=1000.0, now=200.0)
    assert scheduler.tick(975.0) == [RequestPreemption("a", deadline=1005.0, reason="announced RL demand")]
    scheduler.finished("c", 990.0)  # the trainer takes what "c" left instead
    assert scheduler.set_demand("rl", {"trainer": 4}, 1000.0) == [GrantRole("rl", "trainer", 4, 4)]
    # 2 are free; "a", expected gone by 1000, holds its 4 until it acknowledges (or 1005).
    assert started(scheduler.submit(job("b", 6, 100.0), 1001.0)) == []
    assert started(scheduler.acknowledged("a", 1002.0)) == ["a"]  # first in the queue


def test_fair_share_splits_demand_above_guarantees_by_weight():
    def demand(run_id: str, weight: float) -> RoleDemand:
        return RoleDemand(run_id, "decode", demand=10, guaranteed=3, priority=0, weight=weight)

    assert fair_targets(10, [demand("a", 1.0), demand("b", 1.0)]) == {("a", "decode"): 5, ("b", "decode"): 5}
    assert fair_targets(10, [demand("a", 3.0), demand("b", 1.0)]) == {("a", "decode"): 6, ("b", "decode"): 4}
    assert fair_targets(30, [demand("a", 1.0), demand("b", 1.0)]) == {("a", "decode"): 10, ("b", "decode"): 10}


def test_a_second_run_takes_its_fair_share_back_from_the_first():
    scheduler = LendingScheduler(10)
    for run_id in ("a", "b"):
        scheduler.register_run(run_id, {"decode": RoleShare(guaranteed=3)}, 0.0)
    assert scheduler.set_demand("a", {"decode": 10}, 0.0) == [GrantRole("a", "decode", 10, 10)]
    assert scheduler.set_demand("b", {"decode": 10}, 5.0) == [ReclaimRole("a", "decode", 5, 5),
                                                              GrantRole("b", "decode", 5, 5)]


def test_decode_loans_grow_into_idle_accelerators_and_shrink_first():
    scheduler = LendingScheduler(8)
    scheduler.register_run("rl", {"decode": RoleShare(guaranteed=4, elastic_limit=3)}, 0.0)
    assert scheduler.set_demand("rl", {"decode": 2}, 0.0) == [GrantRole("rl", "decode", 2, 2),
                                                             GrowDecode("rl", "decode", 3, 3)]
    # A job that needs the loan gets it at once: the shrink comes before the start.
    assert scheduler.submit(job("sim", 5, 100.0), 1.0) == [ShrinkDecode("rl", "decode", 2, 1), StartJob("sim", 5)]
    # Decode's own demand takes the loan back first, then what is free.
    assert scheduler.set_demand("rl", {"decode": 3}, 2.0) == [ShrinkDecode("rl", "decode", 1, 0),
                                                             GrantRole("rl", "decode", 1, 3)]
    assert scheduler.set_demand("rl", {"decode": 0}, 3.0) == [ReclaimRole("rl", "decode", 3, 0)]


def test_the_queue_head_is_not_delayed_by_jobs_behind_it():
    scheduler = LendingScheduler(4)
    scheduler.submit(job("running", 2, 100.0), 0.0)
    assert started(scheduler.submit(job("head", 4, 100.0), 0.0)) == []
    # Ends before the head can start (at 100): backfilled.
    assert started(scheduler.submit(job("fits", 2, 50.0), 0.0)) == ["fits"]
    scheduler.finished("fits", 50.0)
    # Would hold the head back and cannot save: waits behind it.
    assert started(scheduler.submit(job("long", 2, 500.0, checkpoint_s=None), 50.0)) == []
    assert started(scheduler.finished("running", 100.0)) == ["head"]


def test_commands_release_before_they_grant():
    scheduler = scheduler_with_trainer(capacity=8, guaranteed=8)
    scheduler.submit(job("deaf", 8, 1000.0), 0.0)
    scheduler.set_demand("rl", {"trainer": 8}, 1.0)
    kill, grant = scheduler.tick(31.0)
    assert isinstance(kill, KillJob) and isinstance(grant, GrantRole)


def test_what_the_cluster_cannot_hold_is_refused_with_its_fields():
    scheduler = scheduler_with_trainer(capacity=8, guaranteed=6)
    with pytest.raises(InvalidJobError) as refused:
        scheduler.submit(job("huge", 9, 10.0), 0.0)
    assert refused.value.job_id == "huge"
    with pytest.raises(OverCommittedError) as over:
        scheduler.register_run("other", {"trainer": RoleShare(guaranteed=3)}, 0.0)
    assert over.value.total == 8 and over.value.held == 6
    with pytest.raises(RunAlreadyRegisteredError):
        scheduler.register_run("rl", {}, 0.0)
    with pytest.raises(UnknownRoleError) as unknown:
        scheduler.set_demand("rl", {"decode": 1}, 0.0)
    assert (unknown.value.run_id, unknown.value.role) == ("rl", "decode")
    with pytest.raises(UnknownJobError):
        scheduler.acknowledged("nobody", 0.0)
    scheduler.submit(job("twice", 1, 10.0), 0.0)
    with pytest.raises(InvalidJobError):
        scheduler.submit(job("twice", 1, 10.0), 0.0)


def test_utilization_account_integrates_allocated_and_busy_per_interval():
    account = UtilizationAccount(4, interval_s=10.0)
    account.set_rates(0.0, allocated=4, busy=2, rl_held=1)
    account.set_rates(10.0, allocated=2, busy=2, rl_held=0)
    account.discard(5.0)  # work a preempted job had not saved
    totals = account.totals(20.0)
    assert (totals.allocated_s, totals.busy_s, totals.rl_held_s, totals.lost_s) == (60.0, 35.0, 10.0, 5.0)
    assert totals.allocated_utilization == 0.75
    assert totals.busy_utilization == 35.0 / 80.0
    samples = account.samples(20.0)
    assert [(s.start, s.end, s.allocated, s.busy, s.rl_held) for s in samples] == [
        (0.0, 10.0, 4.0, 2.0, 1.0), (10.0, 20.0, 2.0, 2.0, 0.0)]
