"""Task plugins: what a rollout is about, which tools it may call, and how it is rewarded.

Knows nothing of Ray, NATS or torch. A task speaks chat messages and OpenAI function schemas; the
model's own chat template and tool-call format are the agent loop's business, never the task's.
A task is any class satisfying ``Task``; it is registered by import path ("package.module:Class")
in ``rollout.tasks`` of the config, so users bring their own environments without touching
rollmesh (docs/task-plugins.md).
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rollmesh.chat import ToolCall
# What a reward sees lives with the rewards; re-exported here, where task plugins import from.
from rollmesh.rewards.reward_input import FinishReason, RewardInput, RewardScore, ToolOutput
# The task errors live with the package's other errors; re-exported here for task plugins.
from rollmesh.rollout.errors import TaskInputError, UnknownTaskError

__all__ = ["DemonstrableTask", "FinishReason", "ImportsRewardFunctions", "PythonTool", "RewardInput",
           "RewardScore", "SandboxCommand", "Task", "TaskInputError", "TaskRegistry", "ToolAction",
           "ToolOutput", "UnknownTaskError", "is_environment", "load_task"]


@dataclass(frozen=True)
class SandboxCommand:
    """Run ``argv`` in the rollout's sandbox; the model is shown its output (or its failure)."""

    argv: list[str]


@dataclass(frozen=True)
class PythonTool:
    """Answer a call with trusted task code run in the worker (a pure computation, no I/O the
    sandbox should contain): ``function()`` returns the text the model is shown. It runs in a
    thread, so a slow one does not stall other rollouts; an exception it raises is shown to the
    model as a failed tool result."""

    function: Callable[[], str]


ToolAction = SandboxCommand | PythonTool


@runtime_checkable
class Task(Protocol):
    name: str

    def messages(self, task_input: dict[str, Any]) -> list[dict[str, Any]]:
        """The conversation's opening chat messages (``system`` and ``user``)."""
        ...

    def tools(self) -> list[dict[str, Any]]:
        """The tools the model may call, as OpenAI function schemas
        (``{"type": "function", "function": {"name", "description", "parameters"}}``)."""
        ...

    def tool_action(self, call: ToolCall, task_input: dict[str, Any]) -> ToolAction:
        """What answers a well-formed ``call`` (its arguments already match the tool's schema)."""
        ...

    def reward(self, sample: RewardInput) -> float | dict[str, float] | RewardScore:
        """The finished rollout's reward: a float, or a dict of named floats whose total is its
        ``"reward"`` key if present, else the sum of its values (each key is logged on its own),
        or a ``RewardScore`` (a total and its named components, as ``CombinedReward`` gives).
        ``sample.row`` is the request's task_input. Raise ``rollmesh.rewards.errors.
        RewardUnavailableError`` when the reward cannot be computed now (a server down): the
        rollout fails as ``reward_error``, retried and then masked, never scored as a zero."""
        ...


@runtime_checkable
class DemonstrableTask(Task, Protocol):
    """A task that can also sample its own inputs and demonstrate episodes (warm start, demo)."""

    def sample_task_inputs(self, rng: random.Random, count: int, *, held_out: bool) -> list[dict[str, Any]]: ...

    def demonstration(self, task_input: dict[str, Any], *, exact: bool,
                      rng: random.Random) -> list[dict[str, Any]]:
        """The messages that follow ``messages(task_input)`` in a demonstrated episode: a fully
        right one with ``exact``, else one that is almost right (the warm start mixes them, so RL
        starts from a policy that is only sometimes right).

        Assistant turns are ``{"role": "assistant", "content": str, "tool_calls": [ToolCall, ...]}``
        (``rollmesh.chat.ToolCall`` objects, the list empty or absent for a plain answer), so the
        warm start writes each one as the model would, ``ChatModel.write_turn(content=, calls=)``,
        and records it through a ChatTrajectory exactly as a rollout does. Tool results are
        ``{"role": "tool", "tool_call_id": str, "content": str}``, answering the calls in order.
        """
        ...


@runtime_checkable
class ImportsRewardFunctions(Protocol):
    """A task whose requests name reward functions by import path: it imports only those the
    mesh's config allows (a request is data; what it makes a worker import is the config's say)."""

    def allow_reward_functions(self, import_paths: list[str]) -> None: ...


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
        """A task plugin, or an environment (rollmesh/rollout/environments.py: name, reset, step),
        which the agent loop instantiates afresh for each rollout."""
        if not isinstance(task, Task) and not is_environment(task):
            raise TypeError(f"{task!r} implements neither the Task protocol (name, messages, tools, "
                            "tool_action, reward) nor the Environment one (name, reset, step)")
        self._tasks[task.name] = task

    def get(self, name: str) -> Task:
        try:
            return self._tasks[name]
        except KeyError:
            raise UnknownTaskError(name, known=list(self._tasks)) from None

    def names(self) -> list[str]:
        return sorted(self._tasks)

    def allow_reward_functions(self, import_paths: list[str]) -> None:
        """Tell the tasks that score by import-path rewards named in requests (the built-in
        ``dataset`` task) which ones this mesh may import: ``rollout.reward_functions``."""
        for task in self._tasks.values():
            if isinstance(task, ImportsRewardFunctions):
                task.allow_reward_functions(import_paths)


def is_environment(plugin: object) -> bool:
    """True for an environment (``name``, ``reset``, ``step``) that is not also a task plugin."""
    return (not isinstance(plugin, Task) and isinstance(getattr(plugin, "name", None), str)
            and callable(getattr(plugin, "reset", None)) and callable(getattr(plugin, "step", None)))


def load_task(import_path: str) -> Task:
    """Instantiate ``"package.module:Class"`` (no arguments)."""
    module_name, _, attribute = import_path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"task import path {import_path!r} must look like 'package.module:Class'")
    factory = getattr(importlib.import_module(module_name), attribute)
    return factory()
