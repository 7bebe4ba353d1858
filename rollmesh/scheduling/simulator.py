"""Discrete-event simulator: replays a job trace and RL runs' phases against a scheduling policy.

Knows the scheduling package only. The policy is the same object the live scheduler drives (the
``SchedulingPolicy`` protocol); the simulator plays everyone else: it submits jobs at their trace
times, runs them to their true durations (the policy sees only estimates), checkpoints them,
answers PreemptionRequested the way ``SimJob`` describes (save on request if it can in time,
computing on until twice its save time is left before the deadline; else run to a periodic
checkpoint before the deadline; else leave at once and lose the work since the last one), and plays each RL run phase by phase. A phase starts once every role holds its
demand, so time an RL run spends waiting on accelerators is its slowdown.

Roles lend their memory (``role_release_s``, ``role_resume_s``: the measured times of the engines'
``release_memory`` / ``resume_memory``). Modelled serially, an upper bound on their cost: at a
phase change where some role's demand falls, the run first holds everything for
``role_release_s`` (the falling roles move their memory to the host) and only then changes its
demand; a role given accelerators computes on them only ``role_resume_s`` later. Both count as
RL waiting (slowdown) with the accelerators held and idle. (A resume on accelerators taken from
jobs could overlap the release, and a run that resumed ahead of its phase could hide it; doing
so needs both phases' demand at once, which costs preemptions.)

Busy: a job computing (not reloading after a restart, not saving on request); an RL role's demand
times its phase's busy fraction. Accelerators lent to an elastic role past its demand count as
allocated, not busy: the trace does not say what extra decode workers would buy.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollmesh.scheduling.accounting import UtilizationAccount, UtilizationSample, UtilizationTotals
from rollmesh.scheduling.commands import (
    Command,
    GrantRole,
    GrowDecode,
    KillJob,
    ReclaimRole,
    RequestPreemption,
    ShrinkDecode,
    StartJob,
)
from rollmesh.scheduling.errors import InvalidJobError, OverCommittedError
from rollmesh.scheduling.job_progress import JobProgress
from rollmesh.scheduling.trace_readers import RlRunSpec, TraceJob
from rollmesh.scheduling.workload import RoleShare, SimJob

# Phases announced ahead at most this many at a time (the run re-announces at each phase start).
_LOOKAHEAD_PHASES = 8


class SchedulingPolicy(Protocol):
    """What the simulator (and the live scheduler) drives; every call returns commands to execute."""

    def register_run(self, run_id: str, roles: Mapping[str, RoleShare], now: float, *,
                     weight: float = 1.0) -> list[Command]: ...
    def set_demand(self, run_id: str, demand: Mapping[str, int], now: float) -> list[Command]: ...
    def reserve(self, run_id: str, demand: Mapping[str, int], at: float, now: float) -> list[Command]: ...
    def submit(self, job: SimJob, now: float) -> list[Command]: ...
    def checkpointed(self, job_id: str, now: float) -> list[Command]: ...
    def acknowledged(self, job_id: str, now: float) -> list[Command]: ...
    def finished(self, job_id: str, now: float) -> list[Command]: ...
    def tick(self, now: float) -> list[Command]: ...
    def next_wakeup(self) -> float | None: ...


@dataclass(frozen=True)
class RlRunResult:
    run_id: str
    alone_s: float  # its phases back to back: the run with the cluster to itself
    makespan_s: float
    waited_s: float  # time its phases waited for accelerators

    @property
    def slowdown(self) -> float:
        return self.makespan_s / self.alone_s - 1.0


@dataclass(frozen=True)
class SimulationResult:
    capacity: int
    totals: UtilizationTotals
    samples: list[UtilizationSample]
    rl_runs: list[RlRunResult]
    jobs_submitted: int
    jobs_finished: int
    jobs_rejected: int
    preemptions: int
    kills: int
    sim_allocated_s: float  # accelerator-seconds held by simulation jobs

    @property
    def rl_slowdown(self) -> float:
        return max((run.slowdown for run in self.rl_runs), default=0.0)

    @property
    def lost_fraction(self) -> float:
        """Preemption's cost (lost progress, saving on request, reloading) over what jobs held."""
        lost = self.totals.lost_s + self.totals.overhead_s
        return lost / self.sim_allocated_s if self.sim_allocated_s > 0 else 0.0

    def figures(self) -> dict[str, float]:
        return {"busy_utilization": round(self.totals.busy_utilization, 4),
                "allocated_utilization": round(self.totals.allocated_utilization, 4),
                "rl_slowdown": round(self.rl_slowdown, 4), "lost_fraction": round(self.lost_fraction, 4)}


