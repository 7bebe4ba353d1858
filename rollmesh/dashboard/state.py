"""DashboardState: the mesh's live events folded into bounded views for the dashboard.

Plain logic: knows the wire contract's Structs and the dashboard's views; not NATS, Ray or HTTP
(the feed hands it decoded messages and polled numbers, the routes ask it for a snapshot). Every
view is bounded by ``DashboardConfig``, so a mesh that runs for weeks cannot grow it: rollouts in
flight are forgotten least-recently-heard-of first, the rest keep their newest points.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

import msgspec

from rollmesh.config import DashboardConfig
from rollmesh.dashboard.views import (
    AcceleratorSample,
    DashboardCounts,
    DashboardSnapshot,
    FailureView,
    RewardPoint,
    RolloutView,
    SandboxPoolView,
    TrainerPoint,
    WorkerWeightsView,
)
from rollmesh.messages import (
    RolloutCompleted,
    RolloutFailed,
    RolloutProgressed,
    RolloutRequested,
    SchedulerStatus,
    TrainerStepped,
    WeightsActivated,
    WeightsPublished,
)

TRACE_VIEW_PATH = "/dashboard/traces/{trace_id}"
RECENT_COMPLETED = 20
# Finished rollouts remembered, so a progress event that arrives after the outcome (they come
# from different connections) does not bring a finished rollout back as in flight.
FINISHED_MEMORY = 1000

_Event = (RolloutRequested | RolloutProgressed | RolloutCompleted | RolloutFailed | TrainerStepped
          | WeightsActivated | WeightsPublished | SchedulerStatus)


def trace_link(trace_id: str, trace_url: str) -> str:
    """Where a trace id links: the configured trace UI (a ``{trace_id}`` template), else the
    dashboard's own trace view; "" without an id."""
    if not trace_id:
        return ""
    return (trace_url or TRACE_VIEW_PATH).format(trace_id=trace_id)


