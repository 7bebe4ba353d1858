"""The rollout agent loop (``RolloutWorkerLogic``) driven directly: a scripted engine, a recording bus
with scripted sandbox replies, and a hand-built ``MessageContext``. The task, the demo model's own
tokenizer, chat template and tool-call format (``ChatModel``), and the trajectory bookkeeping are
the real ones; the engine "samples" the ids of ``chat.encode(chat.write_turn(...))``, a turn as the
model would write it, each id with a logprob and version of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from functools import cache

import msgspec
import pytest

from support.fakes import ProgressRecorder, RecordingPublisher, ScriptedEngine
from support.waiting import WAIT_S, wait_until
from rollmesh.bus.errors import RequestTimeoutError
from rollmesh.chat import ChatModel, TemplateJoin, ToolCall
from rollmesh.ports import MessageContext
from rollmesh.config import ModelConfig, RolloutConfig
from rollmesh.engine.protocols import GenerationResult
from rollmesh.messages import (
    ForkedLease,
    RolloutCompleted,
    RolloutFailed,
    RolloutRequested,
    SamplingParams,
    SandboxExecReply,
    SandboxForkReply,
    SandboxHeartbeatReply,
    SandboxLeaseReply,
    SandboxReleaseReply,
    SandboxSnapshotReply,
)
from rollmesh.messages.subjects import (
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_PROGRESSED,
    ROLLOUT_REQUESTED,
    SANDBOX_EXEC,
    SANDBOX_FORK,
    SANDBOX_HEARTBEAT,
    SANDBOX_LEASE,
    SANDBOX_RELEASE,
    SANDBOX_SNAPSHOT,
    broker_subject,
)
from rollmesh.rollout.agent_loop import RolloutWorkerLogic
from rollmesh.rollout.saved_state import InMemoryRolloutStates
from rollmesh.rollout.molar_mass import MolarMassTask, true_molar_mass
from rollmesh.rollout.tasks import TaskRegistry
from rollmesh.sandbox.broker_client import SandboxBrokerClient

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

FORMULA = "H2O"
MASS = true_molar_mass(FORMULA)  # "18.015"
LEASE = "lease-1"
NO_MISMATCHES = {"special": 0, "non_assistant": 0, "assistant": 0, "history_rewrite": 0}


@cache
def chat() -> ChatModel:
    """The session's demo model (conftest points ROLLMESH_MODEL__PATH at it before any test runs)."""
    return ChatModel.load(os.environ["ROLLMESH_MODEL__PATH"])


def prompt_ids(formula: str = FORMULA) -> list[int]:
    task = MolarMassTask()
    return chat().encode(chat().render(task.messages({"formula": formula}), tools=task.tools(),
                                       add_generation_prompt=True))


def generated(text: str, *, version: int = 3, logprob: float = -0.25) -> GenerationResult:
    """What the engine returns for a turn written as ``text``: its ids, one logprob and version each."""
    ids = chat().encode(text)
    ended = ids[-1] in chat().end_of_turn_ids
    return GenerationResult(ids, [logprob] * len(ids), [version] * len(ids), "eos" if ended else "length",
                            prompt_len=0)


def calc(formula: str = FORMULA) -> ToolCall:
    return ToolCall(id="", name="calc", arguments={"formula": formula})


def tool_call(formula: str = FORMULA, **kwargs) -> GenerationResult:
    return generated(chat().write_turn(content="", calls=[calc(formula)]), **kwargs)


def answer(text: str = MASS, **kwargs) -> GenerationResult:
    return generated(chat().write_turn(content=text), **kwargs)


def tool_results_text(*contents: str) -> str:
    """What the demo template appends after a tool-calling turn: the join, the results, the next prompt."""
    responses = "".join(f"\n<tool_response>\n{content}\n</tool_response>" for content in contents)
    return f"\n<|im_start|>user{responses}<|im_end|>\n<|im_start|>assistant\n"


def sandbox_bus(*exec_replies: SandboxExecReply | BaseException,
                lease: SandboxLeaseReply | BaseException | None = None) -> RecordingPublisher:
    return RecordingPublisher(
        replies={SANDBOX_EXEC: list(exec_replies),
                 **({SANDBOX_LEASE: [lease]} if lease is not None else {})},
        default_replies={SANDBOX_LEASE: SandboxLeaseReply(lease_id=LEASE, backend="fake"),
                         SANDBOX_EXEC: SandboxExecReply(result="exit", exit_code=0, stdout=f"{MASS}\n".encode()),
                         SANDBOX_HEARTBEAT: SandboxHeartbeatReply(expires_at=1e9),
                         SANDBOX_RELEASE: SandboxReleaseReply(released=True)},
    )


def runner(engine: ScriptedEngine, bus: RecordingPublisher, *, max_seq_len: int | None = None,
           progress_events: bool = True, states: InMemoryRolloutStates | None = None,
           chat_model: ChatModel | None = None, tasks: list | None = None, routed_experts=None,
           sandbox: SandboxBrokerClient | None = None, decode_loans=None, **config) -> RolloutWorkerLogic:
    """A runner that fails at the first infrastructure failure unless the test asks for retries."""
    config = {"infra_retries": 0, "infra_retry_delay_s": 0.0, "strict_tokenization": True, **config}
    return RolloutWorkerLogic(
        RolloutConfig(tool_timeout_s=5.0, progress_events=progress_events, **config),
        ModelConfig(path=os.environ["ROLLMESH_MODEL__PATH"]), chat=chat_model or chat(),
        tasks=TaskRegistry(tasks or [MolarMassTask()]), engine=engine, publisher=bus, clock=lambda: 100.0,
        states=states, max_seq_len=max_seq_len, routed_experts=routed_experts, sandbox=sandbox,
        decode_loans=decode_loans,
    )


def request(**overrides) -> RolloutRequested:
    fields = {"rollout_id": "r-1", "task": "molar_mass", "task_input": {"formula": FORMULA},
              "group_id": "g-1", "sampling": SamplingParams(max_new_tokens=40), "max_turns": 4}
    return RolloutRequested(**{**fields, **overrides})


def context(progress: ProgressRecorder | None = None) -> MessageContext:
    return MessageContext(subject=ROLLOUT_REQUESTED.format("test"), _progress=progress)


async def run(engine: ScriptedEngine, bus: RecordingPublisher, message: RolloutRequested | None = None,
              **runner_kwargs) -> RolloutCompleted | RolloutFailed:
    """Run one rollout; return the single result it published."""
    await runner(engine, bus, **runner_kwargs).handle_requested(message or request(), context())
    results = bus.messages(ROLLOUT_COMPLETED) + bus.messages(ROLLOUT_FAILED)
    assert len(results) == 1, results
    return results[0]


