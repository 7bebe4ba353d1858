"""Errors of the checkpoint package. Knows nothing but the standard library.

    CheckpointError
    ├── CheckpointReadError                a source is missing, corrupt or unreadable
    │   ├── UnsupportedCheckpointFormatError   no reader for this format (yet)
    │   └── CheckpointArgumentError            a saved training argument the model needs is unreadable
    ├── CheckpointWriteError               a checkpoint or export was not written or published
    └── TaskTooLargeError(tensor, nbytes, budget), ValueError
                                           converting one tensor needs more memory than the budget
                                           (convert_planner; no file concerned, so ``path`` is "")
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Root of the tree; ``path`` is the checkpoint directory or file concerned ("" for none)."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(f"{message} ({path})" if path else message)
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only fields defeat Exception's default pickling, and conversion errors cross
        # process boundaries (Ray tasks): rebuild from the message and the fields as they are.
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(kind: type[CheckpointError], args: tuple[object, ...], fields: dict[str, object]) -> CheckpointError:
    error = kind.__new__(kind)
    Exception.__init__(error, *args)
    error.__dict__.update(fields)
    return error


class CheckpointReadError(CheckpointError):
    def __init__(self, reason: str, *, path: str) -> None:
        super().__init__(f"cannot read checkpoint: {reason}", path=path)
        self.reason = reason


class UnsupportedCheckpointFormatError(CheckpointReadError):
    def __init__(self, *, format: str, path: str) -> None:  # noqa: A002 - the wire field's name
        super().__init__(f"no reader for format {format!r}", path=path)
        self.format = format


class CheckpointArgumentError(CheckpointReadError):
    """A training argument saved with the checkpoint (Megatron-LM's ``args``) that applies to the
    model but is absent, None, of the wrong type or out of range: ``argument`` names it, ``value``
    is what was saved (None also when it was absent)."""

    def __init__(self, *, argument: str, value: object, reason: str, path: str) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        super().__init__(f"saved argument {argument} = {shown}: {reason}", path=path)
        self.argument = argument
        self.value = value


class CheckpointWriteError(CheckpointError):
    def __init__(self, reason: str, *, path: str) -> None:
        super().__init__(f"cannot write checkpoint: {reason}", path=path)
        self.reason = reason


class TaskTooLargeError(CheckpointError, ValueError):
    """Converting ``tensor`` holds ``nbytes`` at once, over the memory ``budget``: permanent (the
    resharder does not retry it), raised by the planner before anything is read."""

    def __init__(self, tensor: str, nbytes: int, budget: int) -> None:
        super().__init__(f"{tensor}: converting it holds {nbytes} bytes, over the memory budget of {budget} bytes",
                         path="")
        self.tensor, self.nbytes, self.budget = tensor, nbytes, budget
