"""The turns of one rollout attempt: generate -> parse the turn -> run its calls -> append, until
the rollout ends.

Knows the model's ``ChatModel``, the engine seam, the tool runner, the rollout's sandbox lease
(workspace snapshots), the routed-experts store and the wire contract; not Ray, NATS, the work
queue or retries (``RolloutWorkerLogic`` in agent_loop.py owns those and hands in ``save``). Every
generated id is kept exactly as sampled; the turn is parsed from those ids; a turn without an
end-of-turn id (cut by ``max_new_tokens``) ends the rollout as "truncated", as does a tool result
that fills the model's context; a turn that calls no tool is the answer. A generation not back
within ``rollout.generate_timeout_s`` is cancelled and raises ``GenerationTimeoutError`` (an
``inference_error``, retried by the caller like any other).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import trace

from rollmesh.chat import ChatError, ChatModel
from rollmesh.config import RolloutConfig
from rollmesh.engine.protocols import GenerateOptions, InferenceEngine
from rollmesh.messages import RolloutProgressed, RolloutRequested, RolloutState, SamplingParams
from rollmesh.messages.subjects import ROLLOUT_PROGRESSED
from rollmesh.ports import MessageContext, Publisher, RoutedExpertsStore, StateStoreError
from rollmesh.rollout.environments import EnvironmentRollout, EnvStep
from rollmesh.rollout.errors import GenerationTimeoutError, RolloutError
from rollmesh.rollout.rollout_sandbox import RolloutSandbox
from rollmesh.rollout.saved_state import conversation_of, with_progress
from rollmesh.rollout.tasks import RewardInput, Task
from rollmesh.rollout.tool_runner import ToolRunner
from rollmesh.rollout.trajectory import RolloutTrajectory
from rollmesh.telemetry import conventions

_tracer = trace.get_tracer("rollmesh.rollout")


def trace_id_of(span: trace.Span) -> str:
    """The span's trace id as 32 hex digits ("" when tracing is off: an invalid context)."""
    context = span.get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else ""


@dataclass
class RolloutRun:
    """One rollout as it runs here: its request, its latest state and its open span."""

    request: RolloutRequested
    state: RolloutState
    span: trace.Span
    ctx: MessageContext