async def test_tool_call_runs_the_task_command_in_the_leased_sandbox_and_appends_the_template_rendered_result():
    engine, bus = ScriptedEngine([tool_call(), answer()]), sandbox_bus()
    result = await run(engine, bus)

    assert isinstance(result, RolloutCompleted)
    (exec_request,) = bus.requested(SANDBOX_EXEC)
    assert exec_request.lease_id == LEASE
    parsed_call = ToolCall(id="call_0", name="calc", arguments={"formula": FORMULA})
    assert exec_request.argv == MolarMassTask().tool_action(parsed_call, {"formula": FORMULA}).argv
    trace = result.token_trace()
    start = len(prompt_ids()) + len(tool_call().token_ids)
    end = len(engine.calls[1]["input_ids"])
    assert chat().decode(trace.ids[start:end]) == tool_results_text(MASS)
    assert trace.loss_mask[start:end] == [0] * (end - start)
    assert trace.versions[start:end] == [-1] * (end - start)
    assert trace.logprobs[start:end] == [0.0] * (end - start)
    # The second turn's prompt is everything so far, tool result and generation prompt included.
    assert engine.calls[1]["input_ids"] == trace.ids[:end]
    assert (result.finish_reason, result.tokenization_mismatches) == ("stop", NO_MISMATCHES)


async def test_every_generated_id_of_a_multi_turn_rollout_is_kept_as_sampled_with_its_logprob_and_version():
    turns = [tool_call("NaCl"), tool_call(), answer()]
    scripted = []
    for number, turn in enumerate(turns):  # each id its own logprob; each turn its own version
        logprobs = [-(number * 100 + i + 1) / 1000 for i in range(len(turn.token_ids))]
        scripted.append(GenerationResult(turn.token_ids, logprobs, [number + 3] * len(logprobs), "eos", 0))
    engine = ScriptedEngine(list(scripted))
    result = await run(engine, sandbox_bus())

    trace = result.token_trace()
    assert len(trace.ids) == len(trace.loss_mask) == len(trace.logprobs) == len(trace.versions)
    assert trace.ids[:result.prompt_len] == prompt_ids() and result.prompt_len == len(prompt_ids())
    at = 0
    for call_number, turn in enumerate(scripted):
        prompt = engine.calls[call_number]["input_ids"]
        assert trace.ids[:len(prompt)] == prompt, "every prompt extends the one before, never re-encoded"
        at = len(prompt)
        end = at + len(turn.token_ids)
        assert trace.ids[at:end] == turn.token_ids
        assert trace.logprobs[at:end] == turn.logprobs
        assert trace.versions[at:end] == turn.versions
        assert trace.loss_mask[at:end] == [1] * len(turn.token_ids)
    assert end == len(trace.ids)
    assert sum(trace.loss_mask) == sum(len(turn.token_ids) for turn in scripted), "only sampled ids are trained"
    assert (result.turns, result.tool_calls, result.group_id, result.reward) == (3, 2, "g-1", 1.0)
    assert result.tokenization_mismatches == NO_MISMATCHES
    assert result.text == chat().decode(trace.ids)


@pytest.mark.parametrize(("final", "argument", "reward"), [
    (MASS, FORMULA, 1.0),
    ("18.000", FORMULA, 0.0),  # wrong answer
    (f"A: {MASS}", FORMULA, 0.0),  # not exactly the mass
    (MASS, "H2O2", 0.0),  # right number, but the tool was called on another formula
])
async def test_reward_comes_from_the_task(final, argument, reward):
    result = await run(ScriptedEngine([tool_call(argument), answer(final)]), sandbox_bus())
    assert isinstance(result, RolloutCompleted)
    assert result.reward == reward


async def test_sandbox_lease_is_released_when_the_rollout_fails():
    engine = ScriptedEngine([tool_call(), RuntimeError("decode worker died")])
    bus = sandbox_bus()
    result = await run(engine, bus)

    assert isinstance(result, RolloutFailed)
    assert [release.lease_id for release in bus.requested(SANDBOX_RELEASE)] == [LEASE]


async def test_unknown_task_fails_with_unknown_task_and_takes_no_sandbox():
    bus = sandbox_bus()
    result = await run(ScriptedEngine([]), bus, request(task="no_such_task"))

    assert isinstance(result, RolloutFailed)
    assert (result.kind, result.rollout_id, result.group_id) == ("unknown_task", "r-1", "g-1")
    assert bus.requests == []


async def test_engine_exception_fails_with_inference_error_on_its_turn():
    result = await run(ScriptedEngine([tool_call(), RuntimeError("boom")]), sandbox_bus())

    assert isinstance(result, RolloutFailed)
    assert (result.kind, result.turns) == ("inference_error", 2)
    assert "boom" in result.reason


async def test_unreachable_sandbox_broker_fails_with_sandbox_error_never_a_zero_reward_completion():
    # The broker is gone for good: every exec and every probe of it times out. The client sends
    # the exec again for a restarted broker, but no longer than its reattach window (short here).
    gone = [RequestTimeoutError(subject="rl.test.sandbox.exec", timeout_s=35.0) for _ in range(200)]
    bus = sandbox_bus(*gone)
    bus.replies[SANDBOX_HEARTBEAT] = [RequestTimeoutError(subject="rl.test.sandbox.heartbeat", timeout_s=2.0)
                                      for _ in range(200)]
    client = SandboxBrokerClient(bus, exec_reattach_s=0.3, sleep=lambda _s: asyncio.sleep(0))
    result = await run(ScriptedEngine([tool_call(), answer()]), bus, sandbox=client)

    assert isinstance(result, RolloutFailed)
    assert result.kind == "sandbox_error"
    assert bus.messages(ROLLOUT_COMPLETED) == []
    assert [release.lease_id for release in bus.requested(SANDBOX_RELEASE)] == [LEASE]


async def test_unreachable_broker_at_lease_time_fails_with_sandbox_error_before_generating():
    engine = ScriptedEngine([answer()])
    unreachable = RequestTimeoutError(subject="rl.test.sandbox.lease", timeout_s=30.0)
    result = await run(engine, sandbox_bus(lease=unreachable))

    assert isinstance(result, RolloutFailed)
    assert result.kind == "sandbox_error"
    assert engine.calls == []


async def test_refused_lease_fails_with_sandbox_error():
    result = await run(ScriptedEngine([answer()]),
                       sandbox_bus(lease=SandboxLeaseReply(error_kind="invalid_request", error="no such profile")))
    assert isinstance(result, RolloutFailed)
    assert result.kind == "sandbox_error"


async def test_a_lease_refused_for_capacity_is_retried_then_fails_with_sandbox_error():
    full = SandboxLeaseReply(error_kind="capacity", error="full", retry_after_s=0.001)
    bus = sandbox_bus()
    bus.replies[SANDBOX_LEASE] = [full, full]
    assert isinstance(await run(ScriptedEngine([answer()]), bus, sandbox_capacity_retries=2), RolloutCompleted)
    bus = sandbox_bus()
    bus.replies[SANDBOX_LEASE] = [full] * 3
    result = await run(ScriptedEngine([answer()]), bus, sandbox_capacity_retries=2)
    assert isinstance(result, RolloutFailed) and result.kind == "sandbox_error" and "capacity" in result.reason


@pytest.mark.parametrize("result_kind", ["sandbox_died", "infra_error"])
async def test_a_sandbox_that_died_or_failed_under_the_tool_fails_with_sandbox_error(result_kind):
    bus = sandbox_bus(SandboxExecReply(result=result_kind, detail="agent gone"))
    result = await run(ScriptedEngine([tool_call(), answer()]), bus)
    assert isinstance(result, RolloutFailed)
    assert result.kind == "sandbox_error" and result_kind in result.reason
    assert bus.messages(ROLLOUT_COMPLETED) == []


