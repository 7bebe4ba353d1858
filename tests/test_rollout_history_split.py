"""``rollout.history_rewrite = "split"`` through the rollout loop, and Qwen3's documented history
rewrite under strict tokenization.

The model is the tests' Qwen3-template directory (real template, locally trained tokenizer, no
weights) with thinking off: its generation prompt carries an empty ``<think></think>`` block that
the template drops from every earlier assistant turn, so a whole render after a tool result is not
an extension of the sampled tokens. The engine is scripted (``fakes.ScriptedEngine``): it "samples"
the ids of a turn as the model would write it, each id with a logprob and a version.
"""

from __future__ import annotations

import os

import pytest

from support.fakes import RecordingPublisher, ScriptedEngine
from rollmesh.chat import ChatModel, ToolCall
from rollmesh.config import ModelConfig, RolloutConfig
from rollmesh.engine.protocols import GenerationResult
from rollmesh.messages import NO_VERSION, RolloutCompleted, RolloutFailed, RolloutRequested, SamplingParams
from rollmesh.messages import SandboxExecReply, SandboxHeartbeatReply, SandboxLeaseReply, SandboxReleaseReply
from rollmesh.messages.subjects import (
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_REQUESTED,
    SANDBOX_EXEC,
    SANDBOX_HEARTBEAT,
    SANDBOX_LEASE,
    SANDBOX_RELEASE,
)
from rollmesh.ports import MessageContext
from rollmesh.rollout.agent_loop import RolloutWorkerLogic
from rollmesh.rollout.molar_mass import MolarMassTask, true_molar_mass
from rollmesh.rollout.saved_state import InMemoryRolloutStates
from rollmesh.rollout.tasks import TaskRegistry
from rollmesh.rollout.trajectory import RolloutTrajectory
from rollmesh.rollout.trajectory_offload import InMemoryTrajectories, load_traces

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

FORMULA = "H2O"
MASS = true_molar_mass(FORMULA)
THINKING_OFF = {"enable_thinking": False}
TASK = MolarMassTask()


@pytest.fixture(scope="module")
def qwen3(chat_model_dirs) -> ChatModel:
    return ChatModel.load(chat_model_dirs["qwen3"], template_kwargs=THINKING_OFF)


def turn(chat: ChatModel, text: str, *, version: int) -> GenerationResult:
    ids = chat.encode(text)
    return GenerationResult(ids, [-0.5] * len(ids), [version] * len(ids), "eos", prompt_len=0)


def tool_call(chat: ChatModel, *, version: int = 3) -> GenerationResult:
    return turn(chat, chat.write_turn(content="", calls=[ToolCall(id="", name="calc",
                                                                   arguments={"formula": FORMULA})]), version=version)


def answer(chat: ChatModel, *, version: int = 4) -> GenerationResult:
    return turn(chat, chat.write_turn(content=MASS), version=version)


def bus() -> RecordingPublisher:
    return RecordingPublisher(default_replies={
        SANDBOX_LEASE: SandboxLeaseReply(lease_id="lease-1", backend="fake"),
        SANDBOX_EXEC: SandboxExecReply(result="exit", exit_code=0, stdout=f"{MASS}\n".encode()),
        SANDBOX_HEARTBEAT: SandboxHeartbeatReply(expires_at=1e9),
        SANDBOX_RELEASE: SandboxReleaseReply(released=True)})


async def run(chat: ChatModel, engine: ScriptedEngine, *, states=None, trajectories=None,
              **config) -> tuple[RolloutCompleted | RolloutFailed, RecordingPublisher]:
    recorder = bus()
    config = {"infra_retries": 0, "infra_retry_delay_s": 0.0, "strict_tokenization": True, "tool_timeout_s": 5.0,
              **config}
    runner = RolloutWorkerLogic(RolloutConfig(**config), ModelConfig(path=os.environ["ROLLMESH_MODEL__PATH"]), chat=chat,
                           tasks=TaskRegistry([TASK]), engine=engine, publisher=recorder, clock=lambda: 100.0,
                           states=states, trajectories=trajectories, max_seq_len=4096)
    request = RolloutRequested(rollout_id="r-1", task="molar_mass", task_input={"formula": FORMULA}, group_id="g",
                               sampling=SamplingParams(max_new_tokens=200), max_turns=4)
    await runner.handle_requested(request, MessageContext(subject=ROLLOUT_REQUESTED.format("test")))
    results = recorder.messages(ROLLOUT_COMPLETED) + recorder.messages(ROLLOUT_FAILED)
    assert len(results) == 1, results
    return results[0], recorder


