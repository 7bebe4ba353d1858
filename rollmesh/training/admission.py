"""Admission of trajectories into GRPO groups: staleness by generation lag, group completion.

Knows nothing of Ray, NATS or torch. The bound: a trajectory is admitted when
``generation_lag(versions, current) <= TrainerConfig.max_staleness`` (default 2 versions).

Generation lag is the version lag of the *generated* tokens with tool waits removed: the weight
versions that advanced while the rollout sat between two turns (a tool call, a sandbox) do not
count, only those that advanced while it was generating (or queued for the trainer after it
finished). A long agent rollout spends most of its life on tools, so the raw lag of its first turn
(``version_lag``: current minus the oldest token version) grows with the number of turns and a raw
bound would drop long rollouts far more often than short ones; the generation lag does not.

Excluding tool time means the oldest tokens of an admitted long rollout can be many versions older
than ``max_staleness`` (``version_lag`` says how many; the trainer reports both). That is what the
importance weight is for: every token carries its behaviour logprob, and the loss in ``losses.py``
weights it by the ratio exp(new_logprob - behaviour_logprob), truncated by the PPO clip. Hazard:
that clip is one-sided; with a negative advantage a large ratio is not clipped (dual-clip would
bound it), and the older the token, the further its ratio can drift from 1.

Token versions: one int per token, -1 for forced tokens (prompt, tool output), else the weight
version that generated it. A *segment* is a maximal run of generated tokens (one turn).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import groupby

from rollmesh.training.grpo import PolicySample, group_advantages


def version_lag(versions: list[int], current_version: int) -> int:
    """Raw lag: current version minus the oldest generated token's version (0 if none); tool
    waits included. Reported next to ``generation_lag``, not used to admit."""
    generated = [version for version in versions if version >= 0]
    return current_version - min(generated) if generated else 0


def split_generation_segments(versions: list[int]) -> list[list[int]]:
    """The versions of each turn: maximal runs of generated tokens, split at forced tokens (-1)."""
    return [list(run) for generated, run in groupby(versions, key=lambda v: v >= 0) if generated]


def measure_tool_waits(segments: list[list[int]]) -> list[int]:
    """Versions that advanced between each segment and the next (one fewer than segments).

    The clock at the end of a segment is at least the newest version seen so far (a running max,
    not the segment's last version: a later turn served by a worker still on older weights must
    not make the wait look longer or negative); the next segment's first version bounds the clock
    when it started. The wait is the difference, never negative.
    """
    waits, newest = [], -1
    for before, after in zip(segments, segments[1:]):
        newest = max(newest, *before)
        waits.append(max(0, after[0] - newest))
    return waits


def generation_lag(versions: list[int], current_version: int) -> int:
    """Version lag of the generated tokens with tool waits removed; the admission measure.

    For segment i: (current - oldest version in segment i) - (tool waits after segment i); the
    rollout's lag is the max over segments (with versions that only grow, that is the first
    segment's). 0 with no generated tokens; never negative.
    """
    segments = split_generation_segments(versions)
    if not segments:
        return 0
    waits = measure_tool_waits(segments)
    lag, waited_after = 0, 0
    for index in range(len(segments) - 1, -1, -1):  # last segment first: waits accumulate backwards
        if index < len(waits):
            waited_after += waits[index]
        lag = max(lag, current_version - min(segments[index]) - waited_after)
    return lag


@dataclass(frozen=True)
class LagStats:
    """Distribution of lags over a step's trajectories. Percentiles are nearest-rank, so each is
    a lag that occurred: at least 90% of the trajectories have lag <= ``p90``."""

    count: int = 0
    p50: int = 0
    p90: int = 0
    max: int = 0
    histogram: dict[int, int] = field(default_factory=dict)  # lag -> trajectories, ascending


def summarize_lags(lags: Iterable[int]) -> LagStats:
    ordered = sorted(lags)
    if not ordered:
        return LagStats()

    def nearest_rank(percent: int) -> int:
        # The smallest lag with at least `percent`% of the values at or below it.
        return ordered[-(-percent * len(ordered) // 100) - 1]

    return LagStats(count=len(ordered), p50=nearest_rank(50), p90=nearest_rank(90),
                    max=ordered[-1], histogram=dict(sorted(Counter(ordered).items())))


@dataclass
class GroupMember:
    """One rollout of a group: its idempotency key, reward and training samples."""

    rollout_id: str
    reward: float
    sample: PolicySample | None  # None: failed or too stale, counted but not trained on
    generation_lag: int = 0  # the admission measure (tool waits excluded)
    raw_version_lag: int = 0  # version_lag (tool waits included), reported, not admitted on
    # rollout.history_rewrite = "split": the rollout's samples after ``sample``, trained with the
    # same advantage (the rollout is one member of its group, whatever its number of samples).
    split_samples: list[PolicySample] = field(default_factory=list)

    def samples(self) -> list[PolicySample]:
        return [self.sample, *self.split_samples] if self.sample is not None else []

    @property
    def version_lag(self) -> int:
        """Deprecated: the generation lag under the name of the other measure (``generation_lag``)."""
        warnings.warn("GroupMember.version_lag is now GroupMember.generation_lag; the old name will be "
                      "removed in the next release", DeprecationWarning, stacklevel=2)
        return self.generation_lag


@dataclass
class Group:
    group_id: str
    members: list[GroupMember] = field(default_factory=list)
    # Dropped by dynamic sampling (trainer.drop_uniform_groups): consumed, never trained.
    dropped: bool = False

    def is_uniform(self) -> bool:
        """True when its trainable members' rewards are all equal (or it has none): under GRPO
        every advantage is then zero and the group teaches nothing."""
        return len(set(self.rewards())) <= 1

    def trainable_samples(self) -> list[PolicySample]:
        """Members with a sample get group-relative advantages; failed/stale ones are masked out
        of the group statistics (an infrastructure failure is not a zero reward)."""
        usable = [member for member in self.members if member.sample is not None]
        advantages = group_advantages([member.reward for member in usable])
        if advantages is None:
            return []
        # replace(), not a new PolicySample: the per-token versions and flags travel to the loss.
        # Every sample of a member (several when its rollout was split) takes the member's advantage.
        return [replace(sample, advantage=advantage) for m, advantage in zip(usable, advantages)
                for sample in m.samples()]

    def rewards(self) -> list[float]:
        return [member.reward for member in self.members if member.sample is not None]


class GroupBuffer:
    """Collects members by group id until ``group_size`` arrived (trained, stale or failed).

    With ``drop_uniform``, a complete group whose rewards are all equal is set aside (``dropped``)
    instead of made ready: it does not count toward a step, and rides along with the next one so
    that its members are recorded as consumed when that step is durable."""

    def __init__(self, group_size: int, *, drop_uniform: bool = False) -> None:
        self.group_size = group_size
        self.drop_uniform = drop_uniform
        self._open: dict[str, Group] = {}
        self.ready: list[Group] = []
        self.dropped: list[Group] = []

    def add(self, group_id: str, member: GroupMember) -> Group | None:
        """The group when this member completes it (ready or dropped), else None."""
        group = self._open.setdefault(group_id, Group(group_id))
        group.members.append(member)
        if len(group.members) < self.group_size:
            return None
        del self._open[group_id]
        if self.drop_uniform and group.is_uniform():
            group.dropped = True
            self.dropped.append(group)
        else:
            self.ready.append(group)
        return group

    def take(self, count: int) -> list[Group]:
        """``count`` ready groups, and every dropped group waiting to be recorded."""
        taken, self.ready = self.ready[:count], self.ready[count:]
        dropped, self.dropped = self.dropped, []
        return taken + dropped

    def open_groups(self) -> int:
        return len(self._open)
