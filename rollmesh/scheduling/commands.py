"""What the scheduler core tells its driver to do: the typed commands its methods return.

Knows the standard library only. The live actor turns each into messages and Ray calls; the
simulator applies them to its model. Within one returned list, releases come before grants and
starts, so a driver executing them in order never holds more than the cluster has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class GrantRole:
    """Give ``accelerators`` more to an RL role; it now holds ``held``."""

    run_id: str
    role: str
    accelerators: int
    held: int
    order: ClassVar[int] = 1


@dataclass(frozen=True)
class ReclaimRole:
    """Take ``accelerators`` back from an RL role (its demand fell, or fair share moved them)."""

    run_id: str
    role: str
    accelerators: int
    held: int
    order: ClassVar[int] = 0


@dataclass(frozen=True)
class GrowDecode:
    """Lend ``accelerators`` idle ones to an elastic role (decode) past its demand; ``lent`` in all."""

    run_id: str
    role: str
    accelerators: int
    lent: int
    order: ClassVar[int] = 2


@dataclass(frozen=True)
class ShrinkDecode:
    """Take ``accelerators`` of an elastic role's loan back at once; ``lent`` remain."""

    run_id: str
    role: str
    accelerators: int
    lent: int
    order: ClassVar[int] = 0


@dataclass(frozen=True)
class StartJob:
    """Start a job on ``accelerators``: ``borrowed`` of them ((run_id, role, count) each) are
    devices of those roles' own, lent while the roles are idle (``role_devices_pinned``); the
    rest are free ones."""

    job_id: str
    accelerators: int
    borrowed: tuple[tuple[str, str, int], ...] = ()
    order: ClassVar[int] = 1


@dataclass(frozen=True)
class RequestPreemption:
    """Ask a job to checkpoint and release by ``deadline`` (PreemptionRequested on the wire)."""

    job_id: str
    deadline: float
    reason: str
    order: ClassVar[int] = 1


@dataclass(frozen=True)
class KillJob:
    """The job did not release by its deadline: force it off its accelerators now."""

    job_id: str
    reason: str
    order: ClassVar[int] = 0


Command = GrantRole | ReclaimRole | GrowDecode | ShrinkDecode | StartJob | RequestPreemption | KillJob


def in_execution_order(commands: list[Command]) -> list[Command]:
    """Releases first, then grants and starts, then loans (a stable sort keeps each group's order)."""
    return sorted(commands, key=lambda command: command.order)
