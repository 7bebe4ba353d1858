"""A rollout's resumable state: built from a running rollout, and a rollout rebuilt from it.

Knows the trajectory, the task types and the ``RolloutState`` wire struct; nothing of NATS.
``InMemoryRolloutStates`` implements ``rollmesh.ports.RolloutStateStore`` for in-process runs
(the CLI's embedded mode, benchmarks, unit tests); the mesh uses the JetStream KV bucket.
"""

from __future__ import annotations

import msgspec

from rollmesh.messages import RolloutState, SavedToolCall
from rollmesh.rollout.tasks import ToolCall, ToolOutput, Transcript
from rollmesh.rollout.trajectory import Trajectory


def trajectory_of(state: RolloutState) -> Trajectory:
    """The state's trace to grow (its trace must be inline: ``OffloadingRolloutStates`` loads it)."""
    return Trajectory.from_trace(state.token_trace())


def transcript_of(state: RolloutState) -> Transcript:
    return Transcript(
        tool_calls=[ToolCall(call.name, call.argument) for call in state.tool_calls],
        tool_outputs=[ToolOutput(call.ok, call.output) for call in state.tool_calls],
        final_text=state.final_text, finished_with_eos=state.finished_with_eos,
    )


def with_progress(state: RolloutState, *, trajectory: Trajectory, transcript: Transcript, turn: int,
                  now: float, **changes: object) -> RolloutState:
    """``state`` after ``turn`` turns: the trajectory and transcript as they are now."""
    calls = [SavedToolCall(name=call.name, argument=call.argument, ok=output.ok, output=output.text)
             for call, output in zip(transcript.tool_calls, transcript.tool_outputs)]
    return msgspec.structs.replace(
        state, turn=turn, trajectory=trajectory.trace(), trajectory_ref="",
        # A state saved before TokenTrace keeps its flat fields no longer.
        tokens=[], loss_mask=[], logprobs=[], versions=[], tool_calls=calls,
        final_text=transcript.final_text, finished_with_eos=transcript.finished_with_eos,
        updated_at=now, **changes,
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
