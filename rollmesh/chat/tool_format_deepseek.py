"""DeepSeek V3 / V3.1 tool calls, between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``.

Two call forms, told apart by what follows ``<｜tool▁sep｜>``:
- V3 / R1: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
- V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``
The markers use U+FF5C (｜) and U+2581 (▁). Upstream references read, not copied:
sgl-project/sglang python/sglang/srt/function_call/deepseekv3_detector.py and
deepseekv31_detector.py, vllm-project/vllm vllm/tool_parsers/deepseekv3_tool_parser.py and
deepseekv31_tool_parser.py; the V3.1 rendering in ggml-org/llama.cpp
models/templates/deepseek-ai-DeepSeek-V3.1.jinja. Knows the text format only.
"""

from __future__ import annotations

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

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_FENCE_OPEN = "\n```json\n"
_FENCE_CLOSE = "\n```"


def split_deepseek_v3(text: str) -> TurnSyntax:
    first = text.find(CALLS_BEGIN)
    if first == -1:
        first = text.find(CALL_BEGIN)  # a model that skips the section marker still calls
    if first == -1:
        return TurnSyntax(content=text.strip())
    return split_marked_calls(text, first, call_begin=CALL_BEGIN, call_end=CALL_END, read_call=_one_call,
                              section_markers=(CALLS_BEGIN, CALLS_END))


def write_deepseek_v3(content: str, calls: Sequence[ToolCall]) -> str:
    """A turn in the V3.1 form, as its template renders calls (split_deepseek_v3 reads it back)."""
    if not calls:
        return content
    written = "".join(f"{CALL_BEGIN}{call.name}{SEP}"
                      f"{arguments_json(call.arguments, as_string=call.arguments_were_string)}{CALL_END}"
                      for call in calls)
    return f"{content}{CALLS_BEGIN}{written}{CALLS_END}"


def _one_call(raw: str, body: str) -> CallCandidate:
    if SEP not in body:
        return CallCandidate(raw=raw, syntax_error="a tool call without <｜tool▁sep｜>")
    before, _, after = body.partition(SEP)
    if _FENCE_OPEN in after:
        name, _, fenced = after.partition(_FENCE_OPEN)
        if not fenced.rstrip().endswith(_FENCE_CLOSE.strip()):
            return CallCandidate(raw=raw, name=name.strip() or None, syntax_error="arguments not closed by ```")
        arguments_text = fenced.rstrip()[: -len(_FENCE_CLOSE.strip())]
    else:
        name, arguments_text = before, after
    name = name.strip()
    if not name:
        return CallCandidate(raw=raw, syntax_error="a tool call without a name")
    return call_with_json_arguments(raw, name, arguments_text)
