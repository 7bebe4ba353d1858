"""The baseline policy: RL keeps a fixed reservation of its peak; simulation jobs run FIFO on the
rest, never on RL's idle accelerators and never preempted.

Knows the scheduling package only. It is what a cluster does without lending (a static partition
and a first-come-first-served queue), driven through the same calls as ``LendingScheduler`` so the
simulator and the benchmark compare the two on the same trace.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from rollmesh.scheduling.commands import Command, GrantRole, ReclaimRole, StartJob
from rollmesh.scheduling.errors import InvalidJobError, OverCommittedError
from rollmesh.scheduling.workload import RoleShare, SimJob


class StaticReservationScheduler:
    def __init__(self, capacity: int, *, reserved: int) -> None:
        if reserved > capacity:
            raise OverCommittedError(resource="accelerators", total=capacity, held=0,
                                     requested={"rl reservation": reserved})
        self.capacity = capacity
        self.reserved = reserved
        self._held: dict[tuple[str, str], int] = {}
        self._queue: deque[SimJob] = deque()
        self._running: dict[str, int] = {}

    def register_run(self, run_id: str, roles: Mapping[str, RoleShare], now: float, *,
                     weight: float = 1.0) -> list[Command]:
        self._held.update({(run_id, role): 0 for role in roles})
        return []

    def set_demand(self, run_id: str, demand: Mapping[str, int], now: float) -> list[Command]:
        """Granted at once from the reservation, as far as it goes (the peak: always, for one run)."""
        commands: list[Command] = []
        for role, accelerators in sorted(demand.items(), key=lambda item: item[1] - self._held[run_id, item[0]]):
            held = self._held[run_id, role]
            room = self.reserved - sum(self._held.values())
            target = min(accelerators, held + room)
            self._held[run_id, role] = target
            if target > held:
                commands.append(GrantRole(run_id, role, target - held, target))
            elif target < held:
                commands.append(ReclaimRole(run_id, role, held - target, target))
        return commands

    def reserve(self, run_id: str, demand: Mapping[str, int], at: float, now: float) -> list[Command]:
        return []  # the reservation is already the peak

    def submit(self, job: SimJob, now: float) -> list[Command]:
        if job.accelerators > self.capacity - self.reserved:
            raise InvalidJobError(f"needs {job.accelerators} of the {self.capacity - self.reserved} "
                                  f"accelerators outside the RL reservation", job_id=job.job_id)
        self._queue.append(job)
        return self._start_queued()

    def checkpointed(self, job_id: str, now: float) -> list[Command]:
        return []

    def acknowledged(self, job_id: str, now: float) -> list[Command]:
        return []  # it never asks anyone to leave

    def finished(self, job_id: str, now: float) -> list[Command]:
        self._running.pop(job_id, None)
        return self._start_queued()

    def tick(self, now: float) -> list[Command]:
        return []

    def next_wakeup(self) -> float | None:
        return None

    def _start_queued(self) -> list[Command]:
        """Strict FIFO: the head waits for room, and everyone behind it waits too."""
        started: list[Command] = []
        free = self.capacity - self.reserved - sum(self._running.values())
        while self._queue and self._queue[0].accelerators <= free:
            job = self._queue.popleft()
            self._running[job.job_id] = job.accelerators
            free -= job.accelerators
            started.append(StartJob(job.job_id, job.accelerators))
        return started
