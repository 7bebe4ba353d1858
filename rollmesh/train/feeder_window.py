"""How many groups an RL stage's feeder publishes, and when the stage is done (plain logic).

Knows the feeder's cursor and the trainer's step; nothing of NATS. A stage of ``steps`` trainer
steps needs ``steps x groups_per_step`` trained groups; the feeder keeps at most
``groups_per_step + max_groups_ahead`` of its groups outstanding (published, not yet consumed),
and never more than the stage still needs, so every group it publishes is trained by this stage.
A group dynamic sampling dropped is not trained: it leaves the window, and the next read prompt
takes its place.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollmesh.train.feeder_cursor import FeederCursor


@dataclass(frozen=True)
class StagePlan:
    name: str
    stage_index: int
    steps: int  # trainer steps this stage runs
    groups_per_step: int
    max_groups_ahead: int


def stage_steps(*, steps: int, epochs: int, num_rows: int, groups_per_step: int) -> int:
    """Trainer steps of an RL stage: ``steps``, or enough to read every row ``epochs`` times
    (rounded up to whole steps: the last one's groups read on into the next epoch)."""
    if steps:
        return steps
    return -(-epochs * num_rows // groups_per_step)


class FeederWindow:
    def __init__(self, plan: StagePlan, cursor: FeederCursor) -> None:
        if cursor.start_step < 0:
            raise ValueError("the cursor of a started stage has its start_step")
        self.plan = plan
        self.cursor = cursor
        self._outstanding = set(cursor.outstanding)

    @property
    def outstanding(self) -> frozenset[str]:
        return frozenset(self._outstanding)

    def steps_done(self, trainer_step: int) -> int:
        return max(0, trainer_step - self.cursor.start_step)

    def finished(self, trainer_step: int) -> bool:
        return self.steps_done(trainer_step) >= self.plan.steps

    def wanted(self, trainer_step: int) -> int:
        """Groups to publish now."""
        remaining = (self.plan.steps - self.steps_done(trainer_step)) * self.plan.groups_per_step
        limit = min(self.plan.groups_per_step + self.plan.max_groups_ahead, remaining)
        return max(0, limit - len(self._outstanding))

    def published(self, group_id: str, next_position: int) -> FeederCursor:
        """The cursor to write once ``group_id``'s requests are acknowledged."""
        self._outstanding.add(group_id)
        self.cursor = self.cursor.with_(next_position=next_position, outstanding=sorted(self._outstanding))
        return self.cursor

    def consumed(self, group_ids: list[str] | set[str] | frozenset[str]) -> FeederCursor:
        """A durable step (or the ledger, on resume) consumed these groups."""
        self._outstanding.difference_update(group_ids)
        self.cursor = self.cursor.with_(outstanding=sorted(self._outstanding))
        return self.cursor

    def dropped(self, group_id: str) -> FeederCursor:
        """Dynamic sampling set this group aside: it frees its place for a new prompt."""
        if group_id in self._outstanding:
            self._outstanding.discard(group_id)
            self.cursor = self.cursor.with_(outstanding=sorted(self._outstanding),
                                            dropped=self.cursor.dropped + 1)
        return self.cursor
