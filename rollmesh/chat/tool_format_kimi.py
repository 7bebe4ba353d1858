"""Kimi K2 tool calls: ``<|tool_calls_section_begin|>`` ... ``<|tool_calls_section_end|>``.

Each call is ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>``.
The ``functions.NAME:IDX`` string is the call's ``tool_call_id``, kept unchanged: the template
(ggml-org/llama.cpp models/templates/moonshotai-Kimi-K2.jinja) renders it back verbatim and the tool
result refers to it. Upstream references read, not copied: sgl-project/sglang
python/sglang/srt/function_call/kimik2_detector.py and vllm-project/vllm
vllm/tool_parsers/kimi_k2_tool_parser.py. Knows the text format only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rollmesh.chat.tool_syntax import (
    CallCandidate,
    TurnSyntax,
    arguments_json,
    call_with_json_arguments,
    split_marked_calls,
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
    return split_marked_calls(text, first, call_begin=CALL_BEGIN, call_end=CALL_END, read_call=_one_call,
                              section_markers=(SECTION_BEGIN, SECTION_END))


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
    return call_with_json_arguments(raw, name, arguments_text, call_id=call_id)
