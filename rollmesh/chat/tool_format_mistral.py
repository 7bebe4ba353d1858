"""Mistral tool calls, after the ``[TOOL_CALLS]`` token, in the three forms Mistral models write.

- JSON array (Mistral 7B v0.3, Nemo; tokenizer < v11): ``[TOOL_CALLS][{"name", "arguments", "id"}]``.
  The template (ggml-org/llama.cpp models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja)
  renders ``tool_call.function|tojson``, so ``arguments`` may be a JSON string; ids are 9
  alphanumeric characters.
- ``[TOOL_CALLS]name{...}`` per call (tokenizer v11).
- ``[TOOL_CALLS]name[ARGS]{...}`` per call (newer, e.g. Mistral Small 3.2, Magistral; with an
  optional ``[CALL_ID]id`` before ``[ARGS]``).
Upstream references read, not copied: vllm-project/vllm vllm/tool_parsers/mistral_tool_parser.py
and sgl-project/sglang python/sglang/srt/function_call/mistral_detector.py. Text format only.
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

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


def split_mistral(text: str) -> TurnSyntax:
    first = text.find(TOOL_CALLS)
    if first == -1:
        return TurnSyntax(content=text.strip())
    content = text[:first]
    after = skip_whitespace(text, first + len(TOOL_CALLS))
    if text.startswith("[", after) and not text.startswith(ARGS, after):
        candidates, trailing = _array_form(text, first, after)
    else:
        candidates, trailing = _named_form(text[first:])
    return TurnSyntax(content=join_content([content, trailing]), candidates=candidates)


def write_mistral(content: str, calls: Sequence[ToolCall]) -> str:
    """A turn in the array form (Mistral 7B v0.3, Nemo), each call with its 9-character id, in the
    key order the Nemo template renders (split_mistral reads it back)."""
    if not calls:
        return content
    written = ", ".join(f'{{"name": {json.dumps(call.name, ensure_ascii=False)}, "arguments": '
                        f"{arguments_json(call.arguments, as_string=call.arguments_were_string)}, "
                        f'"id": {json.dumps(call.id)}}}' for call in calls)
    return f"{content}{TOOL_CALLS}[{written}]"


def _array_form(text: str, start: int, array_start: int) -> tuple[list[CallCandidate], str]:
    try:
        array, end = decode_json_at(text, array_start)
    except json.JSONDecodeError as exc:
        truncated = json_was_cut(text[array_start:])
        reason = f"invalid JSON after [TOOL_CALLS]: {exc.msg}"
        if truncated:
            reason = "the turn ended inside the [TOOL_CALLS] array"
        return [CallCandidate(raw=text[start:], syntax_error=reason, truncated=truncated)], ""
    raw = text[start:end]
    if not isinstance(array, list):
        reason = "[TOOL_CALLS] must be followed by a JSON array"
        return [CallCandidate(raw=raw, syntax_error=reason)], text[end:]
    # Each element's own text is not kept by the decoder; its canonical JSON stands for it.
    calls = []
    for item in array:
        item_text = json.dumps(item, ensure_ascii=False)
        calls.append(call_from_object(item_text, item, arguments_keys=("arguments",)))
    return calls, text[end:]


def _named_form(text: str) -> tuple[list[CallCandidate], str]:
    candidates: list[CallCandidate] = []
    trailing = ""
    for piece in text.split(TOOL_CALLS)[1:]:
        candidate, rest = _named_call(piece)
        candidates.append(candidate)
        trailing += rest
    return candidates, trailing


def _named_call(piece: str) -> tuple[CallCandidate, str]:
    raw = TOOL_CALLS + piece
    if ARGS in piece:
        head, _, _ = piece.partition(ARGS)
        args_at = piece.index(ARGS) + len(ARGS)
    elif "{" in piece:
        head = piece[: piece.index("{")]
        args_at = piece.index("{")
    else:
        # A bare name at the very end is a turn cut before its arguments.
        cut = " " not in piece.strip()
        return CallCandidate(raw=raw, syntax_error="[TOOL_CALLS] without arguments", truncated=cut), ""
    name, _, call_id = head.partition(CALL_ID)
    name = name.strip()
    if not name:
        return CallCandidate(raw=raw, syntax_error="[TOOL_CALLS] without a tool name"), ""
    try:
        arguments, end = decode_json_at(piece, args_at)
    except json.JSONDecodeError as exc:
        truncated = json_was_cut(piece[args_at:])
        reason = "the turn ended inside the arguments" if truncated else f"invalid JSON arguments: {exc.msg}"
        return CallCandidate(raw=raw, name=name, syntax_error=reason, truncated=truncated), ""
    raw = TOOL_CALLS + piece[:end]
    call = CallCandidate(raw=raw, name=name, arguments=arguments, call_id=call_id.strip() or None)
    return call, piece[end:]
