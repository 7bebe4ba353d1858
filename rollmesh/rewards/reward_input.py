"""What every reward sees (``RewardInput``) and what its value means (``RewardScore``).

Knows the chat types only; nothing of Ray, NATS, torch or the agent loop. A reward is a task's
``reward(sample)`` or a function ``fn(sample, **args)``; it returns a float or a dict of named
floats, read by ``score_of``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from rollmesh.chat import ToolCall

FinishReason = Literal["stop", "truncated"]


@dataclass(frozen=True)
class ToolOutput:
    """What a tool returned; ``ok`` is False when it failed (non-zero exit, timeout, exception)."""

    ok: bool
    text: str


@dataclass(frozen=True, kw_only=True)
class RewardInput:
    """A finished rollout, as a reward sees it.

    ``row``: the dataset row as it was in the file (for a task plugin: the request's task_input).
    ``answer``: the row's answer (or label) after field mapping; None when it has none.
    ``messages``: the opening messages, then every assistant turn as the OpenAI message parsed from
    its exact tokens (``content``, ``tool_calls`` in the OpenAI shape) and every tool result
    (``{"role": "tool", "tool_call_id", "content"}``), in order. ``tool_calls``: the well-formed
    calls the model made, in order, with ``tool_outputs`` one per call. ``final_text``: the content
    of the last assistant turn when it called no tool ("" otherwise). ``finish_reason``: "stop"
    when the last turn ended with an end-of-turn token, "truncated" when it was cut (by
    ``max_new_tokens`` or the model's context). ``malformed_tool_calls``: calls that could not be
    run (bad JSON, unknown tool, arguments not matching the schema); the model was told why.
    """

    row: dict[str, Any] = field(default_factory=dict)
    answer: str | None = None
    messages: list[dict[str, Any]]
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_outputs: list[ToolOutput] = field(default_factory=list)
    final_text: str = ""
    finish_reason: FinishReason = "stop"
    malformed_tool_calls: int = 0


@dataclass(frozen=True)
class RewardScore:
    """A reward's value read whole: ``total`` (what GRPO trains on) and ``components`` (named
    scores, logged each as its own metric)."""

    total: float
    components: dict[str, float] = field(default_factory=dict)


def score_of(value: object, *, label: str = "") -> RewardScore:
    """Read a reward's value: a number is its own total; a dict's total is its ``"reward"`` key
    if present, else the sum of its values, and each other key is a component named
    ``<label>/<key>`` (``<key>`` when ``label`` is ""). Raises ``ValueError`` for anything else
    (a non-number, NaN or infinity: the trainer would train on it). A ``RewardScore`` (what a
    combination of rewards returns) is read as it is."""
    if isinstance(value, RewardScore):
        return value
    if isinstance(value, dict):
        named = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"a reward's dict has a key {key!r} that is not a string")
            named[key] = _number(item, what=f"its {key!r}")
        total = named["reward"] if "reward" in named else sum(named.values())
        return RewardScore(total, {(f"{label}/{key}" if label else key): item
                                   for key, item in named.items() if key != "reward"})
    return RewardScore(_number(value, what="it"), {})


def _number(value: object, *, what: str) -> float:
    if not isinstance(value, (int, float)):
        raise ValueError(f"a reward is a float or a dict of floats; {what} is {type(value).__name__} {value!r:.80}")
    if not math.isfinite(value):
        raise ValueError(f"a reward must be finite; {what} is {value!r}")
    return float(value)
