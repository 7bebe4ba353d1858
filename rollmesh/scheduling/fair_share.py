"""How many accelerators each RL role should hold when RL runs together want more than the cluster.

Plain arithmetic, no state. Simulation jobs do not appear: they are scavengers, preempted for any
RL demand, so RL roles share the whole cluster among themselves.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

RoleKey = tuple[str, str]  # (run_id, role)


@dataclass(frozen=True)
class RoleDemand:
    run_id: str
    role: str
    demand: int
    guaranteed: int
    priority: int
    weight: float  # the run's fair-share weight


def fair_targets(capacity: int, demands: Sequence[RoleDemand]) -> dict[RoleKey, int]:
    """Each role's target: its demand when everything fits; otherwise its guarantee first, and what
    is left handed out one accelerator at a time to the run furthest below its weighted share
    (its highest-priority unmet role), i.e. weighted max-min fairness between runs."""
    targets = {(d.run_id, d.role): d.demand for d in demands}
    if sum(targets.values()) <= capacity:
        return targets
    targets = {(d.run_id, d.role): min(d.demand, d.guaranteed) for d in demands}
    left = capacity - sum(targets.values())
    extra: dict[str, int] = defaultdict(int)
    while left > 0:
        wanting = [d for d in demands if targets[d.run_id, d.role] < d.demand]
        if not wanting:
            break
        weights = {d.run_id: d.weight for d in wanting}
        run = min(weights, key=lambda run_id: (extra[run_id] / weights[run_id], run_id))
        neediest = max((d for d in wanting if d.run_id == run), key=lambda d: (d.priority, d.role))
        targets[run, neediest.role] += 1
        extra[run] += 1
        left -= 1
    return targets
