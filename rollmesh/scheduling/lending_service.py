"""The live GPU scheduler's logic: NATS events in, the lending core's commands carried out.

Knows the scheduling core (``LendingScheduler``, the same code the simulator runs), the wire
messages and two ports: ``JobLauncher`` (starts a job's process in its own accelerators; Ray in
the actor, fakes in unit tests) and ``Publisher``. No Ray, NATS or wall clock of its own.

Events in: ``SimJobSubmitted`` (durable: acked once written to the job ledger), ``RoleDemandChanged``,
``SchedulerStatusRequest`` (request/reply). Each goes to the core, whose commands are carried out:
- ``StartJob``: launch the job's next attempt (``SimJobStarted``); a watcher waits for its exit.
- ``RequestPreemption``: ``PreemptionRequested`` with the deadline, then SIGTERM through the
  launcher. The job checkpoints and exits; its exit is its ``PreemptionAcknowledged``, and the
  core takes the job back into its queue (``SimJobEnded`` "preempted").
- ``KillJob``: the deadline passed; SIGKILL (``SimJobEnded`` "killed"; it restarts later from its
  last checkpoint, losing what it did since).
- ``GrantRole`` / ``ReclaimRole``: ``GpuGranted`` / ``GpuReleased`` for the RL role, one per
  accelerator beyond its start grant. Loans to decode (``GrowDecode`` / ``ShrinkDecode``) are
  announced the same way with holder "decode.elastic", each grant id naming the decode worker
  placed there; a release is announced before the worker is stopped, so routers drop it first.
Busy time: ``record_busy`` takes each process's metric snapshot (a core subscription, as the
metrics hub watches them), whose ``rollmesh_role_busy_seconds`` says how long an RL role's worker
computed; what a role holds counts as busy in that proportion (``role_busy.RoleBusyRates``).
Lending the roles' own accelerators (``scheduler.lend_role_accelerators``; a ``RoleMemory`` port
given): a role's demand may drop below its start grant. The core (with pinned role devices) then
reclaims some of its own devices: their workers release their memory first (``RoleMemory.release``,
awaited), and only then may a job start there (``StartJob.borrowed``: the launcher is told which
devices). When the role's demand returns the core preempts the jobs on its devices; once they have
left, its grant comes back and the workers resume their memory (``RoleMemory.resume``), so a role
never computes on memory a job still uses.
A job that exits on its own is finished (exit 0) or failed. ``tick`` runs the core's timers
(deadlines, planned reclaims), which the actor calls at ``next_wakeup``. ``close`` (the mesh
going down) preempts every running job the same way and leaves it unfinished in the ledger.

Durability: the job ledger (``job_ledger``, ``<run dir>/scheduler/jobs.jsonl``: submitted specs, then final
outcomes) is read back at start, and every unfinished job is queued again: its next attempt
resumes from its own checkpoint directory. Jobs run in actors the scheduler owns, and each job's
process dies with its runner (``sim_job_runner``), so a scheduler that crashed leaves no job
running on accelerators it no longer accounts for.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from rollmesh.messages import GpuGranted, GpuReleased, PreemptionAcknowledged, PreemptionRequested
from rollmesh.messages.metrics import MetricsReported
from rollmesh.messages.sim_jobs import (
    DECODE_LOAN_HOLDER,
    RoleDemandChanged,
    RunRegistered,
    SchedulerStatus,
    SchedulerStatusRequest,
    SimJobEnded,
    SimJobStarted,
    SimJobSubmitted,
)
from rollmesh.messages.subjects import (
    GPU_GRANTED,
    GPU_RELEASED,
    METRICS_REPORTED,
    PREEMPTION_ACKNOWLEDGED,
    PREEMPTION_REQUESTED,
    ROLE_DEMAND,
    RUN_REGISTERED,
    SCHED_STATUS,
    SCHED_UTILIZATION,
    SIM_ENDED,
    SIM_STARTED,
    SIM_SUBMITTED,
)
from rollmesh.ports import MessageContext, Publisher, Subscription
from rollmesh.scheduling.accounting import UtilizationAccount
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
from rollmesh.scheduling.errors import SchedulingError
from rollmesh.scheduling.job_ledger import JobLedger
from rollmesh.scheduling.lending import LendingScheduler
from rollmesh.scheduling.role_busy import RoleBusyRates
from rollmesh.scheduling.workload import RoleShare, SimJob
from rollmesh.telemetry import metrics_catalog


class JobHandle(Protocol):
    async def request_preemption(self) -> None: ...

    async def kill(self) -> None: ...

    async def wait(self) -> int: ...

    async def release(self) -> None: ...

    def checkpointed_at(self) -> float | None:
        """When the job last wrote its checkpoint (None: never), on the scheduler's clock."""


