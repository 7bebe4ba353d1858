"""Task plugins: what a rollout is about, which tools it may call, and how it is rewarded.

Knows nothing of Ray, NATS or torch. A task is any class satisfying ``Task``; it is registered by
import path ("package.module:Class") in ``rollout.tasks`` of the config, so users bring their own
environments without touching rollmesh.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from the model's exact output: ``<name>argument</name>``."""

    name: str
    argument: str


@dataclass(frozen=True)
class ToolOutput:
    """What a tool returned; ``ok`` is False when the command failed (non-zero exit)."""

    ok: bool
    text: str


@dataclass(frozen=True)
class Transcript:
    """What the reward function sees: the calls made, their outputs, and the final answer text."""

    tool_calls: list[ToolCall]
    tool_outputs: list[ToolOutput]
    final_text: str
    finished_with_eos: bool


@runtime_checkable
class Task(Protocol):
    name: str
    # Tool names the model may call; each maps to a sandbox command through ``tool_argv``.
    tools: frozenset[str]

    def build_prompt(self, task_input: dict[str, Any]) -> str: ...

    def tool_argv(self, call: ToolCall, task_input: dict[str, Any]) -> list[str]: ...

    def reward(self, task_input: dict[str, Any], transcript: Transcript) -> float: ...


@runtime_checkable
class DemonstrableTask(Task, Protocol):
    """A task that can also sample its own inputs and demonstrate episodes (warm start, demo)."""

    def sample_task_inputs(self, rng: random.Random, count: int, *, held_out: bool) -> list[dict[str, Any]]: ...

    def demonstration(self, task_input: dict[str, Any], *, uses_tool: bool,
                      rng: random.Random) -> list[tuple[str, bool]]: ...


class TaskInputError(ValueError):
    """A rollout request's ``task_input`` does not fit its task."""

    def __init__(self, reason: str, *, task: str) -> None:
        super().__init__(f"task {task!r}: {reason}")
        self.task = task
        self.reason = reason


class UnknownTaskError(LookupError):
    def __init__(self, task: str, *, known: list[str]) -> None:
        super().__init__(f"unknown task {task!r}; registered: {', '.join(sorted(known)) or 'none'}")
        self.task = task


class TaskRegistry:
    """Tasks by name, loaded from import paths."""

    def __init__(self, tasks: list[Task] | None = None) -> None:
        self._tasks: dict[str, Task] = {}
        for task in tasks or []:
            self.register(task)

    @classmethod
    def from_import_paths(cls, paths: list[str]) -> "TaskRegistry":
        return cls([load_task(path) for path in paths])

    def register(self, task: Task) -> None:
        if not isinstance(task, Task):
            raise TypeError(f"{task!r} does not implement the Task protocol")
        self._tasks[task.name] = task

    def get(self, name: str) -> Task:
        try:
            return self._tasks[name]
        except KeyError:
            raise UnknownTaskError(name, known=list(self._tasks)) from None

    def names(self) -> list[str]:
        return sorted(self._tasks)


def load_task(import_path: str) -> Task:
    """Instantiate ``"package.module:Class"`` (no arguments)."""
    module_name, _, attribute = import_path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"task import path {import_path!r} must look like 'package.module:Class'")
    factory = getattr(importlib.import_module(module_name), attribute)
    return factory()