class DashboardState:
    def __init__(self, config: DashboardConfig, *, namespace: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.namespace = namespace
        self.clock = clock
        self.feed = "connecting"
        self._in_flight: OrderedDict[str, RolloutView] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._completed: deque[RolloutView] = deque(maxlen=RECENT_COMPLETED)
        self._failures: deque[FailureView] = deque(maxlen=config.max_failures)
        self._rewards: deque[RewardPoint] = deque(maxlen=config.max_points)
        self._steps: deque[TrainerPoint] = deque(maxlen=config.max_points)
        self._accelerators: deque[AcceleratorSample] = deque(maxlen=config.max_points)
        self._weights: dict[str, WorkerWeightsView] = {}
        self._published_version: int | None = None
        self._sandbox_pool: SandboxPoolView | None = None
        self._counts = Counter[str]()
        self._malformed = Counter[str]()

    # -- folding ---------------------------------------------------------------------------

    def record(self, event: _Event) -> None:
        """Fold one decoded event in; events of other types are ignored."""
        now = self.clock()
        match event:
            case RolloutRequested():
                self._requested(event, now)
            case RolloutProgressed():
                self._progressed(event, now)
            case RolloutCompleted():
                self._completed_rollout(event, now)
            case RolloutFailed():
                self._failed(event, now)
            case TrainerStepped():
                self._steps.append(TrainerPoint(
                    at=now, step=event.step, reward_mean=event.reward_mean, loss=event.loss,
                    weight_version=event.weight_version, max_version_lag=event.max_generation_lag))
            case WeightsActivated():
                self.record_worker_version(event.worker, event.role, event.version)
            case WeightsPublished():
                self._published_version = max(event.version, self._published_version or 0)
            case SchedulerStatus():
                self._scheduler_status(event, now)

    def record_malformed(self, subject_template: str) -> None:
        self._malformed[subject_template] += 1

    def record_worker_version(self, worker: str, role: str, version: int,
                              staged_version: int | None = None) -> None:
        self._weights[worker] = WorkerWeightsView(worker=worker, role=role, version=version,
                                                  staged_version=staged_version,
                                                  updated_at=self.clock())

    def record_sandbox_pool(self, pool: SandboxPoolView) -> None:
        self._sandbox_pool = msgspec.structs.replace(pool, at=self.clock())

    def _requested(self, event: RolloutRequested, now: float) -> None:
        self._counts["requested"] += 1
        if event.rollout_id in self._finished:
            return
        # Each subject is delivered in order, but not one subject against another: the first
        # progress may be folded before its request, whose fields then fill in what it lacked.
        known = self._in_flight.get(event.rollout_id)
        if known is None:
            known = RolloutView(rollout_id=event.rollout_id, requested_at=now, updated_at=now)
        self._touch(msgspec.structs.replace(
            known, task=event.task, purpose=event.purpose, group_id=event.group_id,
            max_turns=event.max_turns, progress=min(1.0, known.turn / event.max_turns)))

    def _progressed(self, event: RolloutProgressed, now: float) -> None:
        if event.rollout_id in self._finished:
            return
        known = self._in_flight.get(event.rollout_id) or RolloutView(rollout_id=event.rollout_id,
                                                                     requested_at=now)
        progress = min(1.0, event.turn / known.max_turns) if known.max_turns else None
        self._touch(msgspec.structs.replace(
            known, status=event.status, turn=event.turn, progress=progress,
            num_tokens=event.num_tokens, weight_version=event.weight_version,
            trace_id=event.trace_id or known.trace_id,
            trace_url=trace_link(event.trace_id or known.trace_id, self.config.trace_url),
            updated_at=now))

    def _completed_rollout(self, event: RolloutCompleted, now: float) -> None:
        self._counts["completed"] += 1
        known = self._finish(event.rollout_id) or RolloutView(rollout_id=event.rollout_id)
        trace_id = event.trace_id or known.trace_id
        self._completed.append(msgspec.structs.replace(
            known, task=event.task, purpose=event.purpose, group_id=event.group_id,
            status="completed", turn=event.turns, progress=1.0, **_size_and_version(event), reward=event.reward,
            trace_id=trace_id, trace_url=trace_link(trace_id, self.config.trace_url),
            updated_at=now))
        self._rewards.append(RewardPoint(at=now, reward=event.reward, purpose=event.purpose))

    def _failed(self, event: RolloutFailed, now: float) -> None:
        self._counts["failed"] += 1
        known = self._finish(event.rollout_id)
        trace_id = event.trace_id or (known.trace_id if known else "")
        self._failures.append(FailureView(
            rollout_id=event.rollout_id, kind=event.kind, reason=event.reason, turns=event.turns,
            attempts=event.attempts, infra_failures=event.infra_failures, at=now,
            trace_id=trace_id, trace_url=trace_link(trace_id, self.config.trace_url)))

    def _scheduler_status(self, status: SchedulerStatus, now: float) -> None:
        at = status.reported_at or now
        if self._accelerators and self._accelerators[-1].at >= at:
            return  # the same report seen twice (published and asked for), or an older one
        self._accelerators.append(AcceleratorSample(
            at=at, capacity=status.capacity,
            allocated_utilization=status.allocated_utilization,
            busy_utilization=status.busy_utilization, roles=dict(status.roles),
            jobs=dict(Counter(status.jobs.values())), preemptions=status.preemptions))

    def _touch(self, view: RolloutView) -> None:
        """Insert or update a rollout in flight as the most recently heard of, forgetting the
        least recently heard of past the bound."""
        self._in_flight[view.rollout_id] = view
        self._in_flight.move_to_end(view.rollout_id)
        while len(self._in_flight) > self.config.max_rollouts:
            self._in_flight.popitem(last=False)
            self._counts["evicted"] += 1

    def _finish(self, rollout_id: str) -> RolloutView | None:
        self._finished[rollout_id] = None
        self._finished.move_to_end(rollout_id)
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)
        return self._in_flight.pop(rollout_id, None)

    # -- reading ---------------------------------------------------------------------------

    def snapshot(self) -> DashboardSnapshot:
        """Everything the page shows, newest last in every list."""
        counts = DashboardCounts(
            requested=self._counts["requested"], completed=self._counts["completed"],
            failed=self._counts["failed"], in_flight=len(self._in_flight),
            evicted=self._counts["evicted"], malformed=dict(self._malformed))
        return DashboardSnapshot(
            namespace=self.namespace, generated_at=self.clock(), refresh_s=self.config.refresh_s,
            counts=counts, in_flight=list(self._in_flight.values()),
            recent_completed=list(self._completed), failures=list(self._failures),
            rewards=list(self._rewards), trainer_steps=list(self._steps),
            weights=sorted(self._weights.values(), key=lambda w: (w.role, w.worker)),
            published_version=self._published_version, sandbox_pool=self._sandbox_pool,
            accelerators=list(self._accelerators), feed=self.feed)


def _size_and_version(event: RolloutCompleted) -> dict[str, int]:
    """Its length and newest weight version, without fetching a stored trace."""
    if event.trajectory is None and event.trajectory_ref:
        return {"num_tokens": event.num_tokens, "weight_version": event.weight_version}
    trace = event.token_trace()
    return {"num_tokens": len(trace), "weight_version": max(trace.versions, default=-1)}