class JobLauncher(Protocol):
    async def launch(self, job: SimJobSubmitted, *, attempt: int, accelerators: int,
                     borrowed: list[str]) -> JobHandle:
        """``borrowed``: devices of roles' own (``RoleMemory.release`` named them) among the
        job's ``accelerators``; the rest are free accelerators."""


class RoleMemory(Protocol):
    """The mesh's own roles' workers lending their memory, one device at a time."""

    async def release(self, role: str, count: int) -> list[str]:
        """``count`` of ``role``'s idle workers release their memory (engines: weights and KV to
        host memory; the trainer: weights and optimizer state); returns their devices' names."""

    async def resume(self, role: str, devices: list[str]) -> None:
        """The workers on ``devices`` (released before, no job on them any more) bring their
        memory back; returns once they can compute."""


class RoleGroups(Protocol):
    """What roles hold beyond their start grants, one accelerator per holding (a placement group;
    for an elastic loan to decode, the decode worker placed in it). A holding's id is the grant
    id announced for it."""

    async def grow(self, holder: str, accelerators: int) -> list[str]: ...

    def pick(self, holder: str, accelerators: int) -> list[str]:
        """The holdings to give back, newest first, taken off the books."""

    async def release(self, holder: str, grant_ids: list[str]) -> None: ...

    def held(self, holder: str) -> list[str]: ...


@dataclass
class _Attempt:
    handle: JobHandle
    number: int
    started_at: float
    state: str = "running"  # running | preempting | killed


def whole_start_grants(grants: dict[str, float], capacity: int) -> dict[str, int]:
    """The config's start grants in whole accelerators, as the lending core counts them: a role's
    fraction of an accelerator makes that accelerator unlendable (rounded up), but roles sharing
    one by fractions hold it once (the rounding never exceeds the whole accelerators they use)."""
    whole = {role: math.ceil(count) for role, count in grants.items()}
    used = min(capacity, math.ceil(sum(grants.values()) - 1e-9))
    # Give back the roundings that overshoot, from the roles rounded up the most.
    for role in sorted(whole, key=lambda r: whole[r] - grants[r], reverse=True):
        if sum(whole.values()) <= used:
            break
        if whole[role] > grants[role]:
            whole[role] -= 1
    return whole


def _core_job(spec: SimJobSubmitted) -> SimJob:
    return SimJob(job_id=spec.job_id, accelerators=spec.accelerators, expected_duration_s=spec.expected_duration_s,
                  grace_s=spec.grace_s, checkpoint_interval_s=spec.checkpoint_interval_s,
                  checkpoint_s=spec.checkpoint_s, restart_cost_s=spec.restart_cost_s)