async def test_the_lease_is_taken_with_the_rollout_id_as_token_and_heartbeated_while_the_rollout_runs():
    bus = sandbox_bus()

    class SlowEngine(ScriptedEngine):
        async def generate(self, *args, **kwargs):
            while len(bus.requested(SANDBOX_HEARTBEAT)) < 3:  # the model thinks for a while
                await asyncio.sleep(0.005)
            return await super().generate(*args, **kwargs)

    result = await run(SlowEngine([answer()]), bus, sandbox_heartbeat_s=0.01, sandbox_lease_ttl_s=0.05)
    assert isinstance(result, RolloutCompleted)
    (lease,) = bus.requested(SANDBOX_LEASE)
    assert (lease.holder, lease.ttl_s, lease.profile) == ("r-1", 0.05, "default")
    assert {beat.lease_id for beat in bus.requested(SANDBOX_HEARTBEAT)} == {LEASE}
    assert [release.lease_id for release in bus.requested(SANDBOX_RELEASE)] == [LEASE]


async def test_a_lease_lost_mid_rollout_ends_it_with_sandbox_timeout():
    bus = sandbox_bus()
    bus.replies[SANDBOX_HEARTBEAT] = [SandboxHeartbeatReply(error_kind="lease_expired", error="too late")]

    class StuckEngine(ScriptedEngine):
        async def generate(self, *args, **kwargs):
            await asyncio.Event().wait()  # never returns: only the lost lease ends the rollout

    result = await run(StuckEngine([]), bus, sandbox_heartbeat_s=0.01, sandbox_lease_ttl_s=0.05)
    assert isinstance(result, RolloutFailed) and result.kind == "sandbox_timeout"
    assert [release.lease_id for release in bus.requested(SANDBOX_RELEASE)] == [LEASE]


async def test_expired_lease_during_exec_fails_with_sandbox_timeout():
    bus = sandbox_bus(SandboxExecReply(error_kind="lease_expired", error="lease gone"))
    result = await run(ScriptedEngine([tool_call(), answer()]), bus)
    assert isinstance(result, RolloutFailed)
    assert result.kind == "sandbox_timeout"


async def test_tool_that_exits_non_zero_is_shown_to_the_model_not_a_failure():
    bus = sandbox_bus(SandboxExecReply(result="exit", exit_code=2, stderr=b"unknown element 'Xx'\n"))
    engine = ScriptedEngine([tool_call("Xx"), answer("1.000")])
    result = await run(engine, bus)

    assert isinstance(result, RolloutCompleted)
    assert chat().decode(engine.calls[1]["input_ids"]).endswith(tool_results_text("unknown element 'Xx'"))
    assert result.reward == 0.0


@pytest.mark.parametrize("reply, shown_text", [
    (SandboxExecReply(result="timeout", signal=9, stdout=b"partial"), "timed out"),
    (SandboxExecReply(result="oom", signal=9), "out of memory"),
    (SandboxExecReply(result="signal", signal=11), "killed by signal 11"),
    (SandboxExecReply(result="output_truncated", truncated=True, stdout=b"y" * 10),
     "y" * 10 + "\n[output truncated]"),
])
async def test_a_tool_timeout_oom_signal_or_cut_output_is_shown_to_the_model_not_a_failure(reply, shown_text):
    engine = ScriptedEngine([tool_call(), answer()])
    result = await run(engine, sandbox_bus(reply))

    assert isinstance(result, RolloutCompleted)
    assert chat().decode(engine.calls[1]["input_ids"]).endswith(tool_results_text(shown_text))


async def test_max_turns_bounds_the_loop():
    engine = ScriptedEngine([tool_call() for _ in range(10)])
    result = await run(engine, sandbox_bus(), request(max_turns=3))

    assert len(engine.calls) == 3
    assert isinstance(result, RolloutCompleted)
    assert (result.turns, result.tool_calls, result.reward) == (3, 3, 0.0)


async def test_a_tool_result_that_fills_the_context_ends_the_rollout_truncated_and_the_trace_at_the_context():
    max_seq_len = len(prompt_ids()) + len(tool_call().token_ids) + 5
    engine = ScriptedEngine([tool_call(), answer()])
    result = await run(engine, sandbox_bus(), max_seq_len=max_seq_len)

    assert engine.calls[0]["sampling"].max_new_tokens == min(40, max_seq_len - len(prompt_ids()))
    assert len(engine.calls) == 1  # the tool result filled the context; no room for a second turn
    assert isinstance(result, RolloutCompleted)
    assert (result.finish_reason, result.turns, result.reward) == ("truncated", 1, 0.0)
    assert len(result.token_trace().ids) == max_seq_len, "cut where the model's context ends"
    assert result.tokenization_mismatches == NO_MISMATCHES


async def test_a_turn_cut_by_max_new_tokens_ends_the_rollout_truncated_and_runs_no_tool_or_further_turn():
    engine, bus = ScriptedEngine([tool_call(), answer()]), sandbox_bus()
    cut_at = len(tool_call().token_ids) - 1  # the call is complete; its end-of-turn id is not there
    result = await run(engine, bus, request(sampling=SamplingParams(max_new_tokens=cut_at)))

    assert isinstance(result, RolloutCompleted)
    assert (result.finish_reason, result.turns, result.tool_calls, result.reward) == ("truncated", 1, 0, 0.0)
    assert len(engine.calls) == 1 and bus.requested(SANDBOX_EXEC) == []
    trace = result.token_trace()
    assert trace.ids[len(prompt_ids()):] == tool_call().token_ids[:cut_at]
    assert trace.loss_mask[len(prompt_ids()):] == [1] * cut_at


async def test_generation_keeps_the_client_stops_and_names_the_turn():
    engine = ScriptedEngine([answer()])
    await run(engine, sandbox_bus(), request(sampling=SamplingParams(max_new_tokens=40, stop=["\n\n"])))

    assert engine.calls[0]["sampling"].stop == ["\n\n"]
    assert engine.calls[0]["request_id"] == "r-1/1"


async def test_progress_event_is_published_and_delivery_kept_alive_per_turn():
    progress = ProgressRecorder()
    bus = sandbox_bus()
    engine = ScriptedEngine([tool_call(version=5), answer(version=6)])
    await runner(engine, bus).handle_requested(request(), context(progress))

    events = bus.messages(ROLLOUT_PROGRESSED)
    assert all(event.rollout_id == "r-1" for event in events)
    # The final (answer) turn is a turn too; a one-turn rollout must not go without any event.
    assert [(event.turn, event.weight_version) for event in events] == [(1, 5), (2, 6)], (
        "the turn that ends without a tool call publishes no RolloutProgressed")
    (completed,) = bus.messages(ROLLOUT_COMPLETED)
    assert events[-1].num_tokens == len(completed.token_trace().ids)
    assert progress.calls == 2, "the turn that ends without a tool call skips ctx.in_progress()"


async def test_progress_events_can_be_switched_off():
    bus = sandbox_bus()
    await run(ScriptedEngine([answer()]), bus, progress_events=False)
    assert bus.messages(ROLLOUT_PROGRESSED) == []


