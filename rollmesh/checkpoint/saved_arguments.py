"""Typed reads of the training arguments saved with a Megatron checkpoint (Megatron-LM's ``args``:
an ``argparse.Namespace``, or a plain mapping from other front ends).

Knows nothing of models or files. Every read of a saved argument goes through ``SavedArguments``,
so a value of the wrong type is a ``CheckpointArgumentError`` naming the argument and its value,
never a bare TypeError from ``int(None)``. The caller decides which arguments apply to the model
and reads only those. Absent and None are told apart: an absent argument is one the writer's
Megatron version did not have, so it takes Megatron-LM's default where the caller gives one
(``default=``); None is what a writer records for an option it leaves unset, which for a number
the model needs is unreadable (a caller with Megatron's own rule for None applies it instead).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from rollmesh.checkpoint.errors import CheckpointArgumentError

ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "<absent>"})()


class SavedArguments:
    def __init__(self, args: Any, *, path: str) -> None:
        self._args = args
        self.path = path

    def value(self, name: str) -> Any:
        """The saved value as it is, or ``ABSENT``."""
        if isinstance(self._args, Mapping):
            return self._args.get(name, ABSENT)
        return getattr(self._args, name, ABSENT)

    def unset(self, name: str) -> bool:
        """Absent or None."""
        value = self.value(name)
        return value is ABSENT or value is None

    def refuse(self, name: str, reason: str, value: Any = ABSENT) -> CheckpointArgumentError:
        """The error for argument ``name`` (its saved value unless ``value`` is given)."""
        value = self.value(name) if value is ABSENT else value
        return CheckpointArgumentError(argument=name, value=None if value is ABSENT else value,
                                       reason=reason, path=self.path)

    def required_int(self, name: str, *, minimum: int = 1, default: int | None = None) -> int:
        """An integer the model needs; absent -> ``default`` (Megatron-LM's), else refused."""
        value = self.value(name)
        if value is ABSENT and default is not None:
            return default
        if value is ABSENT or value is None:
            raise self.refuse(name, "the model needs it and it was not saved" if value is ABSENT else
                              "the model needs an integer here")
        return self._int(name, value, minimum)

    def optional_int(self, name: str, *, minimum: int = 1) -> int | None:
        """An integer that may be unset (absent or None -> None)."""
        value = self.value(name)
        return None if value is ABSENT or value is None else self._int(name, value, minimum)

    def required_float(self, name: str, *, default: float | None = None, minimum: float = 0.0) -> float:
        """A finite number the model needs, at least ``minimum``; absent -> ``default``."""
        value = self.value(name)
        if value is ABSENT and default is not None:
            return default
        if value is ABSENT or value is None:
            raise self.refuse(name, "the model needs it and it was not saved" if value is ABSENT else
                              "the model needs a number here")
        return self._float(name, value, minimum)

    def optional_float(self, name: str, *, minimum: float = 0.0) -> float | None:
        value = self.value(name)
        return None if value is ABSENT or value is None else self._float(name, value, minimum)

    def switch(self, name: str) -> bool:
        """An on/off option: absent or None is off, as Megatron-LM's own ``if args.<name>`` reads it."""
        value = self.value(name)
        if value is ABSENT or value is None:
            return False
        if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
            return bool(value)
        raise self.refuse(name, "expected true or false")

    def is_set(self, name: str) -> bool:
        """Whether an option that turns a feature on is in use: anything but absent, None, false or 0."""
        value = self.value(name)
        if value is ABSENT or value is None or value is False:
            return False
        return not (isinstance(value, numbers.Number) and value == 0)

    def optional_str(self, name: str) -> str | None:
        value = self.value(name)
        if value is ABSENT or value is None:
            return None
        if not isinstance(value, str):
            raise self.refuse(name, "expected a string")
        return value

    def _int(self, name: str, value: Any, minimum: int) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # a front end that writes 4096.0
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise self.refuse(name, "expected an integer")
        if value < minimum:
            raise self.refuse(name, f"expected an integer of at least {minimum}")
        return int(value)

    def _float(self, name: str, value: Any, minimum: float) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise self.refuse(name, "expected a finite number")
        if value < minimum:
            raise self.refuse(name, f"expected a number of at least {minimum}")
        return float(value)
