"""Errors of the rollout package::

    RolloutError(kind, turns)     a rollout that cannot finish; ``kind`` is a RolloutFailed kind
    TaskInputError (tasks.py)     task_input does not fit the task
    UnknownTaskError (tasks.py)   no task registered under that name
"""

from __future__ import annotations

from rollmesh.messages.rollout import FailureKind


class RolloutError(Exception):
    def __init__(self, kind: FailureKind, reason: str, *, turns: int = 0) -> None:
        super().__init__(reason)
        self.kind = kind
        self.turns = turns