@dataclass
class _Job:
    trace: TraceJob
    truth: JobProgress
    epoch: int = 0  # bumped whenever the job stops or starts, so its pending events go stale
    saving: bool = False


@dataclass
class _Run:
    spec: RlRunSpec
    index: int = 0
    requested_at: float = 0.0
    started_at: float | None = None
    held: dict[str, int] = field(default_factory=dict)
    lent: dict[str, int] = field(default_factory=dict)
    waited_s: float = 0.0
    plan: int = 0  # bumped at each phase start: older announcements go stale
    ended_at: float | None = None
    ready_at: dict[str, float] = field(default_factory=dict)  # role -> its memory is resumed by then

    def demand(self, index: int) -> dict[str, int]:
        phase = self.spec.phases[index]
        return {role: phase.demand.get(role, 0) for role in self.spec.roles}


def simulate(
    policy: SchedulingPolicy,
    capacity: int,
    jobs: Sequence[TraceJob],
    rl_runs: Sequence[RlRunSpec] = (),
    *,
    ignores_preemption: Collection[str] = (),
    sample_interval_s: float | None = None,
    role_release_s: float = 0.0,
    role_resume_s: float = 0.0,
) -> SimulationResult:
    """Replay until the last RL run ends (the measured window), or, without RL runs, until the
    last job finishes. ``ignores_preemption``: job ids that never answer PreemptionRequested.
    ``role_release_s`` / ``role_resume_s``: what lending a role's memory costs (module docstring)."""
    simulation = _Simulation(policy, capacity, jobs, rl_runs, ignores_preemption, sample_interval_s)
    simulation.release_s, simulation.resume_s = role_release_s, role_resume_s
    return simulation.run()


