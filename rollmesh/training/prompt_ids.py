"""The names a training job gives its prompts: one GRPO group per prompt, named for where the
prompt came from, so that the trainer's ledger (which records each step's group ids) says which
dataset rows were consumed.

Knows only strings. A group id is ``<stage>/e<epoch>/i<index>``: the stage's name, the epoch of
the pass over its data and the row's index in the dataset (0-based; the file's line number is
reported with bad rows). Rollout ids add the run and the member: ``<run>-<stage>-e<E>-i<I>-<m>``,
unique across runs, so JetStream's duplicate window never mistakes another run's request for a
repeat.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_GROUP = re.compile(r"^(?P<stage>.+)/e(?P<epoch>\d+)/i(?P<index>\d+)$")


@dataclass(frozen=True, order=True)
class PromptRef:
    stage: str
    epoch: int
    index: int

    @property
    def group_id(self) -> str:
        return f"{self.stage}/e{self.epoch}/i{self.index}"

    def rollout_id(self, run: str, member: int) -> str:
        return f"{run}-{self.stage}-e{self.epoch}-i{self.index}-{member}"


def parse_group_id(group_id: str) -> PromptRef | None:
    """The prompt a feeder's group id names; None for any other group id."""
    match = _GROUP.match(group_id)
    if match is None:
        return None
    return PromptRef(match["stage"], int(match["epoch"]), int(match["index"]))
