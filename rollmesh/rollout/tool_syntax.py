"""The tool-call syntax, parsed from the model's exact output text.

Knows nothing but ``re``. Documented in the README:
- the model calls a tool by writing ``<NAME>ARGUMENT</NAME>``; generation stops at ``</NAME>``;
- the tool's output is appended as ``<result>OUTPUT</result>\n`` (tokens with loss mask 0);
- any text that ends with EOS and holds no tool call is the final answer.
"""

from __future__ import annotations

import re

from rollmesh.rollout.tasks import ToolCall

_TOOL_CALL = re.compile(r"<([a-z_][a-z0-9_]{0,31})>(.*?)</\1>\Z", re.DOTALL)
MAX_ARGUMENT_CHARS = 4096


def stop_strings(tool_names: frozenset[str]) -> list[str]:
    """The closing tags that end a generation so the tool can run."""
    return [f"</{name}>" for name in sorted(tool_names)]


def parse_tool_call(generated_text: str, tool_names: frozenset[str]) -> ToolCall | None:
    """The tool call that ends ``generated_text``, if it is one of ``tool_names``."""
    match = _TOOL_CALL.search(generated_text)
    if match is None or match.group(1) not in tool_names:
        return None
    argument = match.group(2)
    if len(argument) > MAX_ARGUMENT_CHARS:
        return None
    return ToolCall(name=match.group(1), argument=argument)


def format_tool_output(text: str) -> str:
    return f"<result>{text}</result>\n"
