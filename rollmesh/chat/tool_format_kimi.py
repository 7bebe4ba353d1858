"""Kimi K2 tool calls: ``<|tool_calls_section_begin|>`` ... ``<|tool_calls_section_end|>``.

Each call is ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>``.
The ``functions.NAME:IDX`` string is the call's ``tool_call_id``, kept unchanged: the template
(ggml-org/llama.cpp models/templates/moonshotai-Kimi-K2.jinja) renders it back verbatim and the tool
result refers to it. Upstream references read, not copied: sgl-project/sglang
python/sglang/srt/function_call/kimik2_detector.py and vllm-project/vllm
vllm/tool_parsers/kimi_k2_tool_parser.py. Knows the text format only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rollmesh.chat.tool_syntax import (
    CallCandidate,
    TurnSyntax,
    arguments_json,
    decode_json_at,
    join_content,
    skip_whitespace,
)

if TYPE_CHECKING:
    from rollmesh.chat.tool_calls import ToolCall

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
# "functions.get_weather:0"; the namespace prefix is optional in what models write.
_CALL_ID = re.compile(r"^(?:functions\.)?(?P<name>[^\s:]+):(?P<index>\d+)$")


def split_kimi_k2(text: str) -> TurnSyntax:
    first = text.find(SECTION_BEGIN)
    if first == -1:
        return TurnSyntax(content=text.strip())
    content_parts = [text[:first]]
    candidates: list[CallCandidate] = []
    pos = first
    while (start := text.find(CALL_BEGIN, pos)) != -1:
        end = text.find(CALL_END, start)
        if end == -1:
            reason = "the turn ended inside a tool call"
            candidates.append(CallCandidate(raw=text[start:], syntax_error=reason, truncated=True))
            pos = len(text)
            break
        candidates.append(_one_call(text[start : end + len(CALL_END)], text[start + len(CALL_BEGIN) : end]))
        pos = end + len(CALL_END)
    content_parts.append(text[pos:].replace(SECTION_BEGIN, "").replace(SECTION_END, ""))
    return TurnSyntax(content=join_content(content_parts), candidates=candidates)


def write_kimi_k2(content: str, calls: Sequence[ToolCall]) -> str:
    """A turn as Kimi K2 writes it, each call under its id (functions.NAME:IDX; split_kimi_k2 reads it back)."""
    if not calls:
        return content
    written = "".join(f"{CALL_BEGIN}{call.id}{ARGUMENT_BEGIN}"
                      f"{arguments_json(call.arguments, as_string=call.arguments_were_string)}{CALL_END}"
                      for call in calls)
    return f"{content}{SECTION_BEGIN}{written}{SECTION_END}"


def name_from_call_id(call_id: str) -> str | None:
    match = _CALL_ID.match(call_id.strip())
    return match["name"] if match else None


def _one_call(raw: str, body: str) -> CallCandidate:
    if ARGUMENT_BEGIN not in body:
        return CallCandidate(raw=raw, syntax_error="a tool call without <|tool_call_argument_begin|>")
    call_id, _, arguments_text = body.partition(ARGUMENT_BEGIN)
    call_id = call_id.strip()
    name = name_from_call_id(call_id)
    if name is None:
        reason = f"call id {call_id!r} is not functions.NAME:INDEX"
        return CallCandidate(raw=raw, call_id=call_id or None, syntax_error=reason)
    try:
        arguments, end = decode_json_at(arguments_text, 0)
    except json.JSONDecodeError as exc:
        reason = f"invalid JSON arguments: {exc.msg}"
        return CallCandidate(raw=raw, name=name, call_id=call_id, syntax_error=reason)
    if skip_whitespace(arguments_text, end) != len(arguments_text):
        reason = "text after the JSON arguments"
        return CallCandidate(raw=raw, name=name, call_id=call_id, syntax_error=reason)
    return CallCandidate(raw=raw, name=name, arguments=arguments, call_id=call_id)
