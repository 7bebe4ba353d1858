"""The agent loop of one rollout: generate -> parse tool call -> sandbox exec -> append -> ... -> reward.

Knows the task plugins, the inference and publisher seams and the wire contract; not Ray, not
nats-py (both arrive as injected collaborators). Infrastructure failures (sandbox broker, inference)
end the rollout with a typed ``RolloutFailed``, never a silent zero reward. Tracing: the rollout
has one span; every turn is its own trace whose root span links back to the rollout span.

Sandbox: one lease per rollout, its idempotency token the rollout id (a redelivered rollout gets
the sandbox its first attempt had, while that lease lives). While the rollout runs, a heartbeat
keeps the lease alive however long it takes; a worker that dies stops heartbeating and the broker
reaps the sandbox within a TTL. A tool's own failure (non-zero exit, timeout, oom, signal, output
cut) is a tool result the model sees; a sandbox that died, a runtime error, an unreachable broker
or capacity refused after retries fail the rollout as "sandbox_error" (a lost lease:
"sandbox_timeout").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace

from rollmesh.ports import MessageContext, Publisher, Subscription
from rollmesh.config import ModelConfig, RolloutConfig
from rollmesh.engine.protocols import GenerateOptions, InferenceEngine
from rollmesh.engine.tokenizer import ByteTokenizer
from rollmesh.messages import (
    RolloutCompleted,
    RolloutFailed,
    RolloutProgressed,
    RolloutRequested,
    SamplingParams,
    SandboxExecReply,
)
from rollmesh.messages.rollout import FailureKind
from rollmesh.messages.subjects import (
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_PROGRESSED,
    ROLLOUT_REQUESTED,
)
from rollmesh.rollout.errors import RolloutError
from rollmesh.rollout.tasks import Task, TaskInputError, TaskRegistry, ToolOutput, Transcript, UnknownTaskError
from rollmesh.rollout.tool_syntax import format_tool_output, parse_tool_call, stop_strings
from rollmesh.rollout.trajectory import Trajectory
from rollmesh.sandbox.broker_client import SandboxBrokerClient
from rollmesh.sandbox.errors import SandboxRequestError

_log = structlog.get_logger("rollmesh.rollout")
_tracer = trace.get_tracer("rollmesh.rollout")
T = TypeVar("T")
# What the model is shown when a tool ended without an exit code of its own.
_ENDINGS = {"timeout": "timed out", "oom": "out of memory"}
# Follows what was kept of an output that passed its cap, so the model knows it saw a part.
TRUNCATION_MARKER = "[output truncated]"


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
    ) -> None:
        self.config = config
        self.max_seq_len = model_config.max_seq_len
        self.tokenizer = ByteTokenizer(model_config.vocab_size)
        self.tasks = tasks
        self.engine = engine
        self.publisher = publisher
        self.sandbox = sandbox or SandboxBrokerClient(publisher)
        self.worker = worker
        self.clock = clock
        self.completed = 0
        self.failed = 0

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
        return {"completed": self.completed, "failed": self.failed}

    async def handle_requested(self, request: RolloutRequested, ctx: MessageContext) -> None:
        """Run the rollout; returns only after its result is durably published (then the shell acks)."""
        started = self.clock()
        with _tracer.start_as_current_span(
            "rollout", attributes={"rollout_id": request.rollout_id, "task": request.task,
                                   "purpose": request.purpose},
        ) as rollout_span:
            try:
                result = await self._run(request, ctx, rollout_span, started)
            except RolloutError as exc:
                rollout_span.set_attribute("rollout.failure", exc.kind)
                result = RolloutFailed(
                    rollout_id=request.rollout_id, kind=exc.kind, reason=str(exc),
                    group_id=request.group_id, purpose=request.purpose, turns=exc.turns,
                )
            if isinstance(result, RolloutCompleted):
                rollout_span.set_attribute("rollout.reward", result.reward)
                await self.publisher.publish(ROLLOUT_COMPLETED, result)
                self.completed += 1
            else:
                _log.warning("rollout_failed", rollout_id=request.rollout_id, kind=result.kind,
                             reason=result.reason)
                await self.publisher.publish(ROLLOUT_FAILED, result)
                self.failed += 1

    async def _run(self, request: RolloutRequested, ctx: MessageContext, rollout_span: trace.Span,
                   started: float) -> RolloutCompleted:
        task = self._task(request)
        try:
            prompt = task.build_prompt(request.task_input)
        except TaskInputError as exc:
            raise RolloutError("invalid_request", str(exc)) from exc
        trajectory = Trajectory()
        trajectory.append_forced(self.tokenizer.encode(prompt, bos=True))
        if len(trajectory) >= self.max_seq_len:
            raise RolloutError("invalid_request", f"prompt of {len(trajectory)} tokens does not fit "
                               f"the model's context of {self.max_seq_len}")
        lease_id = await self._lease(request)
        try:
            transcript, turns = await self._while_leased(
                lease_id, self._turns(request, task, trajectory, lease_id, ctx, rollout_span))
        finally:
            await self._release(lease_id, request.rollout_id)
        reward = task.reward(request.task_input, transcript)
        return RolloutCompleted(
            rollout_id=request.rollout_id, task=request.task, group_id=request.group_id,
            purpose=request.purpose, reward=reward, turns=turns,
            tool_calls=len(transcript.tool_calls), prompt_len=len(self.tokenizer.encode(prompt)) + 1,
            tokens=trajectory.tokens, loss_mask=trajectory.loss_mask, logprobs=trajectory.logprobs,
            versions=trajectory.versions, text=self.tokenizer.decode(trajectory.tokens),
            duration_s=self.clock() - started,
        )

    async def _turns(self, request: RolloutRequested, task: Task, trajectory: Trajectory,
                     lease_id: str, ctx: MessageContext, rollout_span: trace.Span
                     ) -> tuple[Transcript, int]:
        calls, outputs = [], []
        final_text, finished_with_eos, turns_run = "", False, 0
        stops = sorted({*request.sampling.stop, *stop_strings(task.tools)})
        link = trace.Link(rollout_span.get_span_context())
        for turn in range(1, request.max_turns + 1):
            room = self.max_seq_len - len(trajectory)
            if room <= 0:
                break
            turns_run = turn
            # Each turn is its own trace (hour-long rollouts would make one trace unreadable),
            # linked to the rollout's span so the whole story can be followed.
            with _tracer.start_as_current_span(
                "turn", context=otel_context.Context(), links=[link],
                attributes={"rollout_id": request.rollout_id, "turn": turn},
            ):
                sampling = SamplingParams(
                    temperature=request.sampling.temperature, top_p=request.sampling.top_p,
                    max_new_tokens=min(request.sampling.max_new_tokens, room), stop=stops,
                )
                generation = await self._generate(request, trajectory, sampling, turn)
                trajectory.append_generated(generation.token_ids, generation.logprobs, generation.versions)
                text = self.tokenizer.decode(generation.token_ids)
                call = parse_tool_call(text, task.tools)
                if call is None:
                    final_text = text
                    finished_with_eos = generation.finish_reason == "eos"
                else:
                    calls.append(call)
                    output = await self._run_tool(request, task, call, lease_id)
                    outputs.append(output)
                    room = max(0, self.max_seq_len - len(trajectory))
                    trajectory.append_forced(self.tokenizer.encode(format_tool_output(output.text))[:room])
            await ctx.in_progress()
            if self.config.progress_events:
                await self.publisher.publish(ROLLOUT_PROGRESSED, RolloutProgressed(
                    rollout_id=request.rollout_id, turn=turn, num_tokens=len(trajectory),
                    weight_version=max(generation.versions, default=-1),
                    status="running" if call is not None else "answered",
                ))
            if call is None:
                break
        return Transcript(calls, outputs, final_text, finished_with_eos), turns_run

    def _task(self, request: RolloutRequested) -> Task:
        try:
            return self.tasks.get(request.task)
        except UnknownTaskError as exc:
            raise RolloutError("unknown_task", str(exc)) from exc

    async def _generate(self, request: RolloutRequested, trajectory: Trajectory,
                        sampling: SamplingParams, turn: int):
        try:
            # One session per rollout: each turn reuses the KV of the turns before it.
            return await self.engine.generate(
                list(trajectory.tokens), sampling, request_id=f"{request.rollout_id}/{turn}",
                options=GenerateOptions(session_id=request.rollout_id),
            )
        except Exception as exc:  # the engine's and Ray's errors alike: a typed failure, not a crash
            raise RolloutError("inference_error", f"turn {turn}: {exc}", turns=turn) from exc

    async def _run_tool(self, request: RolloutRequested, task: Task, call, lease_id: str) -> ToolOutput:
        with _tracer.start_as_current_span("tool", attributes={"tool": call.name,
                                                                "rollout_id": request.rollout_id}):
            try:
                reply = await self.sandbox.exec(
                    lease_id, task.tool_argv(call, request.task_input), timeout_s=self.config.tool_timeout_s,
                    capacity_retries=self.config.sandbox_capacity_retries)
            except SandboxRequestError as exc:
                raise RolloutError(_failure_kind(exc), str(exc)) from exc
        if reply.result in ("sandbox_died", "infra_error"):
            raise RolloutError("sandbox_error", f"sandbox {reply.result}: {reply.detail}")
        # The tool's own failures are the model's business: it sees them and may try again.
        return ToolOutput(ok=reply.result == "exit" and reply.exit_code == 0, text=_tool_text(reply)[:200])

    async def _lease(self, request: RolloutRequested) -> str:
        try:
            reply = await self.sandbox.lease(
                request.rollout_id, profile=self.config.sandbox_profile,
                ttl_s=self.config.sandbox_lease_ttl_s, capacity_retries=self.config.sandbox_capacity_retries)
        except SandboxRequestError as exc:
            raise RolloutError("sandbox_error", f"no sandbox lease: {exc}") from exc
        return reply.lease_id

    async def _while_leased(self, lease_id: str, work: Awaitable[T]) -> T:
        """Run ``work`` while heartbeating the lease; a lost lease ends the work (RolloutError)."""
        working = asyncio.ensure_future(work)
        heartbeat = asyncio.create_task(self._heartbeat(lease_id), name=f"heartbeat-{lease_id}")
        try:
            await asyncio.wait({working, heartbeat}, return_when=asyncio.FIRST_COMPLETED)
            if not working.done():
                heartbeat.result()  # it only ends by raising: the lease is lost
            return working.result()
        finally:
            for task in (working, heartbeat):
                task.cancel()
            await asyncio.gather(working, heartbeat, return_exceptions=True)

    async def _heartbeat(self, lease_id: str) -> None:
        while True:
            await asyncio.sleep(self.config.sandbox_heartbeat_s)
            try:
                await self.sandbox.heartbeat(lease_id)
            except SandboxRequestError as exc:
                if exc.kind == "unreachable":  # the TTL outlasts a missed beat or two
                    _log.warning("sandbox_heartbeat_missed", lease_id=lease_id, error=str(exc))
                    continue
                raise RolloutError(_failure_kind(exc), f"sandbox lease lost: {exc}") from exc

    async def _release(self, lease_id: str, rollout_id: str) -> None:
        try:
            await self.sandbox.release(lease_id)
        except SandboxRequestError as exc:  # the broker reaps expired leases; losing a release loses nothing
            _log.warning("sandbox_release_failed", rollout_id=rollout_id, lease_id=lease_id, error=str(exc))


def _failure_kind(exc: SandboxRequestError) -> FailureKind:
    return "sandbox_timeout" if exc.kind == "lease_expired" else "sandbox_error"


def _tool_text(reply: SandboxExecReply) -> str:
    """What the model sees of a tool's result."""
    stdout = reply.stdout.decode(errors="replace").strip()
    stderr = reply.stderr.decode(errors="replace").strip()
    if reply.result == "exit" and reply.exit_code == 0:
        return stdout
    if reply.result == "exit":
        return stderr or stdout or f"exit code {reply.exit_code}"
    if reply.result == "signal":
        return stderr or f"killed by signal {reply.signal}"
    if reply.result == "output_truncated":
        kept = stdout or stderr
        return f"{kept}\n{TRUNCATION_MARKER}" if kept else TRUNCATION_MARKER
    return _ENDINGS.get(reply.result, reply.result)
