"""Simulation jobs on lent accelerators, and RL roles' demand: the live GPU scheduler's events.

Knows msgspec only. A job is submitted (``SimJobSubmitted``, durable: the scheduler acks it once
it is in its job ledger), started on each attempt (``SimJobStarted``) and ends each attempt with
an outcome (``SimJobEnded``); a preempted attempt is followed by another one later, which
resumes from the job's checkpoint. Preemption itself is ``PreemptionRequested`` /
``PreemptionAcknowledged`` (``scheduling.py``), with the job id as ``holder``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rollmesh.messages.base import WireMessage

# The holder of accelerators lent to decode past its demand (decode loans): each grant's id names
# the decode worker placed in them, which rollout workers route to until the grant is released.
# The value keeps the feature's old name: it is on the wire, and actors of the last release match it.
DECODE_LOAN_HOLDER = "decode.elastic"

JobId = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")]
NonNegFloat = Annotated[float, Meta(ge=0)]
JobOutcome = Literal["finished", "failed", "preempted", "killed", "rejected"]


class SimJobSubmitted(WireMessage, frozen=True, tag="sched.sim_submitted"):
    """A preemptible simulation job: run ``command`` on ``accelerators`` lent accelerators.

    How it checkpoints: on its own every ``checkpoint_interval_s`` (0: not periodically) and, when
    asked (SIGTERM), within ``checkpoint_s`` (None: it cannot save on request); it is killed
    ``grace_s`` after a preemption request it has not honoured. ``restart_cost_s``: the time a
    restart spends reloading before it makes progress again (a preemption costs that too)."""

    job_id: JobId
    command: Annotated[list[str], Meta(min_length=1)]
    accelerators: Annotated[int, Meta(ge=1)]
    expected_duration_s: Annotated[float, Meta(gt=0)]
    grace_s: NonNegFloat = 60.0
    checkpoint_interval_s: NonNegFloat = 0.0
    checkpoint_s: NonNegFloat | None = None
    restart_cost_s: NonNegFloat = 0.0
    submitted_at: float = 0.0


class SimJobStarted(WireMessage, frozen=True, tag="sched.sim_started"):
    job_id: str
    attempt: int
    accelerators: int
    started_at: float


class SimJobEnded(WireMessage, frozen=True, tag="sched.sim_ended"):
    """One attempt ended. ``preempted``/``killed``: the job waits to run again from its last
    checkpoint; ``finished``/``failed`` (non-zero exit): it is done; ``rejected``: it never ran
    (``reason`` says why: a malformed submission, more accelerators than exist, a duplicate id)."""

    job_id: str
    outcome: JobOutcome
    attempt: int = 0
    exit_code: int | None = None
    reason: str = ""
    ended_at: float = 0.0


class RoleDemandChanged(WireMessage, frozen=True, tag="sched.demand"):
    """An RL role needs ``accelerators`` from now on (e.g. the trainer wants its GPUs back).
    ``run_id`` "": the mesh's own run (its namespace)."""

    role: str
    accelerators: Annotated[int, Meta(ge=0)]
    run_id: str = ""


class RunRegistered(WireMessage, frozen=True, tag="sched.run_registered"):
    """Another RL run shares this scheduler's accelerators: its roles' guaranteed shares, and its
    weight when demand beyond the guarantees is shared between runs. Its roles then ask with
    ``RoleDemandChanged`` (``run_id`` set); what they are granted is held as placement groups
    named by the grant ids, which the run's workers schedule into."""

    run_id: Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")]
    guaranteed: dict[str, Annotated[int, Meta(ge=0)]]
    weight: Annotated[float, Meta(gt=0)] = 1.0


class SchedulerStatusRequest(WireMessage, frozen=True, tag="sched.status_request"):
    pass


class SchedulerStatus(WireMessage, frozen=True, tag="sched.status"):
    """What ``rollmesh sched status`` prints; also published every ``scheduler.report_every_s``."""

    capacity: int
    # run/role -> accelerators held (granted) and lent (elastic, past demand)
    roles: dict[str, int]
    # job id -> "queued" | "running" | "preempting"
    jobs: dict[str, str]
    allocated_utilization: float
    busy_utilization: float
    preemptions: int
    kills: int
    lost_accelerator_s: float
    rl_queueing_s: float
    reported_at: float
    # Deprecated (read decode_loan_workers): the same list under the feature's old name. Still
    # sent, so readers of the last release read it.
    elastic_workers: list[str] = []
    # Each RL role's busy fraction now, from its workers' reported compute time (a role that has
    # not reported recently is absent: what it holds counts as busy).
    roles_busy: dict[str, float] = {}
    # The decode workers lent idle accelerators now (decode loans), by name.
    decode_loan_workers: list[str] = []

    def __post_init__(self) -> None:
        # One release of both names: an older sender's list fills the new field, and a sender that
        # sets only the new one fills the old one too. Remove with elastic_workers.
        if self.elastic_workers and not self.decode_loan_workers:
            msgspec.structs.force_setattr(self, "decode_loan_workers", self.elastic_workers)
        elif self.decode_loan_workers and not self.elastic_workers:
            msgspec.structs.force_setattr(self, "elastic_workers", self.decode_loan_workers)


def __getattr__(name: str) -> object:
    # ELASTIC_DECODE_HOLDER was renamed (the feature is "decode loans"); the old name warns for one
    # release. Hand-written rather than rollmesh.moved_names: messages imports nothing of ours.
    if name == "ELASTIC_DECODE_HOLDER":
        import warnings

        warnings.warn(f"{__name__}.ELASTIC_DECODE_HOLDER is now {__name__}.DECODE_LOAN_HOLDER; the old name "
                      "will be removed in the next release", DeprecationWarning, stacklevel=2)
        return DECODE_LOAN_HOLDER
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
