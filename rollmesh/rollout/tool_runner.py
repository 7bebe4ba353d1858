"""One turn's tool calls: run concurrently, answered in call order as ``tool`` messages.

Knows the task plugin's tool actions, the sandbox broker's client and the parsed turn; nothing of
tokens, the engine or the bus. A well-formed call runs as its task says: a command in the
rollout's sandbox, or trusted task code in a thread. A malformed call (bad JSON, unknown tool,
arguments not matching the schema) runs nothing: its tool result tells the model what was wrong.
Each result is one ``{"role": "tool", "tool_call_id", "content"}`` message, in the order the
model wrote the calls, whichever finished first. A tool's own failure is the model's business (a
result it sees); a sandbox that cannot serve the call is the rollout's (``RolloutError``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from rollmesh.chat import MalformedToolCall, ParsedTurn, ToolCall
from rollmesh.config import RolloutConfig
from rollmesh.messages import RolloutRequested
from rollmesh.rollout.errors import RolloutError
from rollmesh.rollout.tasks import PythonTool, SandboxCommand, Task, ToolOutput
from rollmesh.rollout.tool_results import failure_kind, tool_text
from rollmesh.sandbox.broker_client import SandboxBrokerClient
from rollmesh.sandbox.errors import SandboxRequestError
from rollmesh.telemetry import conventions

_tracer = trace.get_tracer("rollmesh.rollout")
# What the model is shown of one tool result at most (a tiny model's context is short).
MAX_SHOWN_CHARS = 200


@dataclass(frozen=True)
class TurnResults:
    """The tool messages answering a turn's calls (malformed ones included), in call order, and
    the outputs of its well-formed calls (``ParsedTurn.tool_calls`` order)."""

    messages: list[dict[str, Any]]
    outputs: list[ToolOutput]


class ToolRunner:
    def __init__(self, sandbox: SandboxBrokerClient, config: RolloutConfig) -> None:
        self.sandbox = sandbox
        self.config = config

    async def run_turn(self, request: RolloutRequested, task: Task, parsed: ParsedTurn, lease_id: str,
                       turn: int) -> TurnResults:
        """Run the turn's calls at once; the first sandbox failure cancels the others and raises."""
        try:
            async with asyncio.TaskGroup() as group:
                running = [group.create_task(self._run(request, task, call, lease_id, turn))
                           for call in parsed.tool_calls]
        except BaseExceptionGroup as failed:  # the first failure is the rollout's; the rest were cancelled
            raise failed.exceptions[0] from None
        outputs = [task_.result() for task_ in running]
        answers: list[tuple[int, str, str]] = [(call.index, call.id, output.text)
                                              for call, output in zip(parsed.tool_calls, outputs)]
        answers += [(bad.index, bad.id, malformed_text(bad)) for bad in parsed.malformed]
        return TurnResults([{"role": "tool", "tool_call_id": call_id, "content": text}
                            for _, call_id, text in sorted(answers, key=lambda answer: answer[0])], outputs)

    async def _run(self, request: RolloutRequested, task: Task, call: ToolCall, lease_id: str,
                   turn: int) -> ToolOutput:
        with _tracer.start_as_current_span(conventions.SPAN_TOOL, attributes={
                "tool": call.name, "rollout_id": request.rollout_id,
                conventions.RL_TOOL_NAME: call.name, conventions.RL_ROLLOUT_ID: request.rollout_id,
                conventions.RL_TURN_INDEX: turn, conventions.RL_SANDBOX_LEASE_ID: lease_id}):
            try:
                action = task.tool_action(call, request.task_input)
            except Exception as exc:  # the task's own code failed on a well-formed call
                raise RolloutError("internal_error", f"turn {turn}: task {task.name!r} could not map call "
                                   f"{call.name!r}: {exc!r}", turns=turn) from exc
            if isinstance(action, PythonTool):
                return await _run_python(action)
            if not isinstance(action, SandboxCommand):
                raise RolloutError("internal_error", f"task {task.name!r} answered call {call.name!r} with "
                                   f"{type(action).__name__}, not a SandboxCommand or PythonTool", turns=turn)
            try:
                reply = await self.sandbox.exec(
                    lease_id, action.argv, timeout_s=self.config.tool_timeout_s,
                    capacity_retries=self.config.sandbox_capacity_retries, rollout_id=request.rollout_id)
            except SandboxRequestError as exc:
                raise RolloutError(failure_kind(exc), f"turn {turn}: {exc}", turns=turn) from exc
        if reply.result in ("sandbox_died", "infra_error"):
            raise RolloutError("sandbox_error", f"turn {turn}: sandbox {reply.result}: {reply.detail}",
                               turns=turn)
        # The tool's own failures are the model's business: it sees them and may try again.
        return ToolOutput(ok=reply.result == "exit" and reply.exit_code == 0,
                          text=tool_text(reply)[:MAX_SHOWN_CHARS])


async def _run_python(action: PythonTool) -> ToolOutput:
    try:
        text = await asyncio.to_thread(action.function)
    except Exception as exc:  # the task's code failed on this call: the model is told, as with a tool
        return ToolOutput(ok=False, text=f"{type(exc).__name__}: {exc}"[:MAX_SHOWN_CHARS])
    return ToolOutput(ok=True, text=str(text)[:MAX_SHOWN_CHARS])


def malformed_text(call: MalformedToolCall) -> str:
    """What the model is told of a call that could not run."""
    return f"error: tool call not run ({call.kind}): {call.reason}"[:MAX_SHOWN_CHARS]
