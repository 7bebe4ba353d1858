"""Llama 3.1 / 3.2 JSON tool calls: ``{"name": ..., "parameters": {...}}``, maybe after <|python_tag|>.

The templates (ggml-org/llama.cpp models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja and
Llama-3.2-3B-Instruct.jinja) render a call as ``{"name": "f", "parameters": {...}}`` with no
prefix; the model may also start the call with ``<|python_tag|>``. Several calls are separated by
``;`` (the templates themselves accept one call per message). Upstream references read, not copied:
vllm-project/vllm vllm/tool_parsers/llama_tool_parser.py (``arguments`` or ``parameters``) and
sgl-project/sglang python/sglang/srt/function_call/llama32_detector.py (the ``;`` separator).
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
    json_was_cut,
    skip_whitespace,
)

if TYPE_CHECKING:
    from rollmesh.chat.tool_calls import ToolCall

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


def split_llama3_json(text: str) -> TurnSyntax:
    if PYTHON_TAG in text:
        content, _, calls_text = text.partition(PYTHON_TAG)
    elif text.lstrip().startswith("{"):
        content, calls_text = "", text
        if not _looks_like_call(calls_text):
            # A JSON answer that is not a call (no "name") stays content, as in vLLM.
            return TurnSyntax(content=text.strip())
    else:
        return TurnSyntax(content=text.strip())
    candidates, trailing = _calls(calls_text)
    return TurnSyntax(content=join_content([content, trailing]), candidates=candidates)


def write_llama3_json(content: str, calls: Sequence[ToolCall]) -> str:
    """A turn as Llama writes it: calls as the template renders them, separated by "; "; after
    content, the calls follow <|python_tag|> (split_llama3_json reads it back)."""
    written = "; ".join(f'{{"name": {json.dumps(call.name, ensure_ascii=False)}, "parameters": '
                        f"{arguments_json(call.arguments, as_string=call.arguments_were_string)}}}" for call in calls)
    if content and written:
        return f"{content}{PYTHON_TAG}{written}"
    return content or written


def _looks_like_call(text: str) -> bool:
    try:
        obj, _ = decode_json_at(text, 0)
    except json.JSONDecodeError:
        return '"name"' in text  # a broken call is still a call
    return isinstance(obj, dict) and "name" in obj


def _calls(text: str) -> tuple[list[CallCandidate], str]:
    candidates: list[CallCandidate] = []
    pos = skip_whitespace(text, 0)
    while pos < len(text):
        try:
            obj, end = decode_json_at(text, pos)
        except json.JSONDecodeError as exc:
            truncated = json_was_cut(text[pos:])
            reason = "the turn ended inside the JSON call" if truncated else f"invalid JSON call: {exc.msg}"
            candidates.append(CallCandidate(raw=text[pos:], syntax_error=reason, truncated=truncated))
            return candidates, ""
        candidates.append(call_from_object(text[pos:end], obj, arguments_keys=("parameters", "arguments")))
        pos = skip_whitespace(text, end)
        if text.startswith(SEPARATOR, pos):
            pos = skip_whitespace(text, pos + len(SEPARATOR))
        elif pos < len(text):
            return candidates, text[pos:]  # prose after the calls is content
    return candidates, ""