class _Simulation:
    def __init__(self, policy: SchedulingPolicy, capacity: int, jobs: Sequence[TraceJob],
                 rl_runs: Sequence[RlRunSpec], ignores: Collection[str], interval: float | None) -> None:
        self.policy = policy
        self.capacity = capacity
        self.ignores = set(ignores)
        self.jobs = {t.job.job_id: _Job(t, JobProgress(t.job, seq=i)) for i, t in enumerate(jobs)}
        self.runs = {spec.run_id: _Run(spec) for spec in rl_runs}
        horizon = max((spec.duration_s() for spec in rl_runs), default=0.0) or max(
            (t.submit_s + t.duration_s for t in jobs), default=1.0)
        self.account = UtilizationAccount(capacity, interval_s=interval or max(60.0, horizon / 300))
        self.events: list[tuple[float, int, str, tuple[Any, ...]]] = []
        self.order = itertools.count()
        self.wakeups: set[float] = set()
        self.now = 0.0
        self.finished = self.preemptions = self.kills = self.rejected = 0
        self.sim_allocated_s = 0.0
        self.release_s = self.resume_s = 0.0

    def run(self) -> SimulationResult:
        for job in self.jobs.values():
            self.push(job.trace.submit_s, "submit", job.trace.job.job_id)
        for run in self.runs.values():
            self.apply(self.policy.register_run(run.spec.run_id, dict(run.spec.roles), 0.0,
                                                weight=run.spec.weight))
            self.request_phase(run)
        self.rates()  # the first phases compute from 0, whether or not anything happens then
        while self.events and not self.rl_done():
            time, _, kind, args = heapq.heappop(self.events)
            self.advance(time)
            getattr(self, f"on_{kind}")(*args)
            self.rates()
            self.schedule_wakeup()
        end = max((run.ended_at or 0.0 for run in self.runs.values()), default=self.now)
        self.advance(end)
        stats_submitted = sum(1 for job in self.jobs.values() if job.trace.submit_s <= end)
        return SimulationResult(
            capacity=self.capacity, totals=self.account.totals(end), samples=self.account.samples(end),
            rl_runs=[RlRunResult(run.spec.run_id, run.spec.duration_s(), (run.ended_at or end),
                                 run.waited_s) for run in self.runs.values()],
            jobs_submitted=stats_submitted, jobs_finished=self.finished, jobs_rejected=self.rejected, preemptions=self.preemptions,
            kills=self.kills, sim_allocated_s=self.sim_allocated_s)

    # --- the event loop -------------------------------------------------------------------------

    def push(self, time: float, kind: str, *args: Any) -> None:
        heapq.heappush(self.events, (time, next(self.order), kind, args))

    def rl_done(self) -> bool:
        return bool(self.runs) and all(run.ended_at is not None for run in self.runs.values())

    def advance(self, time: float) -> None:
        running = sum(job.trace.job.accelerators for job in self.jobs.values() if job.truth.state != "queued")
        self.sim_allocated_s += running * (time - self.now)
        self.now = time

    def rates(self) -> None:
        allocated = busy = rl_held = 0.0
        for job in self.jobs.values():
            if job.truth.state != "queued":
                allocated += job.trace.job.accelerators
                if not job.saving and self.now >= job.truth.compute_from:
                    busy += job.trace.job.accelerators
        for run in self.runs.values():
            held = sum(run.held.values()) + sum(run.lent.values())
            rl_held += held
            allocated += held
            if run.started_at is not None and run.ended_at is None:
                phase = run.spec.phases[run.index]
                busy += sum(min(run.held.get(role, 0), count) * phase.busy.get(role, 1.0)
                            for role, count in phase.demand.items())
        if allocated > self.capacity:
            raise OverCommittedError(resource="accelerators", total=self.capacity, held=allocated, requested={})
        self.account.set_rates(self.now, allocated=allocated, busy=busy, rl_held=rl_held)

    def schedule_wakeup(self) -> None:
        wakeup = self.policy.next_wakeup()
        if wakeup is not None:
            wakeup = max(wakeup, self.now)
            if wakeup not in self.wakeups:
                self.wakeups.add(wakeup)
                self.push(wakeup, "wakeup")

    def on_wakeup(self) -> None:
        self.apply(self.policy.tick(self.now))

    # --- simulation jobs ------------------------------------------------------------------------

    def on_submit(self, job_id: str) -> None:
        try:
            self.apply(self.policy.submit(self.jobs[job_id].trace.job, self.now))
        except InvalidJobError:
            self.rejected += 1  # the policy can never run it (bigger than it may ever lend)

    def on_compute(self, job_id: str, epoch: int) -> None:
        """A restarted job finished reloading: only the busy rate changes."""

    def on_checkpoint(self, job_id: str, epoch: int) -> None:
        job = self.jobs[job_id]
        if job.epoch != epoch:
            return
        job.truth.checkpoint(self.now)
        self.push(job.truth.next_periodic_checkpoint(self.now), "checkpoint", job_id, epoch)
        self.apply(self.policy.checkpointed(job_id, self.now))

    def on_finish(self, job_id: str, epoch: int) -> None:
        job = self.jobs[job_id]
        if job.epoch != epoch:
            return
        job.epoch += 1
        job.truth.state = "queued"
        job.truth.saved_s = job.trace.duration_s
        self.finished += 1
        self.apply(self.policy.finished(job_id, self.now))

    def on_ack(self, job_id: str, epoch: int, saved: bool) -> None:
        job = self.jobs[job_id]
        if job.epoch != epoch:
            return
        if saved:
            job.truth.checkpoint(self.now)
            self.apply(self.policy.checkpointed(job_id, self.now))
        self.stop(job)
        self.apply(self.policy.acknowledged(job_id, self.now))

    def start(self, job: _Job) -> None:
        job.epoch += 1
        job.truth.start(self.now)
        spec = job.trace.job
        if job.truth.starts > 1:
            self.account.add_overhead(spec.accelerators * spec.restart_cost_s)
            self.push(job.truth.compute_from, "compute", spec.job_id, job.epoch)
        self.push(job.truth.end_at(job.trace.duration_s), "finish", spec.job_id, job.epoch)
        checkpoint = job.truth.next_periodic_checkpoint(self.now)
        if checkpoint < math.inf:
            self.push(checkpoint, "checkpoint", spec.job_id, job.epoch)

    def ask_to_leave(self, job: _Job, deadline: float) -> None:
        self.preemptions += 1
        spec = job.trace.job
        if spec.job_id in self.ignores:
            return
        periodic = job.truth.next_periodic_checkpoint(self.now)
        saving = spec.checkpoint_s or 0.0
        if spec.saves_on_request() and self.now + saving <= deadline:
            # It uses its grace: computes on, and starts saving when twice its save time is left.
            self.push(max(self.now, deadline - 2 * saving), "save", spec.job_id, job.epoch)
        elif periodic <= deadline:
            self.push(periodic, "ack", spec.job_id, job.epoch, True)
        else:
            self.push(self.now, "ack", spec.job_id, job.epoch, False)

    def on_save(self, job_id: str, epoch: int) -> None:
        """It stops computing and writes its progress as of now, then releases."""
        job = self.jobs[job_id]
        if job.epoch != epoch:
            return
        spec = job.trace.job
        job.truth.checkpoint(self.now)
        job.truth.compute_from = math.inf
        job.saving = True
        job.epoch += 1
        self.account.add_overhead(spec.accelerators * (spec.checkpoint_s or 0.0))
        self.push(self.now + (spec.checkpoint_s or 0.0), "ack", spec.job_id, job.epoch, False)

    def stop(self, job: _Job) -> None:
        """Off its accelerators, back to the queue; progress since its last checkpoint is lost."""
        job.epoch += 1
        job.saving = False
        lost = job.truth.release(self.now)  # nothing once it saved on request: it stopped computing
        self.account.discard(job.trace.job.accelerators * lost)

    # --- RL runs --------------------------------------------------------------------------------

    def request_phase(self, run: _Run, *, requested_at: float | None = None) -> None:
        demand = run.demand(run.index)
        before = run.demand(run.index - 1) if run.index else {}
        run.requested_at = self.now if requested_at is None else requested_at
        run.started_at = None
        changed = {role: count for role, count in demand.items() if before.get(role) != count}
        self.apply(self.policy.set_demand(run.spec.run_id, changed, self.now))
        self.try_start(run)

    def on_released(self, run_id: str) -> None:
        """The falling roles' memory is on the host: the run's phase change goes ahead."""
        self.request_phase(self.runs[run_id], requested_at=self.runs[run_id].requested_at)

    def on_ready(self, run_id: str) -> None:
        self.try_start(self.runs[run_id])

    def try_start(self, run: _Run) -> None:
        if run.started_at is not None or run.ended_at is not None:
            return
        demand = run.demand(run.index)
        if any(run.held.get(role, 0) < count for role, count in demand.items()):
            return
        ready = max((run.ready_at.get(role, 0.0) for role, count in demand.items() if count), default=0.0)
        if ready > self.now:  # granted, but its memory is still coming back
            self.push(ready, "ready", run.spec.run_id)
            return
        run.started_at = self.now
        run.waited_s += self.now - run.requested_at
        run.plan += 1
        phases = run.spec.phases
        self.push(self.now + phases[run.index].duration_s, "phase_end", run.spec.run_id, run.index)
        # Announce the next phases' demand as soon as the run knows when they start: a phase's
        # end is known notice_s before it, and a later phase's start only once all ends before it are.
        start, known = self.now, self.now
        for index in range(run.index + 1, min(len(phases), run.index + 1 + _LOOKAHEAD_PHASES)):
            previous = phases[index - 1]
            known = max(known, start + previous.duration_s - previous.notice_s)
            start += previous.duration_s
            if known >= start:
                break
            self.push(known, "announce", run.spec.run_id, run.plan, index, start)

    def on_announce(self, run_id: str, plan: int, index: int, at: float) -> None:
        run = self.runs[run_id]
        if run.plan != plan:
            return
        demand, before = run.demand(index), run.demand(index - 1)
        changed = {role: count for role, count in demand.items() if before[role] != count}
        self.apply(self.policy.reserve(run_id, changed, at, self.now))

    def on_phase_end(self, run_id: str, index: int) -> None:
        run = self.runs[run_id]
        if index + 1 < len(run.spec.phases):
            run.index = index + 1
            before, after = run.demand(index), run.demand(index + 1)
            if self.release_s > 0 and any(after[role] < before[role] for role in after):
                run.started_at, run.requested_at = None, self.now  # waiting, from now
                # What the next phase needs stays announced, now for when the release is done.
                changed = {role: count for role, count in after.items() if before[role] != count}
                self.apply(self.policy.reserve(run_id, changed, self.now + self.release_s, self.now))
                self.push(self.now + self.release_s, "released", run_id)
                return
            self.request_phase(run)
            return
        run.ended_at = self.now
        self.apply(self.policy.set_demand(run_id, {role: 0 for role in run.spec.roles}, self.now))

    # --- commands -------------------------------------------------------------------------------

    def apply(self, commands: list[Command]) -> None:
        touched: set[str] = set()
        for command in commands:
            if isinstance(command, StartJob):
                self.start(self.jobs[command.job_id])
            elif isinstance(command, RequestPreemption):
                self.ask_to_leave(self.jobs[command.job_id], command.deadline)
            elif isinstance(command, KillJob):
                self.kills += 1
                self.stop(self.jobs[command.job_id])
            elif isinstance(command, (GrantRole, ReclaimRole)):
                run = self.runs[command.run_id]
                if isinstance(command, GrantRole) and self.resume_s > 0:
                    run.ready_at[command.role] = self.now + self.resume_s
                run.held[command.role] = command.held
                touched.add(command.run_id)
            elif isinstance(command, (GrowDecode, ShrinkDecode)):
                self.runs[command.run_id].lent[command.role] = command.lent
        for run_id in touched:
            self.try_start(self.runs[run_id])
