"""OpenAI chat messages and tools, rewritten into the form the served model's chat template takes.

Knows the HTTP shapes and ``rollmesh.chat`` (a model's call-id style and the form of call arguments
its template renders); not Ray, not FastAPI, not the engine. Clients write what the OpenAI API
allows, templates expect narrower things, and the differences are settled here only:

- an assistant turn that called tools arrives with ``content: null`` (the ``openai`` client sends
  that); templates that concatenate text fail on a null, so it becomes "";
- call ``arguments`` arrive as a JSON string; a template that writes them with ``tojson`` (Qwen,
  the demo) gets the object, one that pastes text (DeepSeek) gets the string; either must be a JSON
  object;
- call ids are kept when the template accepts them, else replaced by the family's form (Mistral's
  template refuses any id that is not 9 alphanumerics), and the tool results that answer them
  follow;
- a declared function without ``parameters`` takes none (the OpenAI API's reading), which templates
  that list a tool's parameters need spelled out.

What a template still refuses is its own verdict (``TemplateRenderError``), answered 400 by the
caller.
"""

from __future__ import annotations

import json
from typing import Any

from rollmesh.chat import ChatModel, InvalidToolDeclarationError, ToolSet, conform_call_id
from rollmesh.chat.tool_calls import TOOL_PARSERS
from rollmesh.serve_apps.errors import InvalidApiRequestError
from rollmesh.serve_apps.http_shapes import ChatMessage, MessageToolCall

NO_PARAMETERS = {"type": "object", "properties": {}}


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The request's tools, checked as OpenAI function schemas (400 ``param="tools"`` otherwise),
    each function with its ``parameters`` spelled out; None when there are none."""
    if not tools:
        return None
    try:
        ToolSet.from_openai(tools)
    except InvalidToolDeclarationError as exc:
        raise InvalidApiRequestError(f"invalid tools: {exc}", code="invalid_value",
                                     param=f"tools.{exc.tool_index}") from exc
    return [{**tool, "function": {"parameters": NO_PARAMETERS, **tool["function"]}} for tool in tools]


def template_messages(messages: list[ChatMessage], chat: ChatModel) -> list[dict[str, Any]]:
    """The conversation as plain dicts in the form ``chat``'s template takes (module docstring)."""
    style = TOOL_PARSERS[chat.tool_parser].call_id_style if chat.tool_parser else "openai"
    renamed: dict[str, str] = {}  # call ids the template would refuse -> the ones it takes
    calls_so_far = 0
    rendered: list[dict[str, Any]] = []
    for position, message in enumerate(messages):
        where = f"messages.{position}"
        out: dict[str, Any] = {"role": message.role}
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise InvalidApiRequestError(
                f"{where}.content is null: only an assistant message with tool_calls may omit it",
                code="invalid_value", param=f"{where}.content")
        out["content"] = message.content or ""
        if message.name is not None:
            out["name"] = message.name
        if message.reasoning_content is not None:
            # Under both names templates read: Qwen3's reasoning_content, gpt-oss's thinking.
            out["reasoning_content"] = out["thinking"] = message.reasoning_content
        if message.tool_calls:  # only when there are calls: Llama 3's template tests for the key
            calls = []
            for offset, call in enumerate(message.tool_calls):
                call_id = conform_call_id(style, call.id, calls_so_far + offset, name=call.function.name)
                if call.id is not None and call_id != call.id:
                    renamed[call.id] = call_id
                calls.append(_template_call(call, call_id, chat, f"{where}.tool_calls.{offset}"))
            calls_so_far += len(calls)
            out["tool_calls"] = calls
        if message.tool_call_id is not None:
            out["tool_call_id"] = renamed.get(message.tool_call_id, message.tool_call_id)
        rendered.append(out)
    return rendered


def calls_in(messages: list[ChatMessage]) -> int:
    """How many tool calls the conversation already holds: the index a new turn's calls start at,
    so the ids given to them are not ids of earlier calls."""
    return sum(len(message.tool_calls or ()) for message in messages)


def _template_call(call: MessageToolCall, call_id: str, chat: ChatModel, where: str) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidApiRequestError(
                f"{where}.function.arguments is not JSON: {exc}", code="invalid_value",
                param=f"{where}.function.arguments") from exc
    if not isinstance(arguments, dict):
        raise InvalidApiRequestError(
            f"{where}.function.arguments must be a JSON object, not {type(arguments).__name__}",
            code="invalid_value", param=f"{where}.function.arguments")
    if chat.arguments_as == "string":
        arguments = json.dumps(arguments, ensure_ascii=False)
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call_id, "type": "function", "function": function}
