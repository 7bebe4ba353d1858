"""The rollout loop with a trajectory store (``RolloutWorkerLogic(trajectories=...)``): a trace past
``rollout.inline_trajectory_bytes`` is stored before its RolloutCompleted is published, the
saved state keeps it by reference, and a worker taking the rollout over resumes from it. The
scripted engine and recording bus are those of test_rollout_agent_loop."""

from __future__ import annotations

import asyncio
import os

import pytest

from support.fakes import RecordingPublisher, ScriptedEngine
from rollmesh.config import ModelConfig, RolloutConfig
from rollmesh.messages.subjects import ROLLOUT_COMPLETED
from rollmesh.rollout.agent_loop import RolloutWorkerLogic
from rollmesh.rollout.molar_mass import MolarMassTask
from rollmesh.rollout.saved_state import InMemoryRolloutStates
from rollmesh.rollout.tasks import TaskRegistry
from rollmesh.rollout.trajectory_offload import InMemoryTrajectories, trace_bytes
from test_rollout_agent_loop import answer, chat, context, request, sandbox_bus, tool_call

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class PublishWatcher(RecordingPublisher):
    """Records, for each published RolloutCompleted, what the store held at that moment."""

    def __init__(self, store: InMemoryTrajectories, **kwargs) -> None:
        super().__init__(**kwargs)
        self.store = store
        self.stored_when_published: list[set[str]] = []

    async def publish(self, subject, message) -> None:
        if subject == ROLLOUT_COMPLETED:
            self.stored_when_published.append(set(self.store.traces))
        await super().publish(subject, message)


def runner(engine: ScriptedEngine, bus: RecordingPublisher, states: InMemoryRolloutStates,
           store: InMemoryTrajectories, *, inline_bytes: int) -> RolloutWorkerLogic:
    return RolloutWorkerLogic(
        RolloutConfig(tool_timeout_s=5.0, infra_retries=0, inline_trajectory_bytes=inline_bytes,
                      strict_tokenization=True),
        ModelConfig(path=os.environ["ROLLMESH_MODEL__PATH"]), chat=chat(), tasks=TaskRegistry([MolarMassTask()]),
        engine=engine, publisher=bus, clock=lambda: 100.0, states=states, trajectories=store)


async def test_a_long_rollouts_trace_is_stored_before_its_completion_is_published_and_state_keeps_a_reference():
    store, states = InMemoryTrajectories(), InMemoryRolloutStates()
    bus = PublishWatcher(store, replies=sandbox_bus().replies, default_replies=sandbox_bus().default_replies)
    await runner(ScriptedEngine([tool_call(), answer()]), bus, states, store, inline_bytes=64).handle_requested(
        request(), context())

    (completed,) = bus.messages(ROLLOUT_COMPLETED)
    assert completed.trajectory is None and completed.trajectory_ref == "memory/r-1/completed"
    assert bus.stored_when_published == [{completed.trajectory_ref, "memory/r-1/state-turn-2"}]
    trace = store.traces[completed.trajectory_ref]
    assert trace_bytes(trace) > 64 and completed.num_tokens == len(trace)
    assert completed.weight_version == 3 and completed.text == ""
    saved = states.states["r-1"]
    assert saved.trajectory is None and store.traces[saved.trajectory_ref] == trace
    assert "memory/r-1/state-turn-1" not in store.traces, "a superseded turn's blob is deleted"


async def test_a_short_rollouts_trace_travels_inline():
    store, states, bus = InMemoryTrajectories(), InMemoryRolloutStates(), sandbox_bus()
    await runner(ScriptedEngine([tool_call(), answer()]), bus, states, store,
                 inline_bytes=RolloutConfig().inline_trajectory_bytes).handle_requested(request(), context())
    (completed,) = bus.messages(ROLLOUT_COMPLETED)
    assert completed.trajectory_ref == "" and len(completed.token_trace()) == completed.num_tokens
    assert store.traces == {}


async def test_a_worker_taking_over_a_long_rollout_resumes_from_its_stored_trace():
    store, states = InMemoryTrajectories(), InMemoryRolloutStates()
    first = runner(ScriptedEngine([tool_call(version=3), asyncio.CancelledError()]), sandbox_bus(), states, store,
                   inline_bytes=64)
    with pytest.raises(asyncio.CancelledError):
        await first.handle_requested(request(), context())
    stored_turn_1 = store.traces[states.states["r-1"].trajectory_ref]

    engine, bus = ScriptedEngine([answer(version=4)]), sandbox_bus()
    await runner(engine, bus, states, store, inline_bytes=64).handle_requested(request(), context())
    assert engine.calls[0]["input_ids"] == stored_turn_1.ids, "turn 2 continues the stored trace"
    (completed,) = bus.messages(ROLLOUT_COMPLETED)
    assert set(store.traces[completed.trajectory_ref].generated_versions()) == {3, 4}