class RolloutTurns:
    """Runs a rollout's turns; built once per worker by ``RolloutWorkerLogic``."""

    def __init__(self, config: RolloutConfig, *, chat: ChatModel, engine: InferenceEngine, tools: ToolRunner,
                 leases: RolloutSandbox, publisher: Publisher, clock: Callable[[], float], max_seq_len: int,
                 routed_experts: RoutedExpertsStore | None) -> None:
        self.config = config
        self.chat = chat
        self.engine = engine
        self.tools = tools
        self.leases = leases
        self.publisher = publisher
        self.clock = clock
        self.max_seq_len = max_seq_len
        # Set for MoE models: every turn's routed-expert rows are kept for routing replay.
        self.routed_experts = routed_experts

    async def run(self, run: RolloutRun, task: Task, tools: list[dict], trajectory: RolloutTrajectory,
                  lease_id: str, save: Callable[[RolloutState], Awaitable[None]]) -> RewardInput:
        """The attempt's turns from the last saved one; ``save`` keeps the state after each turn."""
        request = run.request
        saved = conversation_of(run.state)
        if run.state.finish_reason:  # the last saved turn ended the rollout: nothing left to run
            return saved
        calls, outputs = list(saved.tool_calls), list(saved.tool_outputs)
        malformed = saved.malformed_tool_calls
        final_text, finish_reason = "", "stop"
        link = trace.Link(run.span.get_span_context())
        for turn in range(run.state.turn + 1, request.max_turns + 1):
            room = self.max_seq_len - len(trajectory)
            tool_wait_s = 0.0
            # Each turn is its own trace (hour-long rollouts would make one trace unreadable),
            # linked to the rollout's span so the whole story can be followed.
            with _tracer.start_as_current_span(
                conventions.SPAN_TURN, context=otel_context.Context(), links=[link],
                attributes={"rollout_id": request.rollout_id, "turn": turn,
                            conventions.RL_ROLLOUT_ID: request.rollout_id,
                            conventions.RL_TURN_INDEX: turn,
                            conventions.RL_SANDBOX_LEASE_ID: lease_id},
            ) as turn_span:
                # The request's sampling, told the room left in the model's context. A client's stop
                # string cuts a turn before its end-of-turn id: that turn ends the rollout, truncated.
                sampling = msgspec.structs.replace(
                    request.sampling, max_new_tokens=min(request.sampling.max_new_tokens, room))
                generation = await self._generate(request, trajectory, sampling, turn,
                                                  experts_from=run.state.routed_experts_rows)
                if generation.versions:
                    turn_span.set_attributes({
                        conventions.RL_WEIGHT_VERSION_FIRST: generation.versions[0],
                        conventions.RL_WEIGHT_VERSION_LAST: generation.versions[-1]})
                experts = await self._keep_routed_experts(run, turn, generation)
                ids = generation.token_ids
                parsed = self.chat.parse_turn(ids, tools=tools, first_call_index=len(calls) + malformed,
                                              prompt_ids=trajectory.ids)
                trajectory.add_generated(ids, generation.logprobs, generation.versions,
                                         self.chat.assistant_message(parsed))
                ran_tools = False
                if not ids or ids[-1] not in self.chat.end_of_turn_ids:
                    # Cut by max_new_tokens (or a client stop string): no more turns on a broken turn.
                    finish_reason = "truncated"
                elif isinstance(task, EnvironmentRollout):
                    # An environment answers the whole turn; it says when the episode is over.
                    tool_started = self.clock()
                    answered = await self._step_environment(task, self.chat.assistant_message(parsed), turn)
                    tool_wait_s = self.clock() - tool_started
                    if answered.messages:
                        self._append(trajectory, answered.messages, turn)
                    ran_tools = not answered.done  # another turn follows
                    if not ran_tools:
                        final_text = parsed.content
                    elif len(trajectory) >= self.max_seq_len:
                        finish_reason = "truncated"
                elif parsed.tool_calls or parsed.malformed:
                    ran_tools = True
                    tool_started = self.clock()
                    results = await self.tools.run_turn(request, task, parsed, lease_id, turn)
                    tool_wait_s = self.clock() - tool_started
                    calls += parsed.tool_calls
                    outputs += results.outputs
                    malformed += len(parsed.malformed)
                    self._append(trajectory, results.messages, turn)
                    if len(trajectory) >= self.max_seq_len:
                        finish_reason = "truncated"  # no room left for the model to answer
                else:
                    final_text = parsed.content
            ended = not ran_tools or finish_reason == "truncated" or turn == request.max_turns
            snapshot_id = run.state.snapshot_id
            if ran_tools and lease_id and self.config.snapshot_workspace:
                snapshot_id = await self.leases.snapshot(lease_id, request.rollout_id) or snapshot_id
            conversation = RewardInput(messages=trajectory.messages, tool_calls=calls, tool_outputs=outputs,
                                       final_text=final_text, finish_reason=finish_reason, malformed_tool_calls=malformed)
            run.state = with_progress(run.state, trajectory=trajectory, conversation=conversation, turn=turn,
                                      now=self.clock(), ended=ended, tool_wait_s=run.state.tool_wait_s + tool_wait_s,
                                      snapshot_id=snapshot_id, **experts)
            await save(run.state)
            await run.ctx.in_progress()
            if self.config.progress_events:
                await self.publisher.publish(ROLLOUT_PROGRESSED, RolloutProgressed(
                    rollout_id=request.rollout_id, turn=turn, num_tokens=len(trajectory),
                    weight_version=max(generation.versions, default=-1),
                    status="running" if not ended else ("truncated" if finish_reason == "truncated" else "answered"),
                    trace_id=trace_id_of(run.span),
                ))
            if ended:
                return conversation
        return conversation_of(run.state)  # max_turns was reached before this attempt

    async def _step_environment(self, environment: EnvironmentRollout, message: dict, turn: int) -> EnvStep:
        try:
            answered = await asyncio.to_thread(environment.step, message)
        except Exception as exc:  # the environment's own code failed: not the policy's doing
            raise RolloutError("internal_error", f"turn {turn}: environment {environment.name!r}: {exc!r}",
                               turns=turn) from exc
        if not answered.done and not answered.messages:
            raise RolloutError("internal_error", f"turn {turn}: environment {environment.name!r} is not done "
                               "but gave no message to answer the turn", turns=turn)
        return answered

    def _append(self, trajectory: RolloutTrajectory, messages: list[dict], turn: int) -> None:
        try:
            trajectory.append(messages)
        except ChatError as exc:  # the template refuses the conversation as it now stands
            raise RolloutError("invalid_request", f"turn {turn}: the chat template refuses the tool results: {exc}",
                               turns=turn) from exc

    async def _generate(self, request: RolloutRequested, trajectory: RolloutTrajectory,
                        sampling: SamplingParams, turn: int, *, experts_from: int):
        # One session per rollout: each turn reuses the KV of the turns before it. An MoE model
        # also reports the routing of the positions this turn forwarded that earlier turns did not.
        options = GenerateOptions(session_id=request.rollout_id,
                                  return_routed_experts=self.routed_experts is not None,
                                  routed_experts_start_len=experts_from)
        request_id = f"{request.rollout_id}/{turn}"
        # A call that never returns (its reply lost between actors, a worker wedged) must not hang
        # the rollout and its group: past the deadline it is cancelled, which cancels its tasks on
        # the workers too (the router's doing), and the turn is retried as an infrastructure failure.
        deadline = asyncio.timeout(self.config.generate_timeout_s)
        try:
            async with deadline:
                return await self.engine.generate(list(trajectory.ids), sampling, request_id=request_id,
                                                  options=options)
        except TimeoutError as exc:
            if deadline.expired():  # ours; an engine's own timeout is an engine error like the rest
                raise GenerationTimeoutError(request_id=request_id, timeout_s=self.config.generate_timeout_s,
                                             turns=turn) from exc
            raise RolloutError("inference_error", f"turn {turn}: {exc!r}", turns=turn) from exc
        except Exception as exc:  # the engine's and Ray's errors alike: a typed failure, not a crash
            raise RolloutError("inference_error", f"turn {turn}: {exc}", turns=turn) from exc

    async def _keep_routed_experts(self, run: RolloutRun, turn: int, generation) -> dict[str, object]:
        """Store the turn's routed-expert rows; the state fields that point at them."""
        rows = generation.routed_experts
        if self.routed_experts is None or rows is None:
            return {}
        try:
            ref = await self.routed_experts.save_turn(run.request.rollout_id, turn,
                                                      generation.routed_experts_start, rows)
        except StateStoreError as exc:  # without its rows the trajectory cannot be replayed
            raise RolloutError("inference_error", f"turn {turn}: routed experts not stored: {exc}",
                               turns=turn) from exc
        return {"routed_experts_ref": ref,
                "routed_experts_rows": generation.routed_experts_start + len(rows)}
