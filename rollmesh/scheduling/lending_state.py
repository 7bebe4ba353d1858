"""The lending scheduler's records (``lending.LendingScheduler``): each RL run's roles with their
demand, holdings, elastic loans and announced reservations; the queue head's expected start; and
the counters it reports.

Plain data, no scheduling decisions: the algorithm that reads and writes these lives in
``lending.py`` (and ``pinned_devices.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollmesh.scheduling.job_progress import JobProgress
from rollmesh.scheduling.workload import RoleShare


@dataclass
class RoleState:
    share: RoleShare
    demand: int = 0
    held: int = 0
    lent: int = 0  # elastic loan past demand
    reservations: list[tuple[float, int]] = field(default_factory=list)  # (at, demand), sorted
    waiting_since: float | None = None


@dataclass
class RunState:
    weight: float
    roles: dict[str, RoleState]


@dataclass(frozen=True)
class HeadClaim:
    """The queue head's expected start: where it fits for its whole expected duration."""

    progress: JobProgress
    start: float
    end: float


@dataclass(frozen=True)
class SchedulerStats:
    jobs_submitted: int
    jobs_started: int
    jobs_finished: int
    preemptions: int
    kills: int
    queued: int
    # Seconds each RL role ("run/role") waited for accelerators it demanded.
    rl_queueing_s: dict[str, float]
