"""The agent loop of one rollout: generate -> parse tool call -> sandbox exec -> append -> ... -> reward.

Knows the task plugins, the inference, publisher and state-store seams and the wire contract; not
Ray, not nats-py (they arrive as injected collaborators). Tracing: the rollout has one span; every
turn is its own trace whose root span links back to the rollout span.

Surviving crashes. After every turn the rollout's state (tokens, mask, logprobs, versions, the
transcript, its lease and workspace snapshot) is saved to the state store, then the work queue is
told the request is still in progress; a keepalive repeats that every ``work_heartbeat_s`` while a
long tool call runs. A worker that dies stops both: the request is redelivered after the ack wait,
and whoever takes it resumes from the last saved turn. The outcome is saved before it is
published, so a request redelivered after its rollout ended (a worker that died between publishing
and acking) re-publishes that outcome and runs nothing again.

Infrastructure failures (sandbox died or lost, broker unreachable, inference error) are retried
from the last saved turn up to ``infra_retries`` times; then the rollout ends as a typed
``RolloutFailed``, never a silent zero reward.

Sandbox: one lease per rollout, its idempotency token the rollout id (a resumed rollout gets the
sandbox its earlier attempt had, while that lease lives; if it is gone and snapshots are on, a
fork of the last snapshot). While the rollout runs, a heartbeat keeps the lease alive however long
it takes; a worker that dies stops heartbeating and the broker reaps the sandbox within a TTL. A
tool's own failure (non-zero exit, timeout, oom, signal, output cut) is a tool result the model
sees.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace

from rollmesh.ports import (
    MessageContext,
    Publisher,
    RolloutStateStore,
    RoutedExpertsStore,
    StateStoreError,
    Subscription,
    TrajectoryStore,
)
from rollmesh.config import ModelConfig, RolloutConfig
from rollmesh.engine.protocols import GenerateOptions, InferenceEngine
from rollmesh.engine.tokenizer import ByteTokenizer
from rollmesh.messages import (
    INFRA_FAILURE_KINDS,
    RolloutCompleted,
    RolloutFailed,
    RolloutProgressed,
    RolloutRequested,
    RolloutState,
    SamplingParams,
    TokenTrace,
)
from rollmesh.messages.subjects import (
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_PROGRESSED,
    ROLLOUT_REQUESTED,
)
from rollmesh.rollout.errors import RolloutError
from rollmesh.rollout.rollout_sandbox import RolloutSandbox
from rollmesh.rollout.rollout_state import InMemoryRolloutStates, trajectory_of, transcript_of, with_progress
from rollmesh.rollout.tasks import Task, TaskInputError, TaskRegistry, ToolOutput, Transcript, UnknownTaskError
from rollmesh.rollout.tool_results import failure_kind, tool_text
from rollmesh.rollout.tool_syntax import format_tool_output, parse_tool_call, stop_strings
from rollmesh.rollout.trajectory import Trajectory
from rollmesh.rollout.trajectory_offload import COMPLETED_OBJECT, OffloadingRolloutStates, place_trace
from rollmesh.sandbox.broker_client import SandboxBrokerClient
from rollmesh.sandbox.errors import SandboxRequestError
from rollmesh.telemetry import conventions, metrics, metrics_catalog

_log = structlog.get_logger("rollmesh.rollout")
_tracer = trace.get_tracer("rollmesh.rollout")
MAX_RETRY_DELAY_S = 30.0


def _trace_id(span: trace.Span) -> str:
    """The span's trace id as 32 hex digits ("" when tracing is off: an invalid context)."""
    context = span.get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else ""


@dataclass
class _Run:
    """One rollout as it runs here: its request, its latest state and its open span."""

    request: RolloutRequested
    state: RolloutState
    span: trace.Span
    ctx: MessageContext


