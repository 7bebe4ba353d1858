"""The lending scheduler: RL roles first, idle accelerators lent to simulation jobs, taken back in time.

Knows the scheduling package only; no Ray, NATS or clock. Every method takes the time as ``now``
and returns the commands its driver must execute (the live scheduler actor, or the simulator), so
both run this same code. One pass after each event:

1. Kill jobs past their preemption deadline.
2. Meet RL demand (fair share between runs when it exceeds the cluster): free accelerators and
   elastic loans first, then PreemptionRequested to the cheapest jobs (lost work, restart cost;
   on ties the one expected to end soonest).
3. Reclaim ahead of announced demand (``reserve``): a job in the way is asked ``grace_s`` before
   the reservation, so it is gone by then without the role waiting. Jobs that save on request
   release early (they keep a margin for saving): from how early they did so far, a deadline
   runs that much past the reservation, within a budget of RL slack (``rl_wait_budget``), so
   they leave as RL starts instead of idling the accelerators until it does.
4. EASY backfill of the FIFO queue: a job starts if it fits now and does not delay the queue's
   head; one that would overlap an announced reservation or the head's start starts only if it
   can be asked to leave in time and saves more work before then than its restart costs (the
   head's start is then reclaimed like a reservation, from younger jobs only).
5. Lend what is still idle to elastic roles (decode), taken back first, at once.

Pinned devices (``role_devices_pinned``, the live scheduler with ``lend_role_accelerators``): the
accelerators within a role's guarantee are its own devices (its actors keep them for life and
lend their memory), so the role gets back exactly those. Its grants within the guarantee come
from its own idle devices only, the jobs on them (``StartJob.borrowed``) are the ones preempted
when its demand returns, and only free accelerators no role owns go past a guarantee or to
elastic loans. A job takes unowned free accelerators first, then idle roles' own devices.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

from rollmesh.scheduling.availability import Availability
from rollmesh.scheduling.commands import (
    Command,
    GrantRole,
    GrowDecode,
    KillJob,
    ReclaimRole,
    RequestPreemption,
    ShrinkDecode,
    StartJob,
    in_execution_order,
)
from rollmesh.scheduling.errors import (
    InvalidJobError,
    OverCommittedError,
    RunAlreadyRegisteredError,
    UnknownJobError,
    UnknownRoleError,
)
from rollmesh.scheduling.fair_share import RoleDemand, fair_targets
from rollmesh.scheduling.job_progress import JobProgress, ReleaseLeads, choose_victims
from rollmesh.scheduling.lending_state import HeadClaim, RoleState, RunState, SchedulerStats
from rollmesh.scheduling.pinned_devices import PinnedDevices
from rollmesh.scheduling.workload import RoleShare, SimJob


class LendingScheduler(PinnedDevices):
    def __init__(self, capacity: int, *, max_loan_grace_s: float = 300.0, rl_wait_budget: float = 0.02,
                 role_devices_pinned: bool = False) -> None:
        """``max_loan_grace_s``: a job with a longer grace period would hold RL's guaranteed
        accelerators past an announced reclaim, so it only runs on accelerators no role is
        guaranteed. ``rl_wait_budget``: the share of elapsed time by which preemption deadlines
        may run past RL's announced reservations in all (0: never past them). Jobs release some
        time before their deadline (they keep a margin for saving); a deadline that late asks
        them that much later, so they leave when RL starts instead of idling the accelerators
        until it does. A job that uses its whole grace makes RL wait at most that long.
        ``role_devices_pinned``: a role's guaranteed accelerators are its own devices (module
        docstring)."""
        self.capacity = capacity
        self.role_devices_pinned = role_devices_pinned
        # Pinned devices: job id -> {(run_id, role): that role's own devices the job runs on}.
        self._borrowed: dict[str, dict[tuple[str, str], int]] = {}
        self.max_loan_grace_s = max_loan_grace_s
        self.rl_wait_budget = rl_wait_budget
        self._runs: dict[str, RunState] = {}
        self._jobs: dict[str, JobProgress] = {}
        self._queue: list[JobProgress] = []  # queued jobs in submission order
        self._seq = 0
        self._planned: dict[str, float] = {}  # job id -> when it must be asked to leave
        self._head: HeadClaim | None = None
        self._started = self._finished = self._preemptions = self._kills = 0
        self._waited: dict[str, float] = {}
        # RL slack: seconds a reservation's preemption deadlines may run past it, budgeted.
        self._leads = ReleaseLeads()
        self._slack: dict[float, float] = {}  # reservation time -> slack held for it
        self._slack_used: dict[float, float] = {}  # reservation time -> most slack a job was given
        self._slack_spent = 0.0
        self._budget_since: float | None = None

    # --- RL side ------------------------------------------------------------------------------

    def register_run(
        self, run_id: str, roles: Mapping[str, RoleShare], now: float, *, weight: float = 1.0
    ) -> list[Command]:
        if run_id in self._runs:
            raise RunAlreadyRegisteredError(run_id=run_id)
        guaranteed = self._guaranteed()
        if guaranteed + sum(share.guaranteed for share in roles.values()) > self.capacity:
            raise OverCommittedError(
                resource="accelerators", total=self.capacity, held=guaranteed,
                requested={f"{run_id}/{role}": share.guaranteed for role, share in roles.items()})
        self._runs[run_id] = RunState(weight, {role: RoleState(share) for role, share in roles.items()})
        if self._budget_since is None:
            self._budget_since = now
        return self._schedule(now)

    def set_demand(self, run_id: str, demand: Mapping[str, int], now: float) -> list[Command]:
        """The named roles need these many accelerators from now on (their announcements up to now
        are spent). Name every role a phase change moves in one call: one at a time, the pass in
        between would see a half-changed run."""
        for role, accelerators in demand.items():
            state = self._role(run_id, role)
            state.demand = accelerators
            state.reservations = [(at, count) for at, count in state.reservations if at > now]
        return self._schedule(now)

    def reserve(self, run_id: str, demand: Mapping[str, int], at: float, now: float) -> list[Command]:
        """Announce that the named roles will need these many accelerators from ``at`` on,
        replacing what they announced for ``at`` and later. The earlier, the less is lost: a job
        in the way is asked to leave ``grace_s`` before ``at``, and backfill prefers jobs that
        end before it."""
        for role, accelerators in demand.items():
            state = self._role(run_id, role)
            state.reservations = [(t, count) for t, count in state.reservations if t < at]
            state.reservations.append((at, accelerators))
        return self._schedule(now)

    # --- simulation jobs ----------------------------------------------------------------------

    def submit(self, job: SimJob, now: float) -> list[Command]:
        if job.job_id in self._jobs:
            raise InvalidJobError("already submitted", job_id=job.job_id)
        if job.accelerators > self.capacity:
            raise InvalidJobError(f"needs {job.accelerators} of {self.capacity} accelerators",
                                  job_id=job.job_id)
        progress = JobProgress(job, seq=self._seq)
        self._seq += 1
        self._jobs[job.job_id] = progress
        self._queue.append(progress)
        return self._schedule(now)

    def checkpointed(self, job_id: str, now: float) -> list[Command]:
        """The job saved its progress. Nothing moves; later victim choices count it."""
        self._job(job_id).checkpoint(now)
        return []

    def acknowledged(self, job_id: str, now: float) -> list[Command]:
        """The job released its accelerators (PreemptionAcknowledged); it waits in the queue again."""
        progress = self._job(job_id)
        if progress.state == "preempting":
            self._leads.released(progress.job, progress.deadline - now)
        if progress.state != "queued":
            progress.release(now)
            self._borrowed.pop(job_id, None)
            self._requeue(progress)
        return self._schedule(now)

    def finished(self, job_id: str, now: float) -> list[Command]:
        progress = self._jobs.pop(job_id, None)
        if progress is None:
            raise UnknownJobError(job_id=job_id)
        self._borrowed.pop(job_id, None)
        if progress.state == "queued":
            self._queue.remove(progress)
        self._finished += 1
        return self._schedule(now)

    def tick(self, now: float) -> list[Command]:
        return self._schedule(now)

    def next_wakeup(self) -> float | None:
        """When the core next needs a ``tick`` (a deadline, or a planned preemption request)."""
        times = [p.deadline for p in self._jobs.values() if p.state == "preempting"]
        times.extend(self._planned.values())
        return min(times, default=None)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            jobs_submitted=self._seq, jobs_started=self._started, jobs_finished=self._finished,
            preemptions=self._preemptions, kills=self._kills, queued=len(self._queue),
            rl_queueing_s=dict(self._waited))

    # --- the pass -----------------------------------------------------------------------------

    def _schedule(self, now: float) -> list[Command]:
        commands: list[Command] = []
        lent_before = {key: role.lent for key, role in self._roles()}
        for _, role in self._roles():
            role.lent = 0  # loans are taken back first: count them free for this pass
        self._kill_overdue(now, commands)
        self._meet_rl_demand(now, commands)
        self._reclaim_ahead(now, commands)
        if self._backfill(now, commands):
            self._reclaim_ahead(now, commands)  # plan when the new loans must be asked back
        self._lend_idle(now, lent_before, commands)
        self._note_waits(now)
        return in_execution_order(commands)

    def _kill_overdue(self, now: float, commands: list[Command]) -> None:
        for progress in list(self._jobs.values()):
            if progress.state == "preempting" and progress.deadline <= now:
                self._leads.released(progress.job, 0.0)
                progress.release(now)
                self._borrowed.pop(progress.job.job_id, None)
                self._requeue(progress)
                self._kills += 1
                commands.append(KillJob(progress.job.job_id, reason="no release by the preemption deadline"))

    def _meet_rl_demand(self, now: float, commands: list[Command]) -> None:
        demands = [RoleDemand(run_id, name, role.demand, role.share.guaranteed, role.share.priority,
                              self._runs[run_id].weight) for (run_id, name), role in self._roles()]
        targets = fair_targets(self.capacity, demands)
        for (run_id, name), role in self._roles():
            if role.held > targets[run_id, name]:
                taken = role.held - targets[run_id, name]
                role.held -= taken
                commands.append(ReclaimRole(run_id, name, taken, role.held))
        if self.role_devices_pinned:
            self._meet_pinned_demand(now, targets, commands)
            return
        free = self._free()
        by_priority = sorted(self._roles(), key=lambda item: (-item[1].share.priority, item[0]))
        for (run_id, name), role in by_priority:
            given = min(targets[run_id, name] - role.held, free)
            if given > 0:
                role.held += given
                free -= given
                commands.append(GrantRole(run_id, name, given, role.held))
        unmet = sum(targets[key] - role.held for key, role in self._roles())
        leaving = sum(p.job.accelerators for p in self._jobs.values() if p.state == "preempting")
        if unmet > leaving:
            running = [p for p in self._jobs.values() if p.state == "running"]
            for victim in choose_victims(running, unmet - leaving, lambda p: now,
                                         lambda p: self._expected_end(p, now)):
                self._request(victim, now, "RL demand", commands)

    def _reclaim_ahead(self, now: float, commands: list[Command]) -> None:
        """Ask jobs in the way of announced RL demand, then of the queue head's start, to leave
        exactly ``grace_s`` before it (before it plus their expected release lead, within the RL
        slack budget, for RL demand)."""
        planned, self._planned = self._planned, {}
        self._settle_slack(now)
        profile = self._availability(now)
        claims = [(at, None) for at in sorted(
            {at for _, role in self._roles() for at, _ in role.reservations if at > now})]
        head = self._head
        if head is not None and head.progress.state == "queued" and head.start > now:
            claims.append((head.start, head))
        chosen: set[str] = set()
        if self.role_devices_pinned:  # roles' own devices first: only those serve their return
            self._reclaim_own_devices_ahead(now, profile, chosen, commands)

        def ends(progress: JobProgress) -> float:
            return self._expected_end(progress, now)

        for at, claim in claims:
            if claim is not None:
                profile.shift(claim.start, claim.end, -claim.progress.job.accelerators)
            deficit = -profile.at(at)
            if deficit <= 0:
                continue
            # Only younger jobs make way for the queue's head: it is FIFO, not a priority.
            in_the_way = [p for p in self._jobs.values() if p.state == "running"
                          and p.job.job_id not in chosen and self._expected_end(p, now) > at
                          and (claim is None or p.seq > claim.progress.seq)]
            # Victims planned before go first (re-choosing by costs that moved since could pick a
            # job it is now too late to ask), then others that can be asked in time; jobs it is
            # too late to ask only if those run short.
            # Announced RL demand may take budgeted slack: deadlines that late make jobs leave at it.
            cap = self._slack_cap(at, in_the_way, hold=True) if claim is None else 0.0
            slack = {p.job.job_id: min(cap, self._leads.expected(p.job)) for p in in_the_way}
            timely = [p for p in in_the_way if at + slack[p.job.job_id] - p.job.grace_s >= now]
            victims: list[JobProgress] = []
            for tier in ([p for p in timely if p.job.job_id in planned],
                         [p for p in timely if p.job.job_id not in planned],
                         [p for p in in_the_way if p not in timely] if claim is None else []):
                short = deficit - sum(v.job.accelerators for v in victims)
                if short > 0:
                    victims += choose_victims(
                        tier, short, lambda p: max(now, at + slack[p.job.job_id] - p.job.grace_s), ends)
            for victim in victims:
                chosen.add(victim.job.job_id)
                profile.shift(at, self._expected_end(victim, now), victim.job.accelerators)
                own = slack[victim.job.job_id]
                request_at = at + own - victim.job.grace_s
                if request_at <= now:
                    self._request(victim, now, "announced RL demand" if claim is None else "queue head", commands,
                                  slack=own)
                    if own > 0:
                        self._slack_used[at] = max(own, self._slack_used.get(at, 0.0))
                else:
                    self._planned[victim.job.job_id] = request_at

    def _backfill(self, now: float, commands: list[Command]) -> bool:
        """EASY: FIFO, and the first job that does not fit gets a start time (its ``HeadClaim``)
        that the jobs behind it may not delay, unless they are loans worth making that leave in
        time for it. Returns whether it lent any (a job started that must leave early)."""
        self._head = None
        lent = False
        if not self._queue or self._free() <= 0:
            return lent
        profile = self._availability(now)
        spare = (self.capacity - self._guaranteed()
                 - sum(p.job.accelerators for p in self._jobs.values()
                       if p.state != "queued" and p.job.grace_s > self.max_loan_grace_s))
        for loans in (False, True):  # jobs that fit first, then loans that will be preempted
            for progress in list(self._queue):
                job = progress.job
                free = profile.at(now)
                if free <= 0:
                    return lent
                end = now + self._remaining(progress)
                if job.accelerators > free:
                    if self._head is None:
                        start = profile.earliest_window(job.accelerators, end - now)
                        self._head = HeadClaim(progress, start, start + end - now)
                    continue
                if job.grace_s > self.max_loan_grace_s and job.accelerators > spare:
                    continue
                clash = profile.first_short(now, end, job.accelerators)
                head = self._head
                if head is not None and end > head.start and (
                        profile.min_over(head.start, head.end) - job.accelerators < head.progress.job.accelerators):
                    clash = head.start if clash is None else min(clash, head.start)
                if clash is not None and not (loans and self._worth_lending(progress, now, clash)):
                    continue
                profile.shift(now, end, -job.accelerators)
                if job.grace_s > self.max_loan_grace_s:
                    spare -= job.accelerators
                self._queue.remove(progress)
                borrowed = self._place(job.accelerators)
                if borrowed:
                    self._borrowed[job.job_id] = borrowed
                progress.start(now)
                self._started += 1
                lent = lent or clash is not None
                commands.append(StartJob(job.job_id, job.accelerators,
                                         tuple((run_id, role, n) for (run_id, role), n in borrowed.items())))
        return lent

    def _worth_lending(self, progress: JobProgress, now: float, clash: float) -> bool:
        """Whether a job that must leave by ``clash`` saves more work before then than it costs
        (it computes on through its grace until it saves, as jobs released before did)."""
        job = progress.job
        lead = self._leads.expected(job)
        deadline = clash + (min(lead, self._slack_cap(clash, [progress], hold=False))
                            if self._is_reserved(clash) else 0.0)
        ask_at = deadline - job.grace_s
        if ask_at <= now:
            return False  # it could not be asked in time: RL would wait
        reload = job.restart_cost_s if progress.starts else 0.0
        if job.saves_on_request():
            stops = max(ask_at, deadline - lead - (job.checkpoint_s or 0.0))
            saved = stops - now - reload
        elif job.checkpoint_interval_s > 0:
            done = progress.saved_s + max(0.0, clash - now - reload)
            saved = math.floor(done / job.checkpoint_interval_s) * job.checkpoint_interval_s - progress.saved_s
        else:
            saved = 0.0
        return saved > job.restart_cost_s + (job.checkpoint_s or 0.0)

    def _lend_idle(self, now: float, lent_before: dict[tuple[str, str], int], commands: list[Command]) -> None:
        free = self._unowned_free() if self.role_devices_pinned else self._free()
        for (run_id, name), role in sorted(self._roles(), key=lambda item: (-item[1].share.priority, item[0])):
            if role.share.elastic_limit and role.demand > 0 and role.held >= role.demand:
                role.lent = min(role.share.elastic_limit, free)
                free -= role.lent
        for (run_id, name), role in self._roles():
            before = lent_before.get((run_id, name), 0)
            if role.lent > before:
                commands.append(GrowDecode(run_id, name, role.lent - before, role.lent))
            elif role.lent < before:
                commands.append(ShrinkDecode(run_id, name, before - role.lent, role.lent))

    def _note_waits(self, now: float) -> None:
        for (run_id, name), role in self._roles():
            if role.held < role.demand and role.waiting_since is None:
                role.waiting_since = now
            elif role.held >= role.demand and role.waiting_since is not None:
                key = f"{run_id}/{name}"
                self._waited[key] = self._waited.get(key, 0.0) + now - role.waiting_since
                role.waiting_since = None

    # --- helpers ------------------------------------------------------------------------------

    def _availability(self, now: float) -> Availability:
        """Free-for-jobs over time: loans count as free, RL's unmet and announced demand as taken."""
        changes: list[tuple[float, int]] = []
        for progress in self._jobs.values():
            if progress.state == "running":
                changes.append((self._expected_end(progress, now), progress.job.accelerators))
            elif progress.state == "preempting":
                # Expected gone by leave_by; one still there past it may hold on to its deadline.
                leaves = progress.leave_by if progress.leave_by > now else progress.deadline
                changes.append((leaves, progress.job.accelerators))
        unmet = 0
        for _, role in self._roles():
            level = max(role.demand, role.held)
            unmet += level - role.held
            for at, count in role.reservations:
                changes.append((at, level - count))
                level = count
        return Availability(now, self._free() - unmet, changes)

    def _expected_end(self, progress: JobProgress, now: float) -> float:
        """By its expected duration; a job already past it is assumed to run on."""
        end = progress.end_at(progress.job.expected_duration_s)
        return end if end > now else math.inf

    def _remaining(self, progress: JobProgress) -> float:
        reload = progress.job.restart_cost_s if progress.starts else 0.0
        return reload + max(1.0, progress.job.expected_duration_s - progress.saved_s)

    def _request(self, progress: JobProgress, now: float, reason: str, commands: list[Command], *,
                 slack: float = 0.0) -> None:
        progress.state = "preempting"
        progress.deadline = now + progress.job.grace_s
        progress.leave_by = progress.deadline - slack
        self._preemptions += 1
        commands.append(RequestPreemption(progress.job.job_id, progress.deadline, reason))

    def _slack_cap(self, at: float, jobs: list[JobProgress], *, hold: bool) -> float:
        """The most seconds deadlines of jobs leaving for the reservation at ``at`` may run past
        it: what ``jobs`` need (their release leads), within what is left of the budget. Held once
        chosen (``hold``), so plans built on it stay valid; what no job was given is refunded."""
        if at in self._slack:
            return self._slack[at]
        # The budget accrues with the run's time, up to the reservation.
        budget = (0.0 if self._budget_since is None else
                  self.rl_wait_budget * (at - self._budget_since) - self._slack_spent - sum(self._slack.values()))
        cap = min(max((self._leads.expected(p.job) for p in jobs), default=0.0), budget)
        if cap <= 0:
            return 0.0
        if hold:
            self._slack[at] = cap
        return cap

    def _settle_slack(self, now: float) -> None:
        for at in [at for at in self._slack if at <= now]:
            del self._slack[at]
            self._slack_spent += self._slack_used.pop(at, 0.0)

    def _is_reserved(self, at: float) -> bool:
        return any(t == at for _, role in self._roles() for t, _ in role.reservations)

    def _requeue(self, progress: JobProgress) -> None:
        seqs = [p.seq for p in self._queue]
        self._queue.insert(bisect.bisect_left(seqs, progress.seq), progress)

    def _free(self) -> int:
        rl = sum(role.held + role.lent for _, role in self._roles())
        jobs = sum(p.job.accelerators for p in self._jobs.values() if p.state != "queued")
        return self.capacity - rl - jobs

    def _guaranteed(self) -> int:
        return sum(role.share.guaranteed for _, role in self._roles())

    def _roles(self) -> list[tuple[tuple[str, str], RoleState]]:
        return [((run_id, name), role) for run_id, run in self._runs.items() for name, role in run.roles.items()]

    def _role(self, run_id: str, role: str) -> RoleState:
        run = self._runs.get(run_id)
        if run is None or role not in run.roles:
            raise UnknownRoleError(run_id=run_id, role=role)
        return run.roles[role]

    def _job(self, job_id: str) -> JobProgress:
        progress = self._jobs.get(job_id)
        if progress is None:
            raise UnknownJobError(job_id=job_id)
        return progress