async def test_invalid_task_input_fails_with_invalid_request():
    result = await run(ScriptedEngine([]), sandbox_bus(), request(task_input={"formula": 7}))
    assert isinstance(result, RolloutFailed)
    assert result.kind == "invalid_request"


async def test_prompt_longer_than_the_context_fails_with_invalid_request_and_takes_no_sandbox():
    bus = sandbox_bus()
    result = await run(ScriptedEngine([]), bus, max_seq_len=len(prompt_ids()))
    assert isinstance(result, RolloutFailed)
    assert result.kind == "invalid_request"
    assert bus.requests == []


async def test_a_lost_sandbox_release_does_not_fail_the_rollout():
    bus = sandbox_bus()
    bus.replies[SANDBOX_RELEASE] = [RequestTimeoutError(subject="rl.test.sandbox.release", timeout_s=30.0)]
    result = await run(ScriptedEngine([tool_call(), answer()]), bus)
    assert isinstance(result, RolloutCompleted)
    assert result.reward == 1.0


async def test_runner_counts_completed_and_failed_rollouts():
    bus = sandbox_bus()
    logic = runner(ScriptedEngine([answer(), RuntimeError("down")]), bus)
    await logic.handle_requested(request(rollout_id="a"), context())
    await logic.handle_requested(request(rollout_id="b"), context())
    assert logic.stats() == {"completed": 1, "failed": 1, "resumed": 0, "republished": 0, "infra_retries": 0,
                             "joined": 0}


# -- surviving crashes: saved state, resume, retries, re-publishing ---------------------------


async def test_state_is_saved_after_every_turn_and_the_outcome_before_it_is_published():
    states = InMemoryRolloutStates()
    bus = sandbox_bus()
    await runner(ScriptedEngine([tool_call(), answer()]), bus, states=states).handle_requested(request(), context())

    saved = states.states["r-1"]
    (completed,) = bus.messages(ROLLOUT_COMPLETED)
    assert saved.outcome == completed, "the published outcome is the saved one"
    assert saved.turn == 2 and saved.token_trace() == completed.token_trace()
    assert [(c.call_id, c.name, c.arguments, c.output) for c in saved.tool_calls] == [
        ("call_0", "calc", {"formula": FORMULA}, MASS)]
    assert saved.messages[-2:] == [
        {"role": "tool", "tool_call_id": "call_0", "content": MASS}, {"role": "assistant", "content": MASS}]
    assert saved.finish_reason == "stop"
    assert saved.lease_id == LEASE and saved.attempts == 1
    assert states.saves == 4, "one save when it starts, one per turn, then one with the outcome"
    assert completed.idempotency_key == "r-1"


async def test_a_redelivered_request_resumes_from_the_last_saved_turn_in_the_same_sandbox():
    states = InMemoryRolloutStates()
    # The first worker runs turn 1 (a tool call), then "dies" while generating turn 2.
    first = runner(ScriptedEngine([tool_call(version=3), asyncio.CancelledError()]), sandbox_bus(), states=states)
    with pytest.raises(asyncio.CancelledError):
        await first.handle_requested(request(), context())
    after_turn_1 = states.states["r-1"]
    assert after_turn_1.turn == 1 and after_turn_1.outcome is None

    engine, bus = ScriptedEngine([answer(version=4)]), sandbox_bus()
    second = runner(engine, bus, states=states)
    await second.handle_requested(request(), context())

    (completed,) = bus.messages(ROLLOUT_COMPLETED)
    assert completed.turns == 2 and completed.tool_calls == 1 and completed.reward == 1.0
    assert bus.requested(SANDBOX_EXEC) == [], "the tool of the saved turn is not run again"
    assert len(engine.calls) == 1 and engine.calls[0]["request_id"] == "r-1/2"
    assert engine.calls[0]["input_ids"] == after_turn_1.token_trace().ids, "turn 2 continues the saved tokens exactly"
    saved = states.states["r-1"]
    assert saved.messages[:2] == [*MolarMassTask().messages({"formula": FORMULA}),
                                  {"role": "assistant", "content": "", "tool_calls": [
                                      {"id": "call_0", "type": "function",
                                       "function": {"name": "calc", "arguments": {"formula": FORMULA}}}]}]
    assert saved.messages[2:] == [{"role": "tool", "tool_call_id": "call_0", "content": MASS},
                                  {"role": "assistant", "content": MASS}]
    assert completed.tokenization_mismatches == NO_MISMATCHES, "the rebuilt trajectory renders as a whole"
    # Both versions survive: turn 1's tokens were made by version 3, turn 2's by version 4.
    assert {v for v in completed.token_trace().versions if v >= 0} == {3, 4}
    (lease,) = bus.requested(SANDBOX_LEASE)
    assert lease.holder == "r-1", "the same idempotency token: the earlier attempt's sandbox while it lives"
    assert completed.attempts == 2 and second.stats()["resumed"] == 1


async def test_every_sandbox_request_of_a_rollout_names_it_through_a_resume_in_a_forked_sandbox():
    states = InMemoryRolloutStates()
    first_bus = sandbox_bus()
    first_bus.default_replies[SANDBOX_SNAPSHOT] = SandboxSnapshotReply(snapshot_id="snap-1")

    class HeartbeatFirstEngine(ScriptedEngine):
        async def generate(self, *args, **kwargs):
            while not first_bus.requested(SANDBOX_HEARTBEAT):  # the model thinks for a beat
                await asyncio.sleep(0.005)
            return await super().generate(*args, **kwargs)

    # The first worker runs turn 1 (a tool call, then a workspace snapshot) and dies in turn 2.
    first = runner(HeartbeatFirstEngine([tool_call(), asyncio.CancelledError()]), first_bus, states=states,
                   snapshot_workspace=True, sandbox_heartbeat_s=0.01)
    with pytest.raises(asyncio.CancelledError):
        await first.handle_requested(request(), context())
    # Its sandbox is gone: the second worker gets a fresh lease, forks the snapshot, releases the fresh one.
    second_bus = sandbox_bus(lease=SandboxLeaseReply(lease_id="lease-2", backend="fake"))
    second_bus.default_replies[SANDBOX_FORK] = SandboxForkReply(
        leases=[ForkedLease(lease_id="lease-3", holder="r-1/0", expires_at=1e9)])
    await runner(ScriptedEngine([answer()]), second_bus, states=states).handle_requested(request(), context())

    assert len(second_bus.messages(ROLLOUT_COMPLETED)) == 1
    assert [r.lease_id for r in second_bus.requested(SANDBOX_RELEASE)] == ["lease-2", "lease-3"]
    sent = first_bus.requests + second_bus.requests
    assert {subject.template for subject, _ in sent} == {
        s.template for s in (SANDBOX_LEASE, SANDBOX_HEARTBEAT, SANDBOX_EXEC, SANDBOX_SNAPSHOT, SANDBOX_FORK,
                             SANDBOX_RELEASE)}
    assert {message.rollout_id for _, message in sent} == {"r-1"}


