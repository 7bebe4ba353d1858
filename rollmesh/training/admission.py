"""Admission of trajectories into GRPO groups: staleness by version lag, group completion.

Knows nothing of Ray, NATS or torch. Staleness is the version lag of the *generated tokens*
(current trainer version minus the oldest version that produced a token), never wall-clock time,
so a rollout that waited an hour on tools is not penalised for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollmesh.training.grpo import PolicySample, group_advantages


def version_lag(versions: list[int], current_version: int) -> int:
    generated = [version for version in versions if version >= 0]
    return current_version - min(generated) if generated else 0


@dataclass
class GroupMember:
    rollout_id: str
    reward: float
    sample: PolicySample | None  # None: failed or too stale, counted but not trained on
    version_lag: int = 0


@dataclass
class Group:
    group_id: str
    members: list[GroupMember] = field(default_factory=list)

    def trainable_samples(self) -> list[PolicySample]:
        """Members with a sample get group-relative advantages; failed/stale ones are masked out
        of the group statistics (an infrastructure failure is not a zero reward)."""
        usable = [member for member in self.members if member.sample is not None]
        advantages = group_advantages([member.reward for member in usable])
        if advantages is None:
            return []
        return [
            PolicySample(m.sample.tokens, m.sample.loss_mask, m.sample.behaviour_logprobs, advantage)
            for m, advantage in zip(usable, advantages)
            if m.sample is not None
        ]

    def rewards(self) -> list[float]:
        return [member.reward for member in self.members if member.sample is not None]


class GroupBuffer:
    """Collects members by group id until ``group_size`` arrived (trained, stale or failed)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._open: dict[str, Group] = {}
        self.ready: list[Group] = []

    def add(self, group_id: str, member: GroupMember) -> Group | None:
        group = self._open.setdefault(group_id, Group(group_id))
        group.members.append(member)
        if len(group.members) < self.group_size:
            return None
        del self._open[group_id]
        self.ready.append(group)
        return group

    def take(self, count: int) -> list[Group]:
        taken, self.ready = self.ready[:count], self.ready[count:]
        return taken

    def open_groups(self) -> int:
        return len(self._open)
