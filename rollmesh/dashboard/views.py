"""What ``GET /dashboard/state`` answers: the dashboard's views as msgspec Structs (JSON).

Knows msgspec only. These are the dashboard's HTTP shapes, read by its page's JavaScript; they are
not NATS wire messages (those live in ``rollmesh.messages``). Times are seconds since the epoch.
"""

from __future__ import annotations

import msgspec


class _View(msgspec.Struct, frozen=True, kw_only=True):
    pass


class RolloutView(_View):
    """A rollout in flight (queued or running) or just finished."""

    rollout_id: str
    task: str = ""
    purpose: str = ""
    group_id: str = ""
    status: str = "queued"  # queued | running | answered | completed
    turn: int = 0
    max_turns: int = 0  # 0: its request was not seen (the dashboard started after it)
    # turn / max_turns; None when max_turns is unknown.
    progress: float | None = None
    num_tokens: int = 0
    weight_version: int = -1
    reward: float | None = None
    trace_id: str = ""
    trace_url: str = ""  # where its trace link goes; "" without a trace id
    requested_at: float = 0.0
    updated_at: float = 0.0


class FailureView(_View):
    rollout_id: str
    kind: str  # RolloutFailed.kind: the typed reason
    reason: str
    turns: int = 0
    attempts: int = 1
    infra_failures: int = 0
    at: float = 0.0
    trace_id: str = ""
    trace_url: str = ""


class RewardPoint(_View):
    """One completed rollout's reward."""

    at: float
    reward: float
    purpose: str = "train"


class TrainerPoint(_View):
    """One trainer step: the mean reward it trained on, and its loss."""

    at: float
    step: int
    reward_mean: float
    loss: float
    weight_version: int
    max_version_lag: int = 0


class WorkerWeightsView(_View):
    worker: str
    role: str
    version: int
    staged_version: int | None = None
    updated_at: float = 0.0


class SandboxPoolView(_View):
    """The sandbox broker's numbers, as its actor reports them."""

    backend: str = ""
    isolated: bool = False
    active_leases: int = 0
    warm_sandboxes: dict[str, int] = {}
    max_sandboxes: int = 0
    running_execs: int = 0
    snapshots: int = 0
    at: float = 0.0


class AcceleratorSample(_View):
    """One point of the accelerator timeline (the GPU scheduler's accounting)."""

    at: float
    capacity: int
    allocated_utilization: float
    busy_utilization: float
    # run/role -> accelerators held; job state -> jobs in it
    roles: dict[str, int] = {}
    jobs: dict[str, int] = {}
    preemptions: int = 0


class DashboardCounts(_View):
    requested: int = 0
    completed: int = 0
    failed: int = 0
    in_flight: int = 0
    # In-flight rollouts forgotten to stay within dashboard.max_rollouts.
    evicted: int = 0
    # Messages on a followed subject that did not decode, by subject template.
    malformed: dict[str, int] = {}


class DashboardSnapshot(_View):
    namespace: str
    generated_at: float
    refresh_s: float
    counts: DashboardCounts
    in_flight: list[RolloutView]
    recent_completed: list[RolloutView]
    failures: list[FailureView]
    rewards: list[RewardPoint]
    trainer_steps: list[TrainerPoint]
    weights: list[WorkerWeightsView]
    published_version: int | None = None
    sandbox_pool: SandboxPoolView | None = None
    accelerators: list[AcceleratorSample] = []
    # The feed's connection to the bus: "connecting" | "connected" | "error: ..." (no URL).
    feed: str = "connecting"