async def test_a_resumed_rollout_whose_workspace_snapshot_is_gone_fails_typed_not_with_an_empty_workspace():
    states = InMemoryRolloutStates()
    first_bus = sandbox_bus()
    first_bus.default_replies[SANDBOX_SNAPSHOT] = SandboxSnapshotReply(snapshot_id="1.snap")
    first = runner(ScriptedEngine([tool_call(), asyncio.CancelledError()]), first_bus, states=states,
                   snapshot_workspace=True)
    with pytest.raises(asyncio.CancelledError):
        await first.handle_requested(request(), context())
    # Its broker is lost with the sandbox and, this time, the snapshot is nowhere to be had.
    second_bus = sandbox_bus(lease=SandboxLeaseReply(lease_id="2.lease", backend="fake"))
    # Forked by the fresh lease's broker ("2"), not the snapshot's ("1", lost): its reply is scripted only there.
    second_bus.default_replies[broker_subject(SANDBOX_FORK, "2")] = SandboxForkReply(
        error_kind="unknown_snapshot", error="evicted")
    second_bus.default_replies[broker_subject(SANDBOX_RELEASE, "2")] = SandboxReleaseReply(released=True)
    engine = ScriptedEngine([answer()])
    result = await run(engine, second_bus, states=states)

    assert isinstance(result, RolloutFailed) and result.kind == "sandbox_error" and result.infra_failures == 1
    assert engine.calls == [], "no turn runs in a sandbox without the rollout's files"
    released = [m.lease_id for s, m in second_bus.requests if s.type is SANDBOX_RELEASE.type]
    assert released == ["2.lease"]


async def test_a_request_redelivered_after_its_outcome_was_saved_republishes_it_and_runs_nothing():
    states = InMemoryRolloutStates()
    await runner(ScriptedEngine([answer()]), sandbox_bus(), states=states).handle_requested(request(), context())
    engine, bus = ScriptedEngine([]), sandbox_bus()
    again = runner(engine, bus, states=states)
    await again.handle_requested(request(), context())

    (completed,) = bus.messages(ROLLOUT_COMPLETED)
    assert completed == states.states["r-1"].outcome
    assert engine.calls == [] and bus.requested(SANDBOX_LEASE) == []
    assert again.stats()["republished"] == 1


async def test_an_infrastructure_failure_is_retried_from_the_last_saved_turn_with_a_fresh_lease():
    states = InMemoryRolloutStates()
    engine = ScriptedEngine([tool_call(), RuntimeError("decode worker died"), answer()])
    bus = sandbox_bus()
    logic = runner(engine, bus, states=states, infra_retries=2)
    await logic.handle_requested(request(), context())

    (completed,) = bus.messages(ROLLOUT_COMPLETED)
    assert completed.infra_failures == 1 and completed.reward == 1.0
    assert len(bus.requested(SANDBOX_EXEC)) == 1, "turn 1's tool ran once"
    assert [c["request_id"] for c in engine.calls] == ["r-1/1", "r-1/2", "r-1/2"]
    assert len(bus.requested(SANDBOX_LEASE)) == 2 and len(bus.requested(SANDBOX_RELEASE)) == 2
    assert logic.stats()["infra_retries"] == 1


async def test_infrastructure_failures_past_the_budget_end_typed_and_task_failures_are_not_retried():
    engine = ScriptedEngine([RuntimeError("down")] * 3)
    bus = sandbox_bus()
    await runner(engine, bus, infra_retries=2).handle_requested(request(), context())
    (failed,) = bus.messages(ROLLOUT_FAILED)
    assert (failed.kind, failed.infra_failures, len(engine.calls)) == ("inference_error", 3, 3)
    assert failed.idempotency_key == "r-1"

    bus = sandbox_bus()
    await runner(ScriptedEngine([]), bus, infra_retries=2).handle_requested(
        request(task_input={"formula": ""}), context())
    (failed,) = bus.messages(ROLLOUT_FAILED)
    assert failed.kind == "invalid_request" and failed.infra_failures == 0


async def test_a_generation_that_never_returns_is_cancelled_at_the_deadline_and_the_turn_retried_once():
    states = InMemoryRolloutStates()
    engine = ScriptedEngine([tool_call(), ScriptedEngine.NEVER_ANSWERS, answer()])
    bus = sandbox_bus()
    logic = runner(engine, bus, states=states, infra_retries=1, generate_timeout_s=0.05)
    await logic.handle_requested(request(), context())

    (completed,) = bus.messages(ROLLOUT_COMPLETED)
    assert bus.messages(ROLLOUT_FAILED) == []
    assert completed.infra_failures == 1 and completed.reward == 1.0 and completed.turns == 2
    assert engine.cancelled == ["r-1/2"], "the lost call was cancelled, not left running"
    assert [c["request_id"] for c in engine.calls] == ["r-1/1", "r-1/2", "r-1/2"]
    assert len(bus.requested(SANDBOX_EXEC)) == 1, "turn 1's tool ran once"
    assert logic.stats()["infra_retries"] == 1
    # One sample, token for token the one an unhurried rollout makes: nothing counted twice.
    unhurried = await run(ScriptedEngine([tool_call(), answer()]), sandbox_bus())
    assert completed.trajectory == unhurried.trajectory


async def test_a_generation_past_its_deadline_with_no_retry_left_fails_typed_naming_the_timeout():
    engine = ScriptedEngine([ScriptedEngine.NEVER_ANSWERS])
    bus = sandbox_bus()
    await runner(engine, bus, infra_retries=0, generate_timeout_s=0.05).handle_requested(request(), context())

    (failed,) = bus.messages(ROLLOUT_FAILED)
    assert bus.messages(ROLLOUT_COMPLETED) == []
    assert (failed.kind, failed.infra_failures, failed.turns) == ("inference_error", 1, 1)
    assert "no generation within 0.05 s" in failed.reason and "r-1/1" in failed.reason
    assert engine.cancelled == ["r-1/1"]


async def test_a_long_tool_call_keeps_the_request_in_progress():
    beaten = asyncio.Event()

    class BeatCounter(ProgressRecorder):
        async def __call__(self) -> None:
            await super().__call__()
            if self.calls >= 3:
                beaten.set()

    class SlowBus(RecordingPublisher):
        async def request(self, subject, message, timeout_s):
            if subject == SANDBOX_EXEC:
                await beaten.wait()  # the tool runs until the keepalive has beaten three times
            return await super().request(subject, message, timeout_s)

    base = sandbox_bus()
    bus = SlowBus(replies=base.replies, default_replies=base.default_replies)
    progress = BeatCounter()
    ctx = MessageContext(subject=ROLLOUT_REQUESTED.format("test"), keepalive_every_s=0.01,
                         _progress=progress)
    await asyncio.wait_for(
        runner(ScriptedEngine([tool_call(), answer()]), bus).handle_requested(request(), ctx), WAIT_S)
    # Only the keepalive's beats could end the tool call, and the rollout then completed.
    assert beaten.is_set() and len(bus.messages(ROLLOUT_COMPLETED)) == 1


async def test_a_request_redelivered_while_it_runs_here_waits_for_it_and_runs_nothing_twice():
    gate, generating = asyncio.Event(), asyncio.Event()

    class GatedEngine(ScriptedEngine):
        async def generate(self, *args, **kwargs):
            generating.set()
            await gate.wait()
            return await super().generate(*args, **kwargs)

    engine, bus = GatedEngine([answer()]), sandbox_bus()
    logic = runner(engine, bus)
    first = asyncio.create_task(logic.handle_requested(request(), context()))
    await asyncio.wait_for(generating.wait(), WAIT_S)  # the first delivery is running the rollout
    second = asyncio.create_task(logic.handle_requested(request(), context()))
    await wait_until(lambda: logic.stats()["joined"] == 1, "the redelivery to join the running rollout")
    assert not second.done()
    gate.set()
    await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
    assert len(engine.calls) == 1 and len(bus.messages(ROLLOUT_COMPLETED)) == 1
    assert logic.stats()["joined"] == 1


