"""Rollout events: the client-facing part of the contract (JSON on the wire).

Knows msgspec only. A client in any language publishes ``RolloutRequested`` as a JSON object on
``rl.<ns>.rollout.requested`` and reads ``RolloutProgressed`` / ``RolloutCompleted`` /
``RolloutFailed`` back.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta

from rollmesh.messages.base import SamplingParams, WireMessage

NonEmptyId = Annotated[str, Meta(min_length=1, max_length=200)]
Purpose = Literal["train", "eval"]


class RolloutRequested(WireMessage, frozen=True, tag="rollout.requested"):
    """Ask the mesh to run one agent rollout of a registered task."""

    rollout_id: NonEmptyId
    task: NonEmptyId
    # Task-specific input; the task plugin builds the prompt from it and verifies against it.
    task_input: dict[str, Any] = {}
    # Rollouts that share a group_id form one GRPO group.
    group_id: str = ""
    purpose: Purpose = "train"
    sampling: SamplingParams = SamplingParams()
    max_turns: Annotated[int, Meta(ge=1, le=1000)] = 4
    requested_at: float = 0.0


class RolloutProgressed(WireMessage, frozen=True, tag="rollout.progressed"):
    """A turn finished (ephemeral, core NATS)."""

    rollout_id: str
    turn: int
    num_tokens: int
    weight_version: int
    status: str = "running"


class RolloutCompleted(WireMessage, frozen=True, tag="rollout.completed"):
    """A finished rollout with the exact tokens the model saw and produced.

    ``tokens``, ``loss_mask``, ``logprobs`` and ``versions`` have one entry per token. Prompt and
    tool-output tokens have loss_mask 0, logprob 0.0 and version -1.
    """

    rollout_id: str
    task: str
    group_id: str
    purpose: Purpose
    reward: float
    turns: int
    tool_calls: int
    prompt_len: int
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str = ""
    duration_s: float = 0.0
    # Where the trajectory blob lives when it is too large to inline (later issues); "" = inline.
    trajectory_ref: str = ""


FailureKind = Literal[
    "invalid_request",
    "unknown_task",
    "sandbox_error",
    "sandbox_timeout",
    "inference_error",
    "internal_error",
]


class RolloutFailed(WireMessage, frozen=True, tag="rollout.failed"):
    """A rollout that could not run or finish, for an infrastructure reason, never a zero reward."""

    rollout_id: str
    kind: FailureKind
    reason: str
    group_id: str = ""
    purpose: Purpose = "train"
    turns: int = 0
