"""The built-in task of RL stages on a dataset: a row's chat messages in, the stage's rewards out.

Knows the task plugin Protocol, the reward specs and ``CombinedReward``; nothing of Ray, NATS,
torch or datasets (the feeder reads the dataset and builds each request). A request's task_input::

    {"messages": [OpenAI chat messages, the system prompt included],
     "row": {the dataset row as it was in the file},
     "answer": "the row's answer after field mapping" | null,
     "rewards": [{"name": "math"} | {"fn": "package.module:function"}, "weight": 1.0, "args": {}]}

No tools: the model answers in text. A request names its rewards, but a request is data: an
import-path reward is imported only when the worker's config lists it in
``rollout.reward_functions`` (the registry passes that list in, ``allow_reward_functions``).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterable
from typing import Any

import msgspec

from rollmesh.chat import ToolCall
from rollmesh.rewards.combined import CombinedReward
from rollmesh.rewards.errors import RewardLoadError
from rollmesh.rewards.reward_input import RewardInput, RewardScore
from rollmesh.rollout.tasks import TaskInputError, ToolAction
from rollmesh.run_config import RewardSpec

# Distinct reward lists kept loaded (one per stage in practice); past this the cache starts over.
MAX_CACHED_REWARDS = 64


class DatasetTask:
    name = "dataset"

    def __init__(self, reward_functions: Iterable[str] = ()) -> None:
        self._allowed = frozenset(reward_functions)
        self._rewards: dict[str, CombinedReward] = {}
        self._lock = threading.Lock()  # rewards run in threads, several rollouts at once

    def allow_reward_functions(self, import_paths: list[str]) -> None:
        with self._lock:
            self._allowed = frozenset(import_paths)
            self._rewards.clear()

    def messages(self, task_input: dict[str, Any]) -> list[dict[str, Any]]:
        messages = task_input.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TaskInputError("task_input.messages must be a non-empty list of chat messages", task=self.name)
        for number, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise TaskInputError(f"task_input.messages[{number}] is not a chat message with a role",
                                     task=self.name)
        return [dict(message) for message in messages]

    def tools(self) -> list[dict[str, Any]]:
        return []

    def tool_action(self, call: ToolCall, task_input: dict[str, Any]) -> ToolAction:
        # Never reached: with no tools declared, every call is malformed and runs nothing.
        raise TaskInputError(f"the dataset task has no tools (called {call.name!r})", task=self.name)

    def reward(self, sample: RewardInput) -> RewardScore:
        """The weighted total of the request's rewards over the row; each reward's own score is a
        component. ``sample.row`` is the task_input; the rewards see the dataset row and answer."""
        task_input = sample.row
        row, answer = task_input.get("row", {}), task_input.get("answer")
        if not isinstance(row, dict) or not (answer is None or isinstance(answer, str)):
            raise TaskInputError("task_input.row must be an object and task_input.answer a string or null",
                                 task=self.name)
        combined = self._combined(task_input.get("rewards"))
        return combined.score(dataclasses.replace(sample, row=row, answer=answer))

    def _combined(self, entries: object) -> CombinedReward:
        try:
            key = json.dumps(entries, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise TaskInputError(f"task_input.rewards is not JSON: {exc}", task=self.name) from exc
        with self._lock:
            cached = self._rewards.get(key)
            allowed = self._allowed
        if cached is not None:
            return cached
        if not isinstance(entries, list) or not entries:
            raise TaskInputError("task_input.rewards must be a non-empty list of rewards", task=self.name)
        try:
            specs = msgspec.convert(entries, list[RewardSpec])
        except msgspec.ValidationError as exc:
            raise TaskInputError(f"task_input.rewards: {exc}", task=self.name) from exc
        for spec in specs:
            if spec.fn and spec.fn not in allowed:
                raise TaskInputError(f"reward function {spec.fn!r} is not in this mesh's "
                                     f"rollout.reward_functions ({', '.join(sorted(allowed)) or 'empty'})",
                                     task=self.name)
        try:
            combined = CombinedReward(specs)
        except RewardLoadError as exc:  # allowed, but it does not load on this worker
            raise TaskInputError(str(exc), task=self.name) from exc
        with self._lock:
            if len(self._rewards) >= MAX_CACHED_REWARDS:
                self._rewards.clear()
            self._rewards[key] = combined
        return combined