async def test_an_moe_rollout_keeps_each_turns_routed_experts_and_resumes_them():
    import numpy as np

    from rollmesh.rollout.routed_experts import InMemoryRoutedExperts

    def routed(result: GenerationResult, start: int, end: int) -> GenerationResult:
        """``result`` with rows for positions [start, end), each row holding its position."""
        rows = np.arange(start, end, dtype=np.uint8).reshape(-1, 1, 1)
        return GenerationResult(result.token_ids, result.logprobs, result.versions, result.finish_reason,
                                result.prompt_len, routed_experts=rows, routed_experts_start=start)

    after_call = len(prompt_ids()) + len(tool_call().token_ids)
    after_answer = after_call + len(chat().encode(tool_results_text(MASS))) + len(answer().token_ids)
    first = routed(tool_call(), 0, after_call - 1)  # the last token is not forwarded yet
    second = routed(answer(), after_call - 1, after_answer - 1)

    states, experts = InMemoryRolloutStates(), InMemoryRoutedExperts()
    engine = ScriptedEngine([first, asyncio.CancelledError()])  # the worker dies in turn 2
    logic = runner(engine, sandbox_bus(), states=states, routed_experts=experts)
    with pytest.raises(asyncio.CancelledError):
        await logic.handle_requested(request(), context())
    options = engine.calls[0]["options"]
    assert options.return_routed_experts and options.routed_experts_start_len == 0
    assert states.states["r-1"].routed_experts_rows == after_call - 1

    engine, bus = ScriptedEngine([second]), sandbox_bus()
    resumed = runner(engine, bus, states=states, routed_experts=experts)
    await resumed.handle_requested(request(), context())
    # The resumed turn asks for the positions after those already stored.
    assert engine.calls[0]["options"].routed_experts_start_len == after_call - 1
    (completed,) = bus.messages(ROLLOUT_COMPLETED)
    rows = await experts.load(completed.routed_experts_ref)
    assert len(rows) == len(completed.token_trace().ids) - 1, "one row per position but the last"
    assert rows[:, 0, 0].tolist() == list(range(len(rows)))


# -- tool calls in the model's own format: parallel, malformed, in Python ---------------------


async def test_parallel_calls_run_concurrently_and_their_results_come_back_in_call_order():
    formulas = ["NaCl", "H2O", "CO2"]
    all_arrived, others_answered = asyncio.Event(), asyncio.Event()
    answered: list[str] = []

    class ConcurrentSandbox(RecordingPublisher):
        """Answers an exec only once every call's exec has arrived (so they must run at once), the
        first call last, each with the mass of its own formula."""

        async def request(self, subject, message, timeout_s):
            if subject == SANDBOX_EXEC:
                if len(self.requested(SANDBOX_EXEC)) == len(formulas) - 1:
                    all_arrived.set()
                self.requests.append((subject, message))
                await all_arrived.wait()
                formula = message.argv[-1]
                if formula == formulas[0]:
                    await others_answered.wait()  # the first call finishes last
                else:
                    answered.append(formula)
                    if len(answered) == len(formulas) - 1:
                        others_answered.set()
                return SandboxExecReply(result="exit", exit_code=0,
                                        stdout=true_molar_mass(formula).encode())
            return await super().request(subject, message, timeout_s)

    base = sandbox_bus()
    bus = ConcurrentSandbox(replies=base.replies, default_replies=base.default_replies)
    states = InMemoryRolloutStates()
    turn = generated(chat().write_turn(content="", calls=[calc(f) for f in formulas]))
    engine = ScriptedEngine([turn, answer()])
    result = await run(engine, bus, request(sampling=SamplingParams(max_new_tokens=len(turn.token_ids))),
                       states=states)

    assert isinstance(result, RolloutCompleted) and result.tool_calls == 3
    tool_messages = [m for m in states.states["r-1"].messages if m["role"] == "tool"]
    assert tool_messages == [{"role": "tool", "tool_call_id": f"call_{i}", "content": true_molar_mass(f)}
                             for i, f in enumerate(formulas)]
    assert chat().decode(engine.calls[1]["input_ids"]).endswith(
        tool_results_text(*(true_molar_mass(f) for f in formulas)))
    assert result.reward == 1.0 and result.tokenization_mismatches == NO_MISMATCHES


