"""Multi-turn environments: what answers the model between its turns when that is more than tools
in a sandbox (a simulated instrument, a user simulator).

Knows chat messages only; nothing of Ray, NATS or tokens. An environment is a class with a
``name`` and two methods, registered by import path in ``rollout.tasks`` like a task plugin:

- ``reset(sample) -> EnvReset``: the conversation's opening messages and the tools the model may
  call, for one rollout's task input;
- ``step(assistant_message) -> EnvStep``: the model's turn (an OpenAI message: ``content``,
  ``tool_calls``) in, the messages that answer it (any roles: tool results, a user's reply), whether
  the episode is ``done``, and optionally a reward.

Each rollout gets a fresh instance. ``EnvironmentRollout`` presents one to the agent loop as a
task: its messages and tools come from ``reset``, each clean turn goes to ``step`` (instead of
running tool calls), and the rollout's reward is the last reward a step gave (0.0 when none did:
an episode cut before its end, by ``max_new_tokens`` or ``max_turns``). A task plugin is the
other kind of environment: its tools run in the rollout's sandbox and its ``reward`` scores the
conversation. A rollout resumed after a crash replays the saved assistant turns through a fresh
instance's ``step`` so the environment is where it was: environments must be deterministic in
their inputs (seed any randomness from the sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rollmesh.rewards.reward_input import RewardInput
from rollmesh.rollout.tasks import TaskInputError


@dataclass(frozen=True)
class EnvReset:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class EnvStep:
    messages: list[dict[str, Any]]
    done: bool
    reward: float | dict[str, float] | None = None


@runtime_checkable
class Environment(Protocol):
    name: str

    def reset(self, sample: dict[str, Any]) -> EnvReset: ...

    def step(self, assistant_message: dict[str, Any]) -> EnvStep: ...


class EnvironmentRollout:
    """One rollout's environment, in the shape the agent loop runs a task in."""

    def __init__(self, environment: Environment, sample: dict[str, Any]) -> None:
        self.environment = environment
        self.name = environment.name
        try:
            self.start = environment.reset(sample)
        except (KeyError, TypeError, ValueError) as exc:
            raise TaskInputError(f"reset refused the task input: {exc!r}", task=self.name) from exc
        self.rewards: list[float | dict[str, float]] = []

    @classmethod
    def fresh(cls, registered: Environment, sample: dict[str, Any]) -> EnvironmentRollout:
        """A new instance of the registered environment's class, reset for ``sample``."""
        return cls(type(registered)(), sample)

    def messages(self, task_input: dict[str, Any]) -> list[dict[str, Any]]:
        return list(self.start.messages)

    def tools(self) -> list[dict[str, Any]]:
        return list(self.start.tools)

    def tool_action(self, call: Any, task_input: dict[str, Any]) -> Any:
        raise TypeError(f"environment {self.name!r} answers whole turns (step), not single tool calls")

    def step(self, assistant_message: dict[str, Any]) -> EnvStep:
        result = self.environment.step(assistant_message)
        if not isinstance(result, EnvStep):
            raise TypeError(f"environment {self.name!r}: step returned {type(result).__name__}, not EnvStep")
        if result.reward is not None:
            self.rewards.append(result.reward)
        return result

    def replay(self, messages: Sequence[dict[str, Any]]) -> None:
        """Bring a fresh instance to where a saved conversation left it: its assistant turns
        after the opening messages, stepped again (what they return is already in it)."""
        for message in list(messages)[len(self.start.messages):]:
            if message.get("role") == "assistant":
                self.step(message)

    def reward(self, sample: RewardInput) -> float | dict[str, float]:
        return self.rewards[-1] if self.rewards else 0.0
