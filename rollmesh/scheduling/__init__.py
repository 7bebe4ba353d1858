"""GPU scheduling: who holds which accelerator, RL roles first and idle ones lent to simulation jobs.

Knows config and the scheduling messages; never NATS, and Ray only in ``ray_jobs`` (the Ray
adapters of the job launcher and role groups ports, imported by the scheduler's actor alone).
``GpuScheduler`` grants declared counts at start; ``LendingScheduler`` is the event-driven policy
core (RL demand, reservations, EASY backfill, preemption by cost, elastic loans, fair share),
driven alike by the live actor and by ``simulate`` over SWF / CSV traces and RL phases files.
``gpu_scheduler_logic.GpuSchedulerLogic`` is the GPU scheduler role's logic (imported from its
module, not here: it pulls in the metrics SDK).
"""

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
from rollmesh.scheduling.errors import (
    InvalidGrantError,
    InvalidJobError,
    MissingHolderError,
    OverCommittedError,
    RoleLendingUnavailableError,
    RunAlreadyRegisteredError,
    SchedulingError,
    TraceFormatError,
    UnknownGrantError,
    UnknownJobError,
    UnknownRoleError,
)
from rollmesh.scheduling.grants import AllocationPolicy, DeclaredPolicy, GpuScheduler
from rollmesh.scheduling.lending import LendingScheduler, SchedulerStats
from rollmesh.scheduling.simulator import RlRunResult, SchedulingPolicy, SimulationResult, simulate
from rollmesh.scheduling.static_reservation import StaticReservationScheduler
from rollmesh.scheduling.trace_readers import (
    ML_JOBS_HEADER,
    JobDefaults,
    RlPhase,
    RlRunSpec,
    SwfJob,
    SwfTrace,
    TraceJob,
    read_ml_jobs,
    read_rl_phases,
    read_swf,
    swf_trace_jobs,
)
from rollmesh.scheduling.workload import RoleShare, SimJob

__all__ = [
    "ML_JOBS_HEADER",
    "AllocationPolicy",
    "Command",
    "DeclaredPolicy",
    "GpuScheduler",
    "GrantRole",
    "GrowDecode",
    "InvalidGrantError",
    "InvalidJobError",
    "JobDefaults",
    "KillJob",
    "LendingScheduler",
    "MissingHolderError",
    "OverCommittedError",
    "ReclaimRole",
    "RequestPreemption",
    "RoleLendingUnavailableError",
    "RlPhase",
    "RlRunResult",
    "RlRunSpec",
    "RoleShare",
    "RunAlreadyRegisteredError",
    "SchedulerStats",
    "SchedulingError",
    "SchedulingPolicy",
    "ShrinkDecode",
    "SimJob",
    "SimulationResult",
    "StartJob",
    "StaticReservationScheduler",
    "SwfJob",
    "SwfTrace",
    "TraceFormatError",
    "TraceJob",
    "UnknownGrantError",
    "UnknownJobError",
    "UnknownRoleError",
    "UtilizationAccount",
    "UtilizationSample",
    "UtilizationTotals",
    "read_ml_jobs",
    "read_rl_phases",
    "read_swf",
    "simulate",
    "swf_trace_jobs",
]