async def test_malformed_calls_become_tool_results_saying_what_was_wrong_and_are_counted():
    bad_json = '<tool_call>\n{"name": "calc", "arguments": {"formula": }\n</tool_call>'
    unknown = '<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls"}}\n</tool_call>'
    wrong_schema = '<tool_call>\n{"name": "calc", "arguments": {"formula": 7}}\n</tool_call>'
    turn = generated("\n".join([bad_json, unknown, wrong_schema]) + chat().end_of_turn_text)
    engine, bus, states = ScriptedEngine([turn, tool_call(), answer()]), sandbox_bus(), InMemoryRolloutStates()
    # Three error results overflow the demo model's 256 positions: a longer context for this test.
    result = await run(engine, bus, request(sampling=SamplingParams(max_new_tokens=len(turn.token_ids))),
                       states=states, max_seq_len=2048)

    assert isinstance(result, RolloutCompleted)
    assert (result.malformed_tool_calls, result.tool_calls, result.reward) == (3, 1, 1.0)
    assert len(bus.requested(SANDBOX_EXEC)) == 1, "only the well-formed call of turn 2 ran"
    results = [m for m in states.states["r-1"].messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == ["call_0", "call_1", "call_2", "call_3"]
    assert "(bad_json)" in results[0]["content"]
    assert "(unknown_tool)" in results[1]["content"] and "calc" in results[1]["content"]
    assert "(schema_mismatch)" in results[2]["content"]
    assert results[3]["content"] == MASS
    assert result.tokenization_mismatches["non_assistant"] == 0


async def test_a_python_tool_runs_task_code_and_its_exception_is_a_tool_result():
    from rollmesh.rollout.tasks import PythonTool

    def calculate(formula: str) -> str:
        if formula == "Xx":
            raise ValueError("unknown element 'Xx'")
        return true_molar_mass(formula)

    class PythonCalcTask(MolarMassTask):
        def tool_action(self, call, task_input):
            return PythonTool(lambda: calculate(call.arguments["formula"]))

    engine, bus, states = ScriptedEngine([tool_call("Xx"), tool_call(), answer()]), sandbox_bus(), InMemoryRolloutStates()
    result = await run(engine, bus, states=states, tasks=[PythonCalcTask()])

    assert isinstance(result, RolloutCompleted) and result.reward == 1.0
    assert bus.requested(SANDBOX_EXEC) == []
    (failed, ok) = states.states["r-1"].tool_calls
    assert (failed.ok, failed.output) == (False, "ValueError: unknown element 'Xx'")
    assert (ok.ok, ok.output) == (True, MASS)


# -- the template's word: refusals and the whole-render check ----------------------------------


async def test_a_conversation_the_template_refuses_fails_at_the_start_with_invalid_request():
    class NoContentTask(MolarMassTask):
        def messages(self, task_input):
            return [{"role": "user", "content": None}]

    bus = sandbox_bus()
    result = await run(ScriptedEngine([]), bus, tasks=[NoContentTask()])
    assert isinstance(result, RolloutFailed)
    assert result.kind == "invalid_request" and "chat template" in result.reason
    assert bus.requests == [], "refused before a sandbox is leased"


class MisjoiningChatModel(ChatModel):
    """The demo model, except that appending writes one newline too many after a tool result
    (a bug in joining that only a whole render shows)."""

    def new_trajectory(self, messages, *, tools=None, history_rewrite="keep_sampled", join=None):
        class ExtraNewline(TemplateJoin):
            def appended_text(self, new_messages, previous_assistant=None):
                return "\n" + super().appended_text(new_messages, previous_assistant)

        system = messages[0] if messages and messages[0].get("role") == "system" else None
        broken = ExtraNewline(self.directory, tools=tools, template_kwargs=self.template_kwargs,
                              family=self.family, system_message=system)
        return super().new_trajectory(messages, tools=tools, history_rewrite=history_rewrite, join=broken)


def misjoining_chat() -> ChatModel:
    real = chat()
    return MisjoiningChatModel(**{f.name: getattr(real, f.name) for f in dataclasses.fields(real)})


async def test_a_bug_class_tokenization_mismatch_fails_the_rollout_as_tokenization_error_never_retried():
    engine = ScriptedEngine([tool_call(), answer()])
    result = await run(engine, sandbox_bus(), chat_model=misjoining_chat(), infra_retries=2)

    assert isinstance(result, RolloutFailed)
    assert result.kind == "tokenization_error" and "did not generate" in result.reason
    assert (result.infra_failures, len(engine.calls)) == (0, 2), "not retried"


async def test_without_strict_tokenization_the_mismatch_is_counted_and_the_rollout_completes():
    from rollmesh.telemetry import metrics, metrics_catalog

    metrics.setup_metrics("rollout-test")  # process-wide and in memory (a no-op when already set up)

    def counted(kind: str) -> float:
        report = metrics.collect_report()
        return sum(point.value for series in report.metrics if series.name == metrics_catalog.TOKENIZATION_MISMATCHES.name
                   for point in series.points if point.labels.get("kind") == kind)

    before = counted("non_assistant")
    engine = ScriptedEngine([tool_call(), answer()])
    result = await run(engine, sandbox_bus(), chat_model=misjoining_chat(), strict_tokenization=False)

    assert isinstance(result, RolloutCompleted) and result.reward == 1.0
    assert result.tokenization_mismatches["non_assistant"] >= 1
    assert counted("non_assistant") - before == result.tokenization_mismatches["non_assistant"]


def test_history_rewrite_defaults_to_keep_sampled_and_takes_split_but_nothing_else():
    assert RolloutConfig().history_rewrite == "keep_sampled" and not RolloutConfig().strict_tokenization
    assert RolloutConfig(history_rewrite="split").history_rewrite == "split"
    with pytest.raises(msgspec.ValidationError, match="history_rewrite"):
        msgspec.convert({"history_rewrite": "rerender"}, RolloutConfig)


@pytest.mark.parametrize("strict", [True, False])
async def test_a_conversation_the_template_will_not_render_whole_fails_strict_rollouts_and_goes_unchecked_otherwise(
        monkeypatch, strict):
    from rollmesh.chat import TemplateRenderError
    from rollmesh.rollout import trajectory as trajectory_module

    def refuse(*args, **kwargs):
        raise TemplateRenderError("chat template failed: tool results must follow calls")

    monkeypatch.setattr(trajectory_module, "check_trajectory", refuse)
    result = await run(ScriptedEngine([tool_call(), answer()]), sandbox_bus(), strict_tokenization=strict)
    if strict:
        assert isinstance(result, RolloutFailed) and result.kind == "tokenization_error"
        assert "tool results must follow calls" in result.reason
    else:
        assert isinstance(result, RolloutCompleted) and result.tokenization_mismatches == {}


# --- rewards -----------------------------------------------------------------------------------

def graded_reward(sample, *, bonus: float = 0.0) -> dict[str, float]:
    """An import-path reward of the dataset task's rollouts below (``test_rollout_agent_loop:graded_reward``)."""
    return {"answered": 1.0 if sample.final_text else 0.0, "bonus": bonus}


class FlakyRewardTask(MolarMassTask):
    """Its reward is unavailable the first ``failures`` times (a reward server down), then a dict."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def reward(self, sample):
        from rollmesh.rewards.errors import RewardUnavailableError

        self.calls += 1
        if self.calls <= self.failures:
            raise RewardUnavailableError("judge", "connection refused")
        return {"correct": super().reward(sample), "format": 0.5}


async def test_a_reward_that_cannot_be_computed_fails_the_rollout_as_reward_error_never_a_zero():
    engine, bus = ScriptedEngine([tool_call(), answer()]), sandbox_bus()
    result = await run(engine, bus, tasks=[FlakyRewardTask(failures=5)], infra_retries=1)

    assert isinstance(result, RolloutFailed)
    assert result.kind == "reward_error" and "connection refused" in result.reason
    assert (result.turns, result.infra_failures) == (2, 2)
    assert len(engine.calls) == 2, "the retry scored the finished conversation again, generating nothing"


async def test_a_reward_error_is_retried_and_the_dict_rewards_components_ride_on_the_completion():
    task = FlakyRewardTask(failures=1)
    engine, bus = ScriptedEngine([tool_call(), answer()]), sandbox_bus()
    result = await run(engine, bus, tasks=[task], infra_retries=1)

    assert isinstance(result, RolloutCompleted) and result.infra_failures == 1 and task.calls == 2
    assert (result.reward, result.reward_components) == (1.5, {"correct": 1.0, "format": 0.5})
    assert len(engine.calls) == 2


def dataset_request(rewards: list[dict], answer_text: str | None = "42") -> RolloutRequested:
    row = {"question": "What is 6 times 7?", "solution": answer_text}
    return request(task="dataset", task_input={
        "messages": [{"role": "user", "content": row["question"]}], "row": row, "answer": answer_text,
        "rewards": rewards})


async def test_a_dataset_rollout_is_scored_by_its_weighted_rewards_each_logged_by_name():
    from rollmesh.rollout.dataset_task import DatasetTask

    rewards = [{"name": "exact_match", "weight": 2.0},
               {"fn": "test_rollout_agent_loop:graded_reward", "weight": 0.5, "args": {"bonus": 1.0}}]
    engine, bus = ScriptedEngine([answer("42")]), sandbox_bus()
    result = await run(engine, bus, dataset_request(rewards), tasks=[DatasetTask()],
                       reward_functions=["test_rollout_agent_loop:graded_reward"])

    assert isinstance(result, RolloutCompleted), result
    assert result.reward == 2.0 * 1.0 + 0.5 * 2.0
    assert result.reward_components == {"exact_match": 1.0, "graded_reward": 2.0,
                                        "graded_reward/answered": 1.0, "graded_reward/bonus": 1.0}
    assert ROLLOUT_COMPLETED.decode(ROLLOUT_COMPLETED.encode(result)).reward_components == result.reward_components
    # The final answer the rewards saw travels with the result (evaluation tables show it).
    assert result.final_text == "42"


@pytest.mark.parametrize(("rewards", "answer_text", "reason"), [
    ([{"fn": "test_rollout_agent_loop:graded_reward"}], "42", "rollout.reward_functions"),
    ([{"name": "exact_match"}], None, "no answer"),
    ([{"name": "exact_match", "weight": "heavy"}], "42", "task_input.rewards"),
])
async def test_a_dataset_rollout_whose_rewards_cannot_score_it_fails_as_invalid_request(rewards, answer_text, reason):
    from rollmesh.rollout.dataset_task import DatasetTask

    engine, bus = ScriptedEngine([answer("42")]), sandbox_bus()
    result = await run(engine, bus, dataset_request(rewards, answer_text), tasks=[DatasetTask()], infra_retries=2)

    assert isinstance(result, RolloutFailed) and result.kind == "invalid_request", result
    assert reason in result.reason and result.infra_failures == 0


class GreetingCoach:
    """An environment (rollmesh/rollout/environments.py): a user who asks again until greeted."""

    name = "greeting_coach"

    def __init__(self) -> None:
        self.turns: list[str] = []

    def reset(self, sample: dict) -> "EnvReset":
        from rollmesh.rollout.environments import EnvReset

        self.target = sample["word"]
        return EnvReset(messages=[{"role": "user", "content": f"Say {self.target}."}])

    def step(self, assistant_message: dict) -> "EnvStep":
        from rollmesh.rollout.environments import EnvStep

        self.turns.append(assistant_message["content"])
        if self.target in assistant_message["content"]:
            return EnvStep(messages=[], done=True, reward={"greeted": 1.0, "turns": float(len(self.turns))})
        return EnvStep(messages=[{"role": "user", "content": f"No. Say {self.target}."}], done=False)


async def test_an_environment_answers_each_turn_until_done_and_gives_the_reward():
    engine, bus = ScriptedEngine([answer("hi"), answer("hello")]), sandbox_bus()
    result = await run(engine, bus, request(task="greeting_coach", task_input={"word": "hello"}),
                       tasks=[GreetingCoach()])

    assert isinstance(result, RolloutCompleted), result
    assert (result.turns, result.final_text) == (2, "hello")
    assert result.reward_components == {"greeted": 1.0, "turns": 2.0}
    # The environment's reply is in the conversation the second turn was generated from, as the
    # template renders a user turn, and it is not trained.
    second_prompt = chat().decode(engine.calls[1]["input_ids"])
    assert "No. Say hello." in second_prompt
    assert bus.requested(SANDBOX_EXEC) == []  # no tools: nothing ran in the sandbox


async def test_a_retried_environment_rollout_replays_its_saved_turns_into_a_fresh_instance():
    engine = ScriptedEngine([answer("hi"), RuntimeError("decode worker died"), answer("hello")])
    result = await run(engine, sandbox_bus(), request(task="greeting_coach", task_input={"word": "hello"}),
                       tasks=[GreetingCoach()], infra_retries=1)

    assert isinstance(result, RolloutCompleted), result
    # The retry's instance saw the saved first turn again, then the new one: two turns, not one.
    assert result.reward_components == {"greeted": 1.0, "turns": 2.0}
    assert result.infra_failures == 1


async def test_an_episode_cut_before_its_end_scores_zero_and_max_turns_ends_it():
    engine = ScriptedEngine([answer("hi"), answer("hey")])
    result = await run(engine, sandbox_bus(), request(task="greeting_coach", task_input={"word": "hello"}, max_turns=2),
                       tasks=[GreetingCoach()])
    assert isinstance(result, RolloutCompleted) and (result.turns, result.reward) == (2, 0.0)
    failed = await run(ScriptedEngine([]), sandbox_bus(), request(task="greeting_coach", task_input={}),
                       tasks=[GreetingCoach()])
    assert isinstance(failed, RolloutFailed) and failed.kind == "invalid_request" and "reset" in failed.reason


@pytest.mark.parametrize("stray_calls", [0, 1])
async def test_a_task_without_tools_runs_without_a_sandbox_lease(stray_calls):
    """The dataset task declares no tools: no lease is taken, so none is heartbeated or
    released; a tool call the model writes anyway is answered as malformed, not run. The
    sampling temperature rides on the result, for the trainer's logprobs."""
    from rollmesh.rollout.dataset_task import DatasetTask

    turns = [tool_call()] * stray_calls + [answer("1/2")]
    bus = sandbox_bus()
    message = request(task="dataset", task_input={
        "messages": [{"role": "user", "content": "What is 1/4 + 1/4?"}], "answer": "1/2",
        "rewards": [{"name": "exact_match"}]}, sampling=SamplingParams(max_new_tokens=40, temperature=0.7))
    result = await run(ScriptedEngine(turns), bus, message, tasks=[DatasetTask()], snapshot_workspace=True)
    assert isinstance(result, RolloutCompleted), result
    assert (result.reward, result.temperature) == (1.0, 0.7)
    assert result.malformed_tool_calls == stray_calls
    assert bus.requested(SANDBOX_LEASE) == [] and bus.requested(SANDBOX_EXEC) == []
    assert bus.requested(SANDBOX_RELEASE) == []


async def test_with_decode_loans_the_worker_logic_follows_lent_decode_workers_from_start_and_events():
    """The rollout worker's one logic class also follows elastic decode for its router: the
    scheduler's status at start, then the loan events its shell delivers; no scheduler is fine."""
    from rollmesh.inference.router import InferenceRouter
    from rollmesh.messages import GpuGranted, GpuReleased
    from rollmesh.messages.subjects import GPU_GRANTED, GPU_RELEASED, ROLLOUT_REQUESTED, SCHED_STATUS
    from rollmesh.rollout.decode_loan_follower import RolloutDecodeLoanFollower

    bus = RecordingPublisher(replies={SCHED_STATUS: [RequestTimeoutError(subject="rl.test.sched.status",
                                                                         timeout_s=5.0)]})
    router = InferenceRouter([], [object()])
    logic = runner(ScriptedEngine([]), bus,
                   decode_loans=RolloutDecodeLoanFollower(router, bus, find_worker=lambda name: f"handle-{name}"))
    assert [s.subject for s in logic.subscriptions()] == [ROLLOUT_REQUESTED, GPU_GRANTED, GPU_RELEASED]
    await logic.start()  # nothing answers the status request: nothing lent, no error
    assert logic.stats()["lent_decode_workers"] == 0

    _, granted, released = logic.subscriptions()
    await granted.handler(GpuGranted(grant_id="ns-decode-elastic-0", holder="decode.elastic", role="decode",
                                     count=1, resource="GPU"), context())
    assert router.lent_decode_workers() == ["ns-decode-elastic-0"]
    assert logic.stats()["lent_decode_workers"] == 1
    await released.handler(GpuReleased(grant_id="ns-decode-elastic-0", holder="decode.elastic", count=1), context())
    assert logic.stats()["lent_decode_workers"] == 0