class RolloutRunner:
    """Plain logic of a rollout worker; the shell feeds it ``RolloutRequested`` messages."""

    def __init__(
        self,
        config: RolloutConfig,
        model_config: ModelConfig,
        *,
        tasks: TaskRegistry,
        engine: InferenceEngine,
        publisher: Publisher,
        worker: str = "rollout-worker",
        clock: Callable[[], float] = time.time,
        sandbox: SandboxBrokerClient | None = None,
        states: RolloutStateStore | None = None,
        routed_experts: RoutedExpertsStore | None = None,
        trajectories: TrajectoryStore | None = None,
    ) -> None:
        self.config = config
        self.max_seq_len = model_config.max_seq_len
        self.tokenizer = ByteTokenizer(model_config.vocab_size)
        self.tasks = tasks
        self.engine = engine
        self.publisher = publisher
        self.sandbox = sandbox or SandboxBrokerClient(publisher)
        self.leases = RolloutSandbox(self.sandbox, config)
        self.states: RolloutStateStore = states if states is not None else InMemoryRolloutStates()
        # Where a trace too large to travel inline (rollout.inline_trajectory_bytes) is stored,
        # for the completed message and the saved state alike; None: always inline.
        self.trajectories = trajectories
        if trajectories is not None:
            self.states = OffloadingRolloutStates(self.states, trajectories,
                                                  inline_bytes=config.inline_trajectory_bytes)
        # Set for MoE models: every turn's routed-expert rows are kept for routing replay.
        self.routed_experts = routed_experts
        self.worker = worker
        self.clock = clock
        self.counts = {"completed": 0, "failed": 0, "resumed": 0, "republished": 0, "infra_retries": 0,
                       "joined": 0}
        self._running: dict[str, asyncio.Future[None]] = {}
        metrics.observe(metrics_catalog.ROLLOUTS_IN_FLIGHT, self,
                        lambda runner: [(len(runner._running), {"worker": runner.worker})])

    def subscriptions(self) -> list[Subscription]:
        return [
            Subscription(
                ROLLOUT_REQUESTED,
                self.handle_requested,
                "jetstream",
                max_concurrent=self.config.max_concurrent,
            )
        ]

    def stats(self) -> dict[str, int]:
        return dict(self.counts)

    async def handle_requested(self, request: RolloutRequested, ctx: MessageContext) -> None:
        """Run (or resume) the rollout; returns only after its outcome is durably published (then
        the shell acks)."""
        running = self._running.get(request.rollout_id)
        if running is not None:
            # Redelivered while it still runs here (the server lost its in-progress acks, e.g. in
            # a NATS restart): the running one publishes the outcome; this delivery waits for it.
            self.counts["joined"] += 1
            await self._join(running, ctx)
            return
        done = asyncio.get_running_loop().create_future()
        self._running[request.rollout_id] = done
        try:
            await self._handle(request, ctx)
        except BaseException as exc:
            done.set_exception(RuntimeError(f"rollout {request.rollout_id} did not finish: {exc!r}"))
            done.exception()  # read here: with no delivery waiting on it, it is nobody's error
            raise
        else:
            done.set_result(None)
        finally:
            self._running.pop(request.rollout_id, None)

    async def _join(self, running: asyncio.Future[None], ctx: MessageContext) -> None:
        while not running.done():
            await asyncio.wait({running}, timeout=self.config.work_heartbeat_s)
            if not running.done():
                await ctx.in_progress()
        running.result()  # it failed: this delivery is nak'ed and comes back

    async def _handle(self, request: RolloutRequested, ctx: MessageContext) -> None:
        saved = await self._load(request)
        if saved is not None and saved.outcome is not None:
            # It ended, but the request was never acked: publish the same outcome again (dedup
            # ids and the trainer's idempotency keys make the repeat harmless), redo nothing.
            self.counts["republished"] += 1
            await self._publish(saved.outcome)
            return
        now = self.clock()
        state = saved or RolloutState(rollout_id=request.rollout_id, request=request, started_at=now)
        if saved is not None:
            self.counts["resumed"] += 1
            _log.info("rollout_resumed", rollout_id=request.rollout_id, turn=saved.turn,
                      attempt=saved.attempts + 1)
        state = msgspec.structs.replace(state, attempts=state.attempts + 1, updated_at=now)
        # Saved at once: a worker that takes this request over sees it was started before.
        await self._save(state)
        with _tracer.start_as_current_span(
            conventions.SPAN_ROLLOUT,
            attributes={"rollout_id": request.rollout_id, "task": request.task,
                        "purpose": request.purpose, "rollout.attempt": state.attempts,
                        "rollout.resumed_turn": state.turn,
                        conventions.RL_ROLLOUT_ID: request.rollout_id,
                        # The trajectory a rollout produces is known by the rollout's id.
                        conventions.RL_TRAJECTORY_ID: request.rollout_id,
                        conventions.RL_TASK: request.task},
        ) as rollout_span:
            run = _Run(request, state, rollout_span, ctx)
            keepalive = asyncio.create_task(self._keep_in_progress(ctx), name=f"keepalive-{request.rollout_id}")
            try:
                outcome = await self._run_with_retries(run)
            finally:
                keepalive.cancel()
                await asyncio.gather(keepalive, return_exceptions=True)
            # The outcome names this attempt's trace, so a dashboard can link the rollout to it.
            outcome = msgspec.structs.replace(outcome, trace_id=_trace_id(rollout_span))
            if isinstance(outcome, RolloutCompleted):
                rollout_span.set_attribute("rollout.reward", outcome.reward)
            else:
                rollout_span.set_attribute("rollout.failure", outcome.kind)
                _log.warning("rollout_failed", rollout_id=request.rollout_id, kind=outcome.kind,
                             reason=outcome.reason, infra_failures=outcome.infra_failures)
        # Saved before it is published: a redelivery finds it and does not run the rollout again.
        await self._save(msgspec.structs.replace(run.state, outcome=outcome, updated_at=self.clock()))
        await self._publish(outcome)

    async def _publish(self, outcome: RolloutCompleted | RolloutFailed) -> None:
        if isinstance(outcome, RolloutCompleted):
            await self.publisher.publish(ROLLOUT_COMPLETED, outcome)
            self.counts["completed"] += 1
            metrics.add(metrics_catalog.ROLLOUTS_COMPLETED, 1)
        else:
            await self.publisher.publish(ROLLOUT_FAILED, outcome)
            self.counts["failed"] += 1
            metrics.add(metrics_catalog.ROLLOUTS_FAILED, 1, {"kind": outcome.kind})

    async def _run_with_retries(self, run: _Run) -> RolloutCompleted | RolloutFailed:
        request = run.request
        while True:
            try:
                return await self._attempt(run)
            except RolloutError as exc:
                infra = exc.kind in INFRA_FAILURE_KINDS
                if infra:
                    run.state = msgspec.structs.replace(run.state, infra_failures=run.state.infra_failures + 1)
                    await self._save(run.state)
                if not infra or run.state.infra_failures > self.config.infra_retries:
                    return RolloutFailed(
                        rollout_id=request.rollout_id, kind=exc.kind, reason=str(exc),
                        group_id=request.group_id, purpose=request.purpose,
                        turns=max(exc.turns, run.state.turn), idempotency_key=request.rollout_id,
                        attempts=run.state.attempts, infra_failures=run.state.infra_failures,
                    )
                self.counts["infra_retries"] += 1
                _log.warning("rollout_infra_retry", rollout_id=request.rollout_id, kind=exc.kind,
                             reason=str(exc), failures=run.state.infra_failures,
                             resume_turn=run.state.turn)
                # Backing off (doubling) gives a restarted actor or NATS time to come back.
                await asyncio.sleep(min(MAX_RETRY_DELAY_S, self.config.infra_retry_delay_s
                                        * 2 ** (run.state.infra_failures - 1)))

    async def _attempt(self, run: _Run) -> RolloutCompleted:
        request = run.request
        task = self._task(request)
        if not len(run.state.token_trace()):
            run.state = self._started(run.state, task)
        trajectory = trajectory_of(run.state)
        saved = run.state
        lease_id = await self.leases.lease(request.rollout_id, held=saved.lease_id,
                                           snapshot_id=saved.snapshot_id, turn=saved.turn)
        run.state = msgspec.structs.replace(run.state, lease_id=lease_id)
        try:
            transcript = await self.leases.while_leased(lease_id, request.rollout_id,
                                                        self._turns(run, task, trajectory, lease_id))
        finally:
            await self.leases.release(lease_id, request.rollout_id)
        reward = task.reward(request.task_input, transcript)
        token_trace = trajectory.trace()
        # A long trace goes to the object store here, before the message naming it is published.
        try:
            carried = await place_trace(request.rollout_id, COMPLETED_OBJECT, token_trace,
                                        inline_bytes=self.config.inline_trajectory_bytes, store=self.trajectories)
        except StateStoreError as exc:
            raise RolloutError("internal_error", f"trajectory not stored: {exc}", turns=run.state.turn) from exc
        return RolloutCompleted(
            rollout_id=request.rollout_id, task=request.task, group_id=request.group_id,
            purpose=request.purpose, reward=reward, turns=run.state.turn,
            tool_calls=len(transcript.tool_calls), prompt_len=run.state.prompt_len,
            # The text of a stored trace is left out too (it is as long): decode its ids.
            text=self.tokenizer.decode(token_trace.ids) if carried["trajectory"] is not None else "",
            duration_s=self.clock() - run.state.started_at, idempotency_key=request.rollout_id,
            routed_experts_ref=run.state.routed_experts_ref,
            attempts=run.state.attempts, infra_failures=run.state.infra_failures,
            num_tokens=len(token_trace), weight_version=token_trace.last_version(),
            **carried,  # type: ignore[arg-type]
        )

    def _started(self, state: RolloutState, task: Task) -> RolloutState:
        """The state of a rollout about to run its first turn: the prompt, forced."""
        request = state.request
        try:
            prompt = task.build_prompt(request.task_input)
        except TaskInputError as exc:
            raise RolloutError("invalid_request", str(exc)) from exc
        prompt_ids = self.tokenizer.encode(prompt, bos=True)
        if len(prompt_ids) >= self.max_seq_len:
            raise RolloutError("invalid_request", f"prompt of {len(prompt_ids)} tokens does not fit "
                               f"the model's context of {self.max_seq_len}")
        return msgspec.structs.replace(state, trajectory=TokenTrace.forced(prompt_ids), prompt_len=len(prompt_ids))

    async def _turns(self, run: _Run, task: Task, trajectory: Trajectory, lease_id: str) -> Transcript:
        request = run.request
        transcript = transcript_of(run.state)
        calls, outputs = list(transcript.tool_calls), list(transcript.tool_outputs)
        final_text, finished_with_eos = transcript.final_text, transcript.finished_with_eos
        if len(calls) < run.state.turn:  # the last saved turn was the answer: nothing left to run
            return transcript
        stops = sorted({*request.sampling.stop, *stop_strings(task.tools)})
        link = trace.Link(run.span.get_span_context())
        for turn in range(run.state.turn + 1, request.max_turns + 1):
            room = self.max_seq_len - len(trajectory)
            if room <= 0:
                break
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
                sampling = SamplingParams(
                    temperature=request.sampling.temperature, top_p=request.sampling.top_p,
                    max_new_tokens=min(request.sampling.max_new_tokens, room), stop=stops,
                )
                generation = await self._generate(request, trajectory, sampling, turn,
                                                  experts_from=run.state.routed_experts_rows)
                if generation.versions:
                    turn_span.set_attributes({
                        conventions.RL_WEIGHT_VERSION_FIRST: generation.versions[0],
                        conventions.RL_WEIGHT_VERSION_LAST: generation.versions[-1]})
                experts = await self._keep_routed_experts(run, turn, generation)
                trajectory.append_generated(generation.token_ids, generation.logprobs, generation.versions)
                text = self.tokenizer.decode(generation.token_ids)
                call = parse_tool_call(text, task.tools)
                if call is None:
                    final_text = text
                    finished_with_eos = generation.finish_reason == "eos"
                else:
                    calls.append(call)
                    tool_started = self.clock()
                    output = await self._run_tool(request, task, call, lease_id, turn)
                    tool_wait_s = self.clock() - tool_started
                    outputs.append(output)
                    room = max(0, self.max_seq_len - len(trajectory))
                    trajectory.append_forced(self.tokenizer.encode(format_tool_output(output.text))[:room])
            snapshot_id = run.state.snapshot_id
            if call is not None and self.config.snapshot_workspace:
                snapshot_id = await self.leases.snapshot(lease_id, request.rollout_id) or snapshot_id
            transcript = Transcript(calls, outputs, final_text, finished_with_eos)
            run.state = with_progress(run.state, trajectory=trajectory, transcript=transcript, turn=turn,
                                      now=self.clock(), tool_wait_s=run.state.tool_wait_s + tool_wait_s,
                                      snapshot_id=snapshot_id, **experts)
            await self._save(run.state)
            await run.ctx.in_progress()
            if self.config.progress_events:
                await self.publisher.publish(ROLLOUT_PROGRESSED, RolloutProgressed(
                    rollout_id=request.rollout_id, turn=turn, num_tokens=len(trajectory),
                    weight_version=max(generation.versions, default=-1),
                    status="running" if call is not None else "answered",
                    trace_id=_trace_id(run.span),
                ))
            if call is None:
                break
        return Transcript(calls, outputs, final_text, finished_with_eos)

    # -- state and the work queue -----------------------------------------------------------

    async def _load(self, request: RolloutRequested) -> RolloutState | None:
        try:
            saved = await self.states.load(request.rollout_id)
        except StateStoreError as exc:
            _log.warning("rollout_state_unreadable", rollout_id=request.rollout_id, error=str(exc))
            return None
        if saved is not None and saved.request != request:
            # The same id for a different request: the new request wins; its old state is void.
            _log.warning("rollout_state_mismatch", rollout_id=request.rollout_id)
            return None
        return saved

    async def _save(self, state: RolloutState) -> None:
        try:
            await self.states.save(state)
        except StateStoreError as exc:  # the rollout still runs; only resuming it would be lost
            _log.warning("rollout_state_not_saved", rollout_id=state.rollout_id, error=str(exc))

    async def _keep_in_progress(self, ctx: MessageContext) -> None:
        """Keep the request's delivery alive between turns (a tool may run for an hour)."""
        while True:
            await asyncio.sleep(self.config.work_heartbeat_s)
            try:
                await ctx.in_progress()
            except Exception as exc:  # NATS away for a moment: the next beat tries again
                _log.warning("work_heartbeat_failed", error=repr(exc))

    def _task(self, request: RolloutRequested) -> Task:
        try:
            return self.tasks.get(request.task)
        except UnknownTaskError as exc:
            raise RolloutError("unknown_task", str(exc)) from exc

    async def _generate(self, request: RolloutRequested, trajectory: Trajectory,
                        sampling: SamplingParams, turn: int, *, experts_from: int):
        # One session per rollout: each turn reuses the KV of the turns before it. An MoE model
        # also reports the routing of the positions this turn forwarded that earlier turns did not.
        options = GenerateOptions(session_id=request.rollout_id,
                                  return_routed_experts=self.routed_experts is not None,
                                  routed_experts_start_len=experts_from)
        try:
            return await self.engine.generate(
                list(trajectory.ids), sampling, request_id=f"{request.rollout_id}/{turn}", options=options)
        except Exception as exc:  # the engine's and Ray's errors alike: a typed failure, not a crash
            raise RolloutError("inference_error", f"turn {turn}: {exc}", turns=turn) from exc

    async def _keep_routed_experts(self, run: _Run, turn: int, generation) -> dict[str, object]:
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

    async def _run_tool(self, request: RolloutRequested, task: Task, call, lease_id: str,
                        turn: int) -> ToolOutput:
        with _tracer.start_as_current_span(conventions.SPAN_TOOL, attributes={
                "tool": call.name, "rollout_id": request.rollout_id,
                conventions.RL_TOOL_NAME: call.name, conventions.RL_ROLLOUT_ID: request.rollout_id,
                conventions.RL_TURN_INDEX: turn, conventions.RL_SANDBOX_LEASE_ID: lease_id}):
            try:
                reply = await self.sandbox.exec(
                    lease_id, task.tool_argv(call, request.task_input), timeout_s=self.config.tool_timeout_s,
                    capacity_retries=self.config.sandbox_capacity_retries, rollout_id=request.rollout_id)
            except SandboxRequestError as exc:
                raise RolloutError(failure_kind(exc), f"turn {turn}: {exc}", turns=turn) from exc
        if reply.result in ("sandbox_died", "infra_error"):
            raise RolloutError("sandbox_error", f"turn {turn}: sandbox {reply.result}: {reply.detail}",
                               turns=turn)
        # The tool's own failures are the model's business: it sees them and may try again.
        return ToolOutput(ok=reply.result == "exit" and reply.exit_code == 0, text=tool_text(reply)[:200])
