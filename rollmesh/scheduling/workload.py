"""What the scheduler is asked to place: RL roles' shares and preemptible simulation jobs.

Knows msgspec only. Both are Structs so a phases file or a submission decodes straight into them
with their constraints checked; the policy reads them and never changes them.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]


class RoleShare(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An RL role's claim on the cluster.

    Demand up to ``guaranteed`` is met before anything else, preempting simulation jobs; demand
    above it is shared between RL runs by weight. ``priority`` orders roles when freed
    accelerators trickle in (higher first). ``elastic_limit`` > 0 lets the role grow that many
    accelerators past its demand into idle ones (decode workers taking more sessions); those are
    lent, not granted, and are the first taken back.
    """

    guaranteed: NonNegInt
    priority: int = 0
    elastic_limit: NonNegInt = 0


class SimJob(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A scavenger simulation job: it runs on lent accelerators and leaves when asked.

    How it checkpoints: every ``checkpoint_interval_s`` seconds of progress (0: never
    periodically), and on a PreemptionRequested within ``checkpoint_s`` seconds (None: it cannot
    save on request). A job that has not released ``grace_s`` after the request is killed.
    Restarting costs ``restart_cost_s`` seconds of reloading before progress resumes.
    """

    job_id: str
    accelerators: Annotated[int, Meta(ge=1)]
    expected_duration_s: Annotated[float, Meta(gt=0)]
    grace_s: NonNegFloat = 60.0
    checkpoint_interval_s: NonNegFloat = 0.0
    checkpoint_s: NonNegFloat | None = None
    restart_cost_s: NonNegFloat = 0.0

    def saves_on_request(self) -> bool:
        """Whether a request leaves it time to save before the deadline."""
        return self.checkpoint_s is not None and self.checkpoint_s <= self.grace_s
