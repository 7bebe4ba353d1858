"""Errors of the rollout package, one tree under ``RolloutError``::

    RolloutError(kind, turns)                       a rollout that cannot finish; ``kind`` is its
    │                                               RolloutFailed kind
    ├── TaskInputError(task, reason), ValueError    task_input does not fit the task (invalid_request)
    ├── UnknownTaskError(task), LookupError         no task registered under that name (unknown_task)
    └── GenerationTimeoutError(request_id,          a turn's generation not back within
            timeout_s, turns)                       rollout.generate_timeout_s (inference_error: retried)

The builtin second bases stay because task code and callers catch them. ``rollout.tasks`` still
exports the task errors.
"""

from __future__ import annotations

from rollmesh.messages.rollout import FailureKind


class RolloutError(Exception):
    def __init__(self, kind: FailureKind, reason: str, *, turns: int = 0) -> None:
        super().__init__(reason)
        self.kind = kind
        self.turns = turns


class TaskInputError(RolloutError, ValueError):
    """A rollout request's ``task_input`` does not fit its task."""

    def __init__(self, reason: str, *, task: str) -> None:
        super().__init__("invalid_request", f"task {task!r}: {reason}")
        self.task = task
        self.reason = reason


class UnknownTaskError(RolloutError, LookupError):
    def __init__(self, task: str, *, known: list[str]) -> None:
        super().__init__("unknown_task", f"unknown task {task!r}; registered: {', '.join(sorted(known)) or 'none'}")
        self.task = task


class GenerationTimeoutError(RolloutError):
    """A turn's generation did not come back within ``rollout.generate_timeout_s``; the call was
    cancelled (the decode worker aborts the request). An ``inference_error``: the rollout retries
    the turn from its last saved state, like any lost inference call."""

    def __init__(self, *, request_id: str, timeout_s: float, turns: int) -> None:
        super().__init__("inference_error", f"turn {turns}: no generation within {timeout_s:g} s "
                         f"(request {request_id} cancelled)", turns=turns)
        self.request_id = request_id
        self.timeout_s = timeout_s