def test_a_split_trajectory_gives_one_token_trace_per_sample_with_its_own_masks_and_versions(qwen3):
    trajectory = RolloutTrajectory.start(qwen3, TASK.messages({"formula": FORMULA}), tools=TASK.tools(),
                                         history_rewrite="split")
    prompt = len(trajectory)
    first = tool_call(qwen3)
    trajectory.add_generated(first.token_ids, first.logprobs, first.versions,
                             qwen3.assistant_message(qwen3.parse_turn(first.token_ids, tools=TASK.tools())))
    results = [{"role": "tool", "tool_call_id": "call_0", "content": MASS}]
    new_prompt = trajectory.append(results)
    second = answer(qwen3)
    trajectory.add_generated(second.token_ids, second.logprobs, second.versions,
                             {"role": "assistant", "content": MASS})

    one, two = trajectory.traces()
    assert one.ids == trajectory.chat.samples[0].ids and len(one) == prompt + len(first.token_ids)
    assert one.loss_mask == [0] * prompt + [1] * len(first.token_ids)
    assert one.versions == [NO_VERSION] * prompt + [3] * len(first.token_ids)
    assert one.logprobs == [0.0] * prompt + [-0.5] * len(first.token_ids)
    # The second sample's prompt is the template's whole render of the conversation so far (the
    # first turn without its empty think block), forced; then the answer as sampled.
    whole = qwen3.encode(qwen3.render(trajectory.messages[:-1], tools=TASK.tools(), add_generation_prompt=True))
    assert new_prompt == whole and two.ids == whole + second.token_ids
    assert two.loss_mask == [0] * len(whole) + [1] * len(second.token_ids)
    assert two.versions == [NO_VERSION] * len(whole) + [4] * len(second.token_ids)
    assert trajectory.trace() == two and trajectory.message_counts == [2, 4]
    assert trajectory.check_tokens(frozenset(qwen3.directory.tokenizer.all_special_ids))[1] == []


async def test_a_split_rollout_completes_with_every_sample_each_generated_on_its_own_prompt(qwen3):
    engine = ScriptedEngine([tool_call(qwen3), answer(qwen3)])
    result, _ = await run(qwen3, engine, history_rewrite="split")

    assert isinstance(result, RolloutCompleted), result
    assert result.reward == 1.0 and result.num_samples == 2 and result.split_sample_refs == []
    first, second = result.token_traces()
    # Each turn was generated on the prompt of the sample it belongs to.
    assert engine.calls[0]["input_ids"] == first.ids[:result.prompt_len]
    assert engine.calls[1]["input_ids"] == second.ids[:second.loss_mask.index(1)]
    assert result.num_tokens == len(first) + len(second) and result.weight_version == 4
    # Each sample equals the template's render of the messages it covers: nothing to count.
    assert result.tokenization_mismatches == dict.fromkeys(
        ("special", "non_assistant", "assistant", "history_rewrite"), 0)


async def test_keep_sampled_counts_qwen3s_documented_rewrite_as_history_rewrite_and_strict_passes(qwen3):
    result, _ = await run(qwen3, ScriptedEngine([tool_call(qwen3), answer(qwen3)]))

    assert isinstance(result, RolloutCompleted), result
    assert result.num_samples == 1 and result.split_samples == []
    assert result.tokenization_mismatches["history_rewrite"] >= 1
    assert result.tokenization_mismatches["non_assistant"] == 0


async def test_an_undocumented_rewrite_still_fails_a_strict_rollout(qwen3):
    # The same template, but no family rules: nothing documents the dropped think block.
    unruled = ChatModel(qwen3.directory, qwen3.tool_parser, qwen3.reasoning_parser, None, qwen3.arguments_as,
                        dict(THINKING_OFF))
    result, _ = await run(unruled, ScriptedEngine([tool_call(qwen3), answer(qwen3)]))

    assert isinstance(result, RolloutFailed) and result.kind == "tokenization_error", result


async def test_a_split_rollout_resumed_after_an_infrastructure_failure_keeps_its_samples(qwen3):
    uninterrupted, _ = await run(qwen3, ScriptedEngine([tool_call(qwen3), answer(qwen3)]), history_rewrite="split")
    states = InMemoryRolloutStates()
    engine = ScriptedEngine([tool_call(qwen3), RuntimeError("decode worker died"), answer(qwen3)])
    resumed, _ = await run(qwen3, engine, states=states, history_rewrite="split", infra_retries=1)

    assert isinstance(resumed, RolloutCompleted) and resumed.infra_failures == 1, resumed
    assert resumed.token_traces() == uninterrupted.token_traces()
    assert engine.calls[2]["input_ids"] == engine.calls[1]["input_ids"], "resumed on the split sample's prompt"
    saved = states.states["r-1"]
    assert saved.sample_message_counts == [2, 4] and len(saved.token_traces()) == 2


async def test_split_samples_too_large_to_inline_go_to_the_object_store_one_object_each(qwen3):
    inline, _ = await run(qwen3, ScriptedEngine([tool_call(qwen3), answer(qwen3)]), history_rewrite="split")
    store = InMemoryTrajectories()
    stored, _ = await run(qwen3, ScriptedEngine([tool_call(qwen3), answer(qwen3)]), history_rewrite="split",
                          trajectories=store, inline_trajectory_bytes=64)

    assert isinstance(stored, RolloutCompleted), stored
    assert stored.trajectory is None and stored.split_samples == [] and stored.num_samples == 2
    assert [stored.trajectory_ref, *stored.split_sample_refs] == ["memory/r-1/completed",
                                                                  "memory/r-1/completed-sample-1"]
    assert await load_traces(stored, store) == inline.token_traces()


@pytest.mark.parametrize("reasoning", [None, "I need calc."])
async def test_keep_sampled_with_thinking_on_passes_strict_whatever_the_model_reasons(chat_model_dirs, reasoning):
    thinking = ChatModel.load(chat_model_dirs["qwen3"], template_kwargs={"enable_thinking": True})
    call = ToolCall(id="", name="calc", arguments={"formula": FORMULA})
    turns = [turn(thinking, thinking.write_turn(content="", calls=[call], reasoning=reasoning), version=3),
             turn(thinking, thinking.write_turn(content=MASS, reasoning=reasoning), version=4)]
    result, _ = await run(thinking, ScriptedEngine(turns))

    assert isinstance(result, RolloutCompleted) and result.reward == 1.0, result
    assert result.tokenization_mismatches["non_assistant"] == 0
