"""GPU scheduling: who holds which accelerator, expressed as Ray resources.

Knows config and the scheduling messages; never Ray or NATS (the scheduler's actor shell and the
launcher apply the options this package computes). Lending and preemption policies plug in
through ``AllocationPolicy``.
"""

from rollmesh.scheduling.errors import (
    InvalidGrantError,
    MissingHolderError,
    OverCommittedError,
    SchedulingError,
    UnknownGrantError,
)
from rollmesh.scheduling.grants import AllocationPolicy, DeclaredPolicy, GpuScheduler

__all__ = [
    "AllocationPolicy",
    "DeclaredPolicy",
    "GpuScheduler",
    "InvalidGrantError",
    "MissingHolderError",
    "OverCommittedError",
    "SchedulingError",
    "UnknownGrantError",
]
