"""Hermes tool calls (Qwen2.5, Qwen3, Hermes 2/3): ``<tool_call>{"name", "arguments"}</tool_call>``.

Several calls per turn; text outside the tags is content. Upstream references read for the format
(not copied): sgl-project/sglang python/sglang/srt/function_call/hermes_detector.py and
vllm-project/vllm vllm/tool_parsers/hermes_tool_parser.py; the assistant rendering in
ggml-org/llama.cpp models/templates/Qwen-Qwen3-0.6B.jinja (``<tool_call>\\n{json}\\n</tool_call>``).
Knows the text format only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rollmesh.chat.tool_syntax import (
    CallCandidate,
    TurnSyntax,
    arguments_json,
    call_from_object,
    decode_json_at,
    join_content,
    skip_whitespace,
)

if TYPE_CHECKING:
    from rollmesh.chat.tool_calls import ToolCall

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def split_hermes(text: str) -> TurnSyntax:
    content_parts: list[str] = []
    candidates: list[CallCandidate] = []
    pos = 0
    while (start := text.find(OPEN, pos)) != -1:
        content_parts.append(text[pos:start])
        body_start = start + len(OPEN)
        candidate, pos = _one_call(text, start, body_start)
        candidates.append(candidate)
    content_parts.append(text[pos:].replace(CLOSE, ""))
    return TurnSyntax(content=join_content(content_parts), candidates=candidates)


def write_hermes(content: str, calls: Sequence[ToolCall]) -> str:
    """A turn as Qwen writes it: content, then each call on its own lines (split_hermes reads it back)."""
    written = [f'{OPEN}\n{{"name": {json.dumps(call.name, ensure_ascii=False)}, "arguments": '
               f"{arguments_json(call.arguments, as_string=call.arguments_were_string)}}}\n{CLOSE}" for call in calls]
    return "\n".join(([content] if content else []) + written)


def _one_call(text: str, start: int, body_start: int) -> tuple[CallCandidate, int]:
    close = text.find(CLOSE, body_start)
    try:
        obj, end = decode_json_at(text, body_start)
    except json.JSONDecodeError as exc:
        if close == -1:
            cut = "unclosed <tool_call>: the turn ended inside the call"
            return CallCandidate(raw=text[start:], syntax_error=cut, truncated=True), len(text)
        stop = close + len(CLOSE)
        reason = f"invalid JSON in <tool_call>: {exc.msg} at {exc.pos - body_start}"
        return CallCandidate(raw=text[start:stop], syntax_error=reason), stop
    after = skip_whitespace(text, end)
    if text.startswith(CLOSE, after):
        raw = text[start : after + len(CLOSE)]
        return call_from_object(raw, obj, arguments_keys=("arguments", "parameters")), after + len(CLOSE)
    if after >= len(text):
        cut = "unclosed <tool_call>: no </tool_call> after the JSON"
        return CallCandidate(raw=text[start:], syntax_error=cut, truncated=True), len(text)
    # Text between the JSON and the closing tag: not a call the format allows.
    stop = close + len(CLOSE) if close != -1 else len(text)
    reason = "unexpected text after the JSON inside <tool_call>"
    return CallCandidate(raw=text[start:stop], syntax_error=reason), stop
