"""Errors of the scheduling package. Knows nothing but the standard library.

    SchedulingError
    ├── OverCommittedError      grants would exceed the declared accelerators
    ├── InvalidGrantError       a role's count cannot be expressed as a Ray resource request
    ├── MissingHolderError      a role has accelerators in config but no actor to hold them
    └── UnknownGrantError       no live grant has this id (never granted, or already released)
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