class LendingService:
    def __init__(self, core: LendingScheduler, *, run_id: str, roles: dict[str, RoleShare],
                 start_grants: dict[str, int], launcher: JobLauncher, role_groups: RoleGroups, publisher: Publisher,
                 clock: Callable[[], float], ledger: JobLedger, resource: str,
                 account: UtilizationAccount, busy_rates: RoleBusyRates | None = None,
                 role_memory: RoleMemory | None = None) -> None:
        """``role_memory``: lend the roles' own accelerators (``scheduler.lend_role_accelerators``);
        the core must pin role devices then."""
        if role_memory is not None and not core.role_devices_pinned:
            raise ValueError("lending roles' accelerators needs a core with role_devices_pinned=True")
        self.core = core
        self.role_memory = role_memory
        # Lent roles' devices: released and idle, by role; and those a job runs on, by job.
        self.released_devices: dict[str, list[str]] = {}
        self.job_devices: dict[str, list[tuple[str, str]]] = {}
        self.run_id = run_id
        self.launcher = launcher
        self.publisher = publisher
        self.clock = clock
        self.ledger = ledger
        self.resource = resource
        self.account = account
        # How busy each role's workers are (their metric snapshots); without reports, held = busy.
        self.busy_rates = busy_rates or RoleBusyRates(stale_s=10.0)
        self.specs: dict[str, SimJobSubmitted] = {}
        self.attempts: dict[str, _Attempt] = {}
        self.attempt_counts: dict[str, int] = {}
        self.queued: set[str] = set()
        self.role_held: dict[str, int] = {}
        self._watchers: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()  # one core pass at a time: handlers and the timer interleave
        self.role_groups = role_groups
        # What each role's own actors hold for life (Ray resources of the mesh's actors): its
        # demand never drops below it, and granting it again announces nothing new.
        self.start_grants = start_grants
        self._roles = roles

    async def start(self) -> None:
        """Register the run, queue the ledger's unfinished jobs again, meet the initial demand."""
        async with self._lock:
            now = self.clock()
            await self._execute(self.core.register_run(self.run_id, self._roles, now))
            for spec in self.ledger.unfinished():
                self.specs[spec.job_id] = spec
                self.queued.add(spec.job_id)
                await self._execute(self.core.submit(_core_job(spec), now))
            await self._execute(self.core.set_demand(self.run_id, self.start_grants, now))

    def subscriptions(self) -> list[Subscription]:
        return [Subscription(SIM_SUBMITTED, self.handle_submitted, mode="jetstream"),
                Subscription(ROLE_DEMAND, self.handle_demand, mode="jetstream"),
                Subscription(RUN_REGISTERED, self.handle_run_registered, mode="jetstream"),
                Subscription(SCHED_STATUS, self.handle_status, mode="request"),
                Subscription(METRICS_REPORTED, self.handle_metrics_reported, mode="core")]

    # --- events ----------------------------------------------------------------------------

    async def handle_submitted(self, message: SimJobSubmitted, context: MessageContext) -> None:
        async with self._lock:
            now = self.clock()
            if message.job_id in self.specs:
                if self.specs[message.job_id] == message:
                    return  # a redelivery of what the ledger already holds
                await self._ended(message.job_id, 0, "rejected", reason="a different job has this id")
                return
            try:
                commands = self.core.submit(_core_job(message), now)
            except SchedulingError as exc:
                await self._ended(message.job_id, 0, "rejected", reason=str(exc))
                return
            # Durable before the ack (the shell acks when this returns): a restart queues it again.
            await asyncio.to_thread(self.ledger.append, {"event": "submitted", "job": msgspec.to_builtins(message)})
            self.specs[message.job_id] = message
            self.queued.add(message.job_id)
            await self._execute(commands)

    async def handle_demand(self, message: RoleDemandChanged, context: MessageContext) -> None:
        async with self._lock:
            run_id = message.run_id or self.run_id
            # What the role's own actors hold is a floor unless their memory can be lent.
            lendable = self.role_memory is not None or run_id != self.run_id
            floor = 0 if lendable else self.start_grants.get(message.role, 0)
            try:
                commands = self.core.set_demand(run_id, {message.role: max(message.accelerators, floor)},
                                                self.clock())
            except SchedulingError:
                return  # an unknown run or role: nothing to change (logged by the shell's span)
            await self._execute(commands)

    async def handle_run_registered(self, message: RunRegistered, context: MessageContext) -> None:
        """Another run shares the cluster (fair share by weight beyond the guarantees). A repeat
        is ignored; a run whose guarantees do not fit beside the others' is refused (logged by
        the shell's span): it gets nothing guaranteed rather than a promise the cluster breaks."""
        async with self._lock:
            roles = {role: RoleShare(guaranteed=count) for role, count in message.guaranteed.items()}
            try:
                commands = self.core.register_run(message.run_id, roles, self.clock(), weight=message.weight)
            except SchedulingError:
                return
            await self._execute(commands)

    async def handle_status(self, message: SchedulerStatusRequest, context: MessageContext) -> SchedulerStatus:
        return self.status()

    async def tick(self) -> None:
        async with self._lock:
            await self._execute(self.core.tick(self.clock()))

    def next_wakeup(self) -> float | None:
        return self.core.next_wakeup()

    # --- commands --------------------------------------------------------------------------

    async def _execute(self, commands: list[Command]) -> None:
        now = self.clock()
        for command in commands:
            match command:
                case StartJob(job_id=job_id, accelerators=accelerators, borrowed=borrowed):
                    await self._start(job_id, accelerators, now, borrowed)
                case RequestPreemption(job_id=job_id, deadline=deadline, reason=reason):
                    attempt = self.attempts[job_id]
                    attempt.state = "preempting"
                    spec = self.specs[job_id]
                    await self.publisher.publish(PREEMPTION_REQUESTED, PreemptionRequested(
                        grant_id=job_id, holder=job_id, grace_s=spec.grace_s, reason=reason, deadline=deadline))
                    await attempt.handle.request_preemption()
                case KillJob(job_id=job_id):
                    attempt = self.attempts[job_id]
                    attempt.state = "killed"
                    await attempt.handle.kill()
                case GrantRole(run_id=run_id, role=role, accelerators=count, held=held):
                    await self._grant(run_id, self._holder(run_id, role), count, held, now)
                case ReclaimRole(run_id=run_id, role=role, accelerators=count, held=held):
                    await self._reclaim(run_id, self._holder(run_id, role), count, held, now)
                case GrowDecode(run_id=run_id, accelerators=count, lent=lent):
                    await self._grant(run_id, DECODE_LOAN_HOLDER, count, lent, now)
                case ShrinkDecode(run_id=run_id, accelerators=count, lent=lent):
                    await self._reclaim(run_id, DECODE_LOAN_HOLDER, count, lent, now)
        self._account(now)

    def _holder(self, run_id: str, role: str) -> str:
        """The mesh's own roles by name; another registered run's as "<run>/<role>"."""
        return role if run_id == self.run_id else f"{run_id}/{role}"

    async def _grant(self, run_id: str, holder: str, count: int, held: int, now: float) -> None:
        """Record a role's grant; what goes past its start grant is placed, then announced."""
        own = self.start_grants.get(holder, 0) if run_id == self.run_id else 0
        extra = held - max(own, held - count)
        self.role_held[holder] = held
        comes_back = min(own, held) - min(own, held - count)  # own devices lent before
        if comes_back > 0 and self.role_memory is not None:
            devices = self.released_devices.get(holder, [])
            back, self.released_devices[holder] = devices[:comes_back], devices[comes_back:]
            await self.role_memory.resume(holder, back)
        if extra > 0:
            for grant_id in await self.role_groups.grow(holder, extra):
                await self.publisher.publish(GPU_GRANTED, GpuGranted(
                    grant_id=grant_id, holder=holder, role=holder.split("/")[-1].split(".")[0], count=1,
                    resource=self.resource, granted_at=now))

    async def _reclaim(self, run_id: str, holder: str, count: int, held: int, now: float) -> None:
        """Announce first (routers stop sending work to a lent worker), then take back."""
        own = self.start_grants.get(holder, 0) if run_id == self.run_id else 0
        extra = (held + count) - max(own, held)
        self.role_held[holder] = held
        if extra > 0:
            picked = self.role_groups.pick(holder, extra)
            for grant_id in picked:
                await self.publisher.publish(GPU_RELEASED, GpuReleased(
                    grant_id=grant_id, holder=holder, count=1, released_at=now))
            await self.role_groups.release(holder, picked)
        lent = min(own, held + count) - min(own, held)  # own devices: their memory is lent
        if lent > 0 and self.role_memory is not None:
            released = await self.role_memory.release(holder, lent)
            self.released_devices.setdefault(holder, []).extend(released)

    async def _start(self, job_id: str, accelerators: int, now: float,
                     borrowed: tuple[tuple[str, str, int], ...] = ()) -> None:
        number = self.attempt_counts.get(job_id, 0) + 1
        self.attempt_counts[job_id] = number
        self.queued.discard(job_id)
        devices: list[tuple[str, str]] = []
        for run_id, role, count in borrowed:
            holder = self._holder(run_id, role)
            idle = self.released_devices.get(holder, [])
            devices += [(holder, device) for device in idle[:count]]
            self.released_devices[holder] = idle[count:]
        self.job_devices[job_id] = devices
        handle = await self.launcher.launch(self.specs[job_id], attempt=number, accelerators=accelerators,
                                            borrowed=[device for _, device in devices])
        self.attempts[job_id] = _Attempt(handle, number, now)
        await self.publisher.publish(SIM_STARTED, SimJobStarted(
            job_id=job_id, attempt=number, accelerators=accelerators, started_at=now))
        watcher = asyncio.create_task(self._watch(job_id, number, handle))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    async def _watch(self, job_id: str, number: int, handle: JobHandle) -> None:
        code = await handle.wait()
        await handle.release()  # its accelerators go back to Ray before the core lends them again
        async with self._lock:
            # Roles' devices it ran on are idle again (their memory still released).
            for holder, device in self.job_devices.pop(job_id, []):
                self.released_devices.setdefault(holder, []).append(device)
            attempt = self.attempts.pop(job_id)
            now = self.clock()
            if attempt.state == "killed":
                # The core released and queued it when it issued the kill. What it did since its
                # last checkpoint is lost: the next attempt resumes from that checkpoint.
                self.queued.add(job_id)
                since = max(attempt.started_at, handle.checkpointed_at() or attempt.started_at)
                self.account.discard((now - since) * self.specs[job_id].accelerators)
                await self._publish_ended(job_id, number, "killed", exit_code=code, now=now,
                                          reason="did not release by the preemption deadline")
                await self._execute(self.core.tick(now))
            elif attempt.state == "preempting":
                self.queued.add(job_id)
                await self.publisher.publish(PREEMPTION_ACKNOWLEDGED, PreemptionAcknowledged(grant_id=job_id, holder=job_id))
                await self._publish_ended(job_id, number, "preempted", exit_code=code, now=now)
                await self._execute(self.core.acknowledged(job_id, now))
            else:
                outcome = "finished" if code == 0 else "failed"
                await self._ended(job_id, number, outcome, exit_code=code)
                await self._execute(self.core.finished(job_id, now))

    async def _ended(self, job_id: str, number: int, outcome: str, *, exit_code: int | None = None,
                     reason: str = "") -> None:
        now = self.clock()
        if outcome != "rejected":
            await asyncio.to_thread(self.ledger.append, {"event": "ended", "job_id": job_id, "outcome": outcome})
        await self._publish_ended(job_id, number, outcome, exit_code=exit_code, now=now, reason=reason)

    async def _publish_ended(self, job_id: str, number: int, outcome: str, *, exit_code: int | None, now: float,
                             reason: str = "") -> None:
        await self.publisher.publish(SIM_ENDED, SimJobEnded(
            job_id=job_id, attempt=number, outcome=outcome, exit_code=exit_code, reason=reason, ended_at=now))

    # --- accounting ------------------------------------------------------------------------

    async def handle_metrics_reported(self, message: MetricsReported, context: MessageContext) -> None:
        self.record_busy(message)

    def record_busy(self, report: MetricsReported) -> None:
        """A process's metric snapshot: its role's busy seconds so far, if it holds accelerators."""
        now = self.clock()
        for series in report.metrics:
            if series.name == metrics_catalog.ROLE_BUSY.name:
                for point in series.points:
                    self.busy_rates.record(report.source, point.labels.get("role", ""), point.value,
                                           reported_at=report.reported_at, now=now)
        self.busy_rates.forget_stale(now)
        self._account(now)

    def _busy_share(self, holder: str, now: float) -> float:
        """The busy fraction of what ``holder`` holds: its role's workers' reported rate; 1 when
        they have not reported (another run's roles report on their own bus)."""
        if "/" in holder:
            return 1.0
        fraction = self.busy_rates.fraction(holder.split(".")[0], now)  # decode.elastic: decode
        return 1.0 if fraction is None else fraction

    def _account(self, now: float) -> None:
        # Jobs count as busy while they run (the scheduler cannot tell their saving and reloading
        # apart); RL roles as busy as their workers report computing.
        jobs = sum(self.specs[job_id].accelerators for job_id in self.attempts)
        held = {holder: count for holder, count in self.role_held.items() if count > 0}
        rl = sum(held.values())
        rl_busy = sum(count * self._busy_share(holder, now) for holder, count in held.items())
        self.account.set_rates(now, allocated=jobs + rl, busy=jobs + rl_busy, rl_held=rl)

    def status(self) -> SchedulerStatus:
        now = self.clock()
        totals = self.account.totals(now)
        stats = self.core.stats()
        jobs = {job_id: "queued" for job_id in self.queued}
        jobs.update({job_id: attempt.state for job_id, attempt in self.attempts.items()})
        return SchedulerStatus(
            capacity=self.core.capacity, roles={k: v for k, v in self.role_held.items() if v},
            jobs=jobs, allocated_utilization=totals.allocated_utilization,
            busy_utilization=totals.busy_utilization, preemptions=stats.preemptions, kills=stats.kills,
            lost_accelerator_s=totals.lost_s, rl_queueing_s=sum(stats.rl_queueing_s.values()),
            reported_at=now, decode_loan_workers=self.role_groups.held(DECODE_LOAN_HOLDER),
            roles_busy={role: fraction for role in {holder.split(".")[0] for holder in self.role_held if "/" not in holder}
                        if (fraction := self.busy_rates.fraction(role, now)) is not None})

    async def report(self) -> None:
        """Publish the accounting (``SCHED_UTILIZATION``); the actor calls it periodically."""
        async with self._lock:
            self._account(self.clock())
            status = self.status()
        await self.publisher.publish(SCHED_UTILIZATION, status)

    async def close(self, *, wait_s: float = 5.0) -> None:
        """Stop every running job as a preemption would (checkpoint and exit; killed after
        ``wait_s`` or its grace, whichever is shorter) and give its accelerators back. Their ledger
        entries stay open: a scheduler started again on this run directory resumes them."""
        for task in list(self._watchers):
            task.cancel()
        attempts = list(self.attempts.items())
        for _, attempt in attempts:
            await attempt.handle.request_preemption()

        async def leave(job_id: str, attempt: _Attempt) -> None:
            try:
                await asyncio.wait_for(attempt.handle.wait(), min(wait_s, self.specs[job_id].grace_s))
            except TimeoutError:
                await attempt.handle.kill()
                await attempt.handle.wait()
            await attempt.handle.release()

        await asyncio.gather(*(leave(job_id, attempt) for job_id, attempt in attempts))
        self.attempts.clear()
