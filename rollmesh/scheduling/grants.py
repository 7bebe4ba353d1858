"""GPU scheduler logic: the table of which actor holds how many accelerators.

Knows the scheduling messages and config; not Ray or NATS. Counts are *declared* (config), so the
same code grants on a CPU-only machine, where Ray schedules on a custom resource instead of "GPU".
What to grant is an ``AllocationPolicy`` (later: lending to simulation jobs, preemption); that
grants never exceed ``total_gpus`` is enforced here, whatever the policy says.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from rollmesh.config import SchedulerConfig
from rollmesh.messages.scheduling import GpuGranted, GpuReleased
from rollmesh.scheduling.errors import (
    InvalidGrantError,
    MissingHolderError,
    OverCommittedError,
    UnknownGrantError,
)

# The Ray resource name that means real accelerators; any other name is a custom resource.
RAY_GPU = "GPU"
# Float sums of fractional grants (0.1 + 0.2) must not read as an over-commit.
_CAPACITY_SLACK = 1e-9

Clock = Callable[[], float]
NewId = Callable[[], str]


class AllocationPolicy(Protocol):
    """Decides how many accelerators each role gets now; the scheduler checks capacity after."""

    def allocate(
        self,
        requested: Mapping[str, float],
        *,
        capacity: float,
        held: Sequence[GpuGranted],
    ) -> dict[str, float]: ...


class DeclaredPolicy:
    """Grant each role what config declares, once: a role already holding a grant gets no more."""

    def allocate(
        self,
        requested: Mapping[str, float],
        *,
        capacity: float,
        held: Sequence[GpuGranted],
    ) -> dict[str, float]:
        holding = {grant.role for grant in held}
        return {role: count for role, count in requested.items() if role not in holding}


class GpuScheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        clock: Clock,
        new_id: NewId,
        policy: AllocationPolicy | None = None,
    ) -> None:
        self._config = config
        self._clock = clock
        self._new_id = new_id
        self._policy: AllocationPolicy = policy or DeclaredPolicy()
        self._grants: dict[str, GpuGranted] = {}  # by grant id, in grant order

    def initial_grants(self, holders: Mapping[str, str]) -> list[GpuGranted]:
        """Grant config's roles to their actors (``holders``: role -> actor name); return new ones.

        Calling it again grants nothing twice. All or nothing: on an error no grant is made.
        """
        for role, count in self._config.grants.items():
            self._check_count(role, count)
        wanted = self._policy.allocate(
            self._config.grants, capacity=self._config.total_gpus, held=self.grants()
        )
        wanted = {role: count for role, count in wanted.items() if count > 0}
        for role, count in wanted.items():
            self._check_count(role, count)
            if role not in holders:
                raise MissingHolderError(role=role)
        held = sum(grant.count for grant in self._grants.values())
        if held + sum(wanted.values()) > self._config.total_gpus + _CAPACITY_SLACK:
            raise OverCommittedError(
                resource=self._config.resource,
                total=self._config.total_gpus,
                held=held,
                requested=wanted,
            )
        now = self._clock()
        granted = [
            GpuGranted(
                grant_id=self._new_id(),
                holder=holders[role],
                role=role,
                count=count,
                resource=self._config.resource,
                granted_at=now,
            )
            for role, count in wanted.items()
        ]
        self._grants.update((grant.grant_id, grant) for grant in granted)
        return granted

    def release(self, grant_id: str) -> GpuReleased:
        grant = self._grants.pop(grant_id, None)
        if grant is None:
            raise UnknownGrantError(grant_id=grant_id)
        return GpuReleased(
            grant_id=grant_id, holder=grant.holder, count=grant.count, released_at=self._clock()
        )

    def grants(self) -> list[GpuGranted]:
        """The live grants, oldest first."""
        return list(self._grants.values())

    def ray_resources(self) -> dict[str, float]:
        """Custom resources for ``ray.init(resources=...)``, so grants schedule without GPUs.

        Empty for "GPU": Ray detects real GPUs itself (or takes ``num_gpus``), and refuses "GPU"
        in ``resources``.
        """
        if self._config.resource == RAY_GPU or self._config.total_gpus == 0:
            return {}
        return {self._config.resource: float(self._config.total_gpus)}

    def actor_options(self, role: str) -> dict[str, Any]:
        """Ray ``.options(...)`` kwargs reserving ``role``'s granted accelerators ({} if none)."""
        count = sum(grant.count for grant in self._grants.values() if grant.role == role)
        if count <= 0:
            return {}
        if self._config.resource == RAY_GPU:
            return {"num_gpus": count}
        return {"resources": {self._config.resource: count}}

    def _check_count(self, role: str, count: float) -> None:
        if not math.isfinite(count) or count < 0:
            raise InvalidGrantError("must be a finite non-negative number", role=role, count=count)
        # Ray shares one GPU by fractions but counts more than one in whole devices (GPU is a
        # "unit instance" resource, ray-project/ray#39293); custom resources may be 1.5.
        if self._config.resource == RAY_GPU and count > 1 and count != int(count):
            raise InvalidGrantError("GPU counts above 1 must be whole", role=role, count=count)
