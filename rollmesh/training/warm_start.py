"""Supervised sequences from chat conversations: the warm start's demonstrations and any other
conversation the trainer's SFT step is given.

Knows the task plugin Protocol and ``rollmesh.chat``; not Ray, NATS or torch. A conversation
becomes tokens exactly as a rollout builds them: the first prompt rendered and tokenized once
(``ChatModel.new_trajectory``), each assistant turn written in the model's own format and encoded
once as if sampled, parsed back into the message the template renders (the call ids a rollout's
tool results answer), and the messages after it appended by the template's join. So the warm
start teaches the very tokens a rollout shows the model and reads back. Loss falls on the
assistant's tokens, its end-of-turn token included; prompts, tool results and the template's
joins are masked. Only a share of the demonstrations answers exactly (``exact_fraction``; the task decides what an
inexact one is), so the warm-started policy is only sometimes right and RL has something real to
learn.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from rollmesh.chat import (
    TOOL_PARSERS,
    ChatModel,
    ChatTrajectory,
    ToolCall,
    conform_call_id,
    prompt_opens_reasoning,
)
from rollmesh.rollout.tasks import DemonstrableTask
from rollmesh.training.errors import ConversationError

# (ids, loss_mask): what the backends' ``sft_step`` trains on.
SftSequence = tuple[list[int], list[int]]


def conversation_sequence(chat: ChatModel, messages: Sequence[Mapping[str, Any]], *,
                          tools: Sequence[Mapping[str, Any]] | None = None) -> SftSequence:
    """One (ids, loss_mask) sequence of a whole conversation (``conversation_trajectory``)."""
    sample = conversation_trajectory(chat, messages, tools=tools).sample
    return list(sample.ids), list(sample.loss_mask)


def conversation_trajectory(chat: ChatModel, messages: Sequence[Mapping[str, Any]], *,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> ChatTrajectory:
    """A whole conversation as the token-exact trajectory a rollout would have built (module
    docstring); its ``sample`` is what trains.

    ``messages``: the prompt (system, user...), then assistant turns (``content``, ``tool_calls``
    as ``rollmesh.chat.ToolCall`` or OpenAI entries, optional ``reasoning_content``) with the
    messages that answer them (``tool`` results by ``tool_call_id``, user turns); it must end with
    an assistant turn. Call ids are made what the family's template accepts (Mistral's nine
    characters...), and a tool result's ``tool_call_id`` is mapped to the id its call gets when
    parsed, as a rollout's results carry it.
    """
    first = next((index for index, message in enumerate(messages) if message.get("role") == "assistant"), None)
    if first is None:
        raise ConversationError("no assistant turn to train on")
    if messages[-1].get("role") != "assistant":
        raise ConversationError("the conversation must end with an assistant turn", message_index=len(messages) - 1)
    style = TOOL_PARSERS[chat.tool_parser].call_id_style if chat.tool_parser else "openai"
    # Compiled once per distinct declaration by the ChatModel: most of a short conversation's cost.
    toolset = chat.toolset(tools)
    trajectory = chat.new_trajectory(messages[:first], tools=tools)
    call_ids: dict[str, str] = {}
    calls_so_far = 0
    pending: list[Mapping[str, Any]] = []
    for index in range(first, len(messages)):
        message = messages[index]
        if message.get("role") != "assistant":
            pending.append(_answering(message, call_ids))
            continue
        if pending:
            trajectory.append(pending)  # consecutive results and user turns: one append, as a rollout does
            pending = []
        given = [_as_tool_call(call, calls_so_far + n) for n, call in enumerate(message.get("tool_calls") or ())]
        calls = [replace(call, id=conform_call_id(style, call.id, calls_so_far + n, name=call.name), index=n)
                 for n, call in enumerate(given)]
        prompt_ids = trajectory.prompt_ids()
        text = chat.write_turn(content=message.get("content") or "", calls=calls,
                               reasoning=message.get("reasoning_content"),
                               prompt_opened_reasoning=prompt_opens_reasoning(chat.decode(prompt_ids[-8:])))
        ids = chat.encode(text)
        parsed = chat.parse_turn(ids, tools=toolset, first_call_index=calls_so_far, prompt_ids=prompt_ids)
        _check_calls(parsed.tool_calls, parsed.malformed, calls, index)
        call_ids.update({call.id: found.id for call, found in zip(given, parsed.tool_calls) if call.id})
        calls_so_far += len(parsed.tool_calls)
        trajectory.add_generated(ids, [0.0] * len(ids), chat.assistant_message(parsed))
    return trajectory


def demonstration_batch(task: DemonstrableTask, chat: ChatModel, rng: random.Random, *, size: int,
                        exact_fraction: float) -> list[SftSequence]:
    """``size`` supervised sequences of training-split demonstrations (``conversation_sequence``)."""
    tools = task.tools()
    batch = []
    for task_input in task.sample_task_inputs(rng, size, held_out=False):
        follow = task.demonstration(task_input, exact=rng.random() < exact_fraction, rng=rng)
        batch.append(conversation_sequence(chat, [*task.messages(task_input), *follow], tools=tools))
    return batch


def _as_tool_call(call: ToolCall | Mapping[str, Any], index: int) -> ToolCall:
    """A call as ``ChatModel.write_turn`` takes it: a ToolCall as given, an OpenAI entry read."""
    if isinstance(call, ToolCall):
        return call
    function = call.get("function") or {}
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ConversationError(f"tool call {index}: arguments are not JSON ({exc})") from exc
    if not isinstance(arguments, dict) or not function.get("name"):
        raise ConversationError(f"tool call {index}: needs function.name and an arguments object")
    return ToolCall(id=str(call.get("id") or ""), name=str(function["name"]), arguments=arguments, index=index)


def _answering(message: Mapping[str, Any], call_ids: Mapping[str, str]) -> Mapping[str, Any]:
    """``message`` with its ``tool_call_id`` mapped to the id of the parsed call it answers."""
    given = message.get("tool_call_id")
    if given in call_ids:
        return {**message, "tool_call_id": call_ids[given]}
    return message


def _check_calls(parsed: Iterable[ToolCall], malformed: Sequence[Any], written: Sequence[ToolCall],
                 index: int) -> None:
    """The turn as written must read back as the calls it was written from: otherwise the model
    would be taught a turn its own rollouts parse differently."""
    read = [(call.name, call.arguments) for call in parsed]
    if malformed or read != [(call.name, call.arguments) for call in written]:
        raise ConversationError(f"the written turn parses back as {read} with {len(malformed)} malformed call(s), "
                                f"not as its calls {[call.name for call in written]}", message_index=index)
