"""Errors of the scheduling package. Knows nothing but the standard library.

    SchedulingError
    ├── OverCommittedError      grants (or guaranteed shares) would exceed the declared accelerators
    ├── InvalidGrantError       a role's count cannot be expressed as a Ray resource request
    ├── MissingHolderError      a role has accelerators in config but no actor to hold them
    ├── UnknownGrantError       no live grant has this id (never granted, or already released)
    ├── RunAlreadyRegisteredError  an RL run id registered twice
    ├── UnknownRoleError        no registered RL run has this role
    ├── UnknownJobError         no live simulation job has this id (never submitted, or finished)
    ├── InvalidJobError         a simulation job the cluster can never run (or a duplicate id)
    ├── TraceFormatError        a workload trace or RL phases file that cannot be read
    └── RoleLendingUnavailableError  scheduler.lend_role_accelerators where the mesh cannot lend a role
"""

from __future__ import annotations


class SchedulingError(Exception):
    """Root of the tree."""


class OverCommittedError(SchedulingError):
    def __init__(self, *, resource: str, total: float, held: float, requested: dict[str, float]):
        super().__init__(
            f"{resource}: {sum(requested.values())} requested by {sorted(requested)} "
            f"on top of {held} held exceeds the {total} declared"
        )
        self.resource = resource
        self.total = total
        self.held = held
        self.requested = requested


class InvalidGrantError(SchedulingError):
    def __init__(self, reason: str, *, role: str, count: float) -> None:
        super().__init__(f"role {role!r}, count {count}: {reason}")
        self.role = role
        self.count = count
        self.reason = reason


class MissingHolderError(SchedulingError):
    def __init__(self, *, role: str) -> None:
        super().__init__(f"role {role!r} has a grant in config but no holder actor")
        self.role = role


class UnknownGrantError(SchedulingError):
    def __init__(self, *, grant_id: str) -> None:
        super().__init__(f"no live grant {grant_id!r}")
        self.grant_id = grant_id


class RunAlreadyRegisteredError(SchedulingError):
    def __init__(self, *, run_id: str) -> None:
        super().__init__(f"RL run {run_id!r} is already registered")
        self.run_id = run_id


class UnknownRoleError(SchedulingError):
    def __init__(self, *, run_id: str, role: str) -> None:
        super().__init__(f"RL run {run_id!r} has no registered role {role!r}")
        self.run_id = run_id
        self.role = role


class UnknownJobError(SchedulingError):
    def __init__(self, *, job_id: str) -> None:
        super().__init__(f"no live simulation job {job_id!r}")
        self.job_id = job_id


class InvalidJobError(SchedulingError):
    def __init__(self, reason: str, *, job_id: str) -> None:
        super().__init__(f"simulation job {job_id!r}: {reason}")
        self.job_id = job_id
        self.reason = reason


class TraceFormatError(SchedulingError):
    """``line`` is 1-based; None when the reader cannot point at one (a TOML validation error)."""

    def __init__(self, reason: str, *, path: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


class RoleLendingUnavailableError(SchedulingError):
    """``scheduler.lend_role_accelerators = true`` asked of a scheduler that cannot carry it out:
    ``missing`` names what the live mesh lacks for it."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__("scheduler.lend_role_accelerators cannot be carried out by this mesh: "
                         + "; ".join(missing) + ". Leave it false (the default).")
        self.missing = missing
