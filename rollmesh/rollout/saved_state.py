"""A rollout's saved, resumable state: built from a running rollout, and a rollout rebuilt from it
(the JetStream store of these states is the bus's ``rollout_states.py``).

Knows the trajectory, the task types and the ``RolloutState`` wire struct; nothing of NATS.
The state carries what rebuilds the token-exact trajectory (the conversation's chat messages and
its TokenTraces, one per training sample, with the messages each covers) and what the reward reads (the calls, their outputs, the finish reason).
``InMemoryRolloutStates`` implements ``rollmesh.ports.RolloutStateStore`` for in-process runs
(the CLI's embedded mode, benchmarks, unit tests); the mesh uses the JetStream KV bucket.
"""

from __future__ import annotations

import json

import msgspec

from rollmesh.chat import ToolCall
from rollmesh.messages import RolloutState, SavedToolCall
from rollmesh.rollout.tasks import RewardInput, ToolOutput
from rollmesh.rollout.trajectory import RolloutTrajectory


def conversation_of(state: RolloutState) -> RewardInput:
    """The conversation as saved (``finish_reason`` "stop" until the state says otherwise)."""
    calls = [ToolCall(id=call.call_id, name=call.name, arguments=dict(call.arguments), index=number)
             for number, call in enumerate(state.tool_calls)]
    return RewardInput(
        messages=[dict(message) for message in state.messages], tool_calls=calls,
        tool_outputs=[ToolOutput(call.ok, call.output) for call in state.tool_calls],
        final_text=state.final_text, finish_reason="truncated" if state.finish_reason == "truncated" else "stop",
        malformed_tool_calls=state.malformed_tool_calls,
    )


def with_progress(state: RolloutState, *, trajectory: RolloutTrajectory, conversation: RewardInput, turn: int,
                  now: float, ended: bool, **changes: object) -> RolloutState:
    """``state`` after ``turn`` turns; ``ended``: the rollout's last turn has run."""
    calls = [SavedToolCall(name=call.name, argument=json.dumps(call.arguments, ensure_ascii=False), ok=output.ok,
                           output=output.text, call_id=call.id, arguments=dict(call.arguments))
             for call, output in zip(conversation.tool_calls, conversation.tool_outputs)]
    traces = trajectory.traces()
    return msgspec.structs.replace(
        state, turn=turn, trajectory=traces[0], trajectory_ref="", split_samples=traces[1:], split_sample_refs=[],
        sample_message_counts=trajectory.message_counts if len(traces) > 1 else [],
        # A state saved before TokenTrace keeps its flat fields no longer.
        tokens=[], loss_mask=[], logprobs=[], versions=[], tool_calls=calls,
        final_text=conversation.final_text,
        finished_with_eos=ended and conversation.finish_reason == "stop",
        messages=trajectory.messages, finish_reason=conversation.finish_reason if ended else "",
        malformed_tool_calls=conversation.malformed_tool_calls, updated_at=now, **changes,
    )


class InMemoryRolloutStates:
    """Rollout states in a dict: lost with the process, so only for in-process runs and tests."""

    def __init__(self) -> None:
        self.states: dict[str, RolloutState] = {}
        self.saves = 0

    async def load(self, rollout_id: str) -> RolloutState | None:
        return self.states.get(rollout_id)

    async def save(self, state: RolloutState) -> None:
        self.saves += 1
        self.states[state.rollout_id] = state

    async def delete(self, rollout_id: str) -> None:
        self.states.pop(rollout_id, None)
