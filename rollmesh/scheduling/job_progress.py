"""A simulation job's progress as wall-clock arithmetic: what is saved, what a preemption loses,
and how early jobs release when asked to leave.

Knows the workload specs only. The scheduler core keeps one per job as its estimate (from the
job's expected duration and its checkpoint reports); the simulator keeps another as the truth.
Progress is seconds of useful work; it resumes from the last checkpoint after a restart, once the
restart cost has been paid.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from rollmesh.scheduling.workload import SimJob

JobState = Literal["queued", "running", "preempting"]


@dataclass
class JobProgress:
    job: SimJob
    seq: int  # submission order: the queue is FIFO in it, and a preempted job keeps its place
    state: JobState = "queued"
    saved_s: float = 0.0  # progress safe in a checkpoint
    compute_from: float = 0.0  # wall time from which progress counts up from saved_s
    deadline: float = math.inf  # while preempting: release by then or be killed
    leave_by: float = math.inf  # while preempting: when the scheduler expects it gone
    starts: int = 0

    def start(self, now: float) -> None:
        self.starts += 1
        self.state = "running"
        self.deadline = self.leave_by = math.inf
        self.compute_from = now + (self.job.restart_cost_s if self.starts > 1 else 0.0)

    def progress_at(self, now: float) -> float:
        if self.state == "queued":
            return self.saved_s
        return self.saved_s + max(0.0, now - self.compute_from)

    def checkpoint(self, now: float) -> None:
        """Everything done so far is saved (a periodic checkpoint, or one written on request)."""
        self.saved_s = self.progress_at(now)
        self.compute_from = max(now, self.compute_from)

    def release(self, now: float) -> float:
        """Back to the queue; returns the progress lost (done since the last checkpoint)."""
        lost = self.progress_at(now) - self.saved_s
        self.state = "queued"
        self.deadline = self.leave_by = math.inf
        return lost

    def end_at(self, duration_s: float) -> float:
        """When it finishes if it runs on, needing ``duration_s`` of progress in all."""
        return self.compute_from + max(0.0, duration_s - self.saved_s)

    def next_periodic_checkpoint(self, now: float) -> float:
        """Wall time of the next periodic checkpoint after ``now`` (inf if it keeps none)."""
        interval = self.job.checkpoint_interval_s
        if interval <= 0:
            return math.inf
        done = self.progress_at(now)
        # The slack keeps a checkpoint just taken (float sums land a hair below the multiple)
        # from being due again at once.
        return self.compute_from + (math.floor(done / interval + 1e-9) + 1) * interval - self.saved_s

    def preemption_loss(self, request_at: float, deadline: float) -> float:
        """Progress lost if asked at ``request_at`` to leave by ``deadline``: none when it can save
        on request or reach a periodic checkpoint in time, else what it did since the last one."""
        if self.job.saves_on_request() or self.next_periodic_checkpoint(request_at) <= deadline:
            return 0.0
        return self.progress_at(request_at) - self.saved_s

    def preemption_cost(self, request_at: float) -> float:
        """Accelerator-seconds a preemption requested now costs: lost progress, the time spent
        saving on request and the reload when it restarts."""
        job = self.job
        saving = job.checkpoint_s if job.saves_on_request() and job.checkpoint_s else 0.0
        lost = self.preemption_loss(request_at, request_at + job.grace_s)
        return job.accelerators * (lost + saving + job.restart_cost_s)


def choose_victims(
    candidates: Sequence[JobProgress], needed: int, ask_at: Callable[[JobProgress], float],
    ends: Callable[[JobProgress], float] | None = None,
) -> list[JobProgress]:
    """Jobs to preempt to free ``needed`` accelerators at least cost, each costed as if asked at
    ``ask_at(job)``. Greedy: the next pick is the one cheapest per accelerator still needed (so a
    big job is not preempted to free one accelerator); on ties, the one expected to end soonest
    (``ends``, by default its own estimate): the likeliest to finish before it has to save, and
    the quickest to finish once it restarts; then the latest submitted. A preempted job keeps its
    place in the queue, so the choice does not cost it its turn. Fewer than ``needed`` if the
    candidates run short."""
    ends = ends or (lambda p: p.end_at(p.job.expected_duration_s))
    costs = {id(p): (p.preemption_cost(ask_at(p)), ends(p)) for p in candidates}
    left = list(candidates)
    chosen: list[JobProgress] = []
    while needed > 0 and left:
        pick = min(left, key=lambda p: (costs[id(p)][0] / min(p.job.accelerators, needed), costs[id(p)][1], -p.seq))
        left.remove(pick)
        chosen.append(pick)
        needed -= pick.job.accelerators
    return chosen


class ReleaseLeads:
    """How long before its preemption deadline a job releases, learned from past releases.

    A job that saves on request keeps a margin: it saves and leaves some time before its deadline.
    Learned in save times (so jobs that save at different speeds share one figure) as a low
    quantile of the recent releases, a kill counting as none: one early leaver does not make the
    others late. A job that cannot save on request leaves whenever its periodic checkpoint falls,
    so it gets no estimate.
    """

    def __init__(self, window: int = 32) -> None:
        self._ratios: deque[float] = deque(maxlen=window)

    def released(self, job: SimJob, lead: float) -> None:
        """``job`` released ``lead`` seconds before its deadline (0 when it was killed)."""
        if job.saves_on_request() and job.checkpoint_s:
            self._ratios.append(max(0.0, lead) / job.checkpoint_s)

    def expected(self, job: SimJob) -> float:
        if not self._ratios or not job.saves_on_request() or not job.checkpoint_s:
            return 0.0
        ratio = sorted(self._ratios)[len(self._ratios) // 10]
        # It saves for checkpoint_s after the request, so it cannot release earlier than that.
        return min(job.checkpoint_s * ratio, job.grace_s - job.checkpoint_s)
