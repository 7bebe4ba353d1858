"""Tool calls and reasoning parsed from one assistant turn, in the model family's own format.

Input is the text of the turn decoded from its exact ids with special tokens kept
(``skip_special_tokens=False``). The format modules (``tool_format_*.py``, ``harmony.py``) cut it
into content and candidate calls; this module gives every candidate its meaning once for all
formats: a declared tool, arguments decoded once (a JSON string is decoded, never encoded again),
checked against the tool's schema, and a call id in the form the family's template accepts.
A call that fails any of this is a ``MalformedToolCall`` saying why, never an exception.
Knows text and JSON Schema; not tokenizers, templates' rendering, rollouts or the bus.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rollmesh.chat import harmony
from rollmesh.chat.errors import UnknownParserError
from rollmesh.chat.reasoning import split_reasoning
from rollmesh.chat.tool_format_deepseek import split_deepseek_v3
from rollmesh.chat.tool_format_hermes import split_hermes
from rollmesh.chat.tool_format_kimi import split_kimi_k2
from rollmesh.chat.tool_format_llama3 import split_llama3_json
from rollmesh.chat.tool_format_mistral import split_mistral
from rollmesh.chat.tool_schemas import ToolSet
from rollmesh.chat.tool_syntax import CallCandidate, TurnSyntax

MalformedKind = Literal["bad_json", "truncated", "unknown_tool", "bad_arguments", "schema_mismatch"]
CallIdStyle = Literal["openai", "mistral", "kimi"]


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call. ``index`` is its place among the turn's calls, malformed ones included."""

    id: str
    name: str
    arguments: dict[str, Any]
    index: int = 0
    arguments_were_string: bool = False  # the model wrote the arguments as a JSON string

    def to_openai(self, *, arguments_as: Literal["string", "object"] = "string") -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry; templates differ in which ``arguments`` form they take."""
        arguments: Any = self.arguments
        if arguments_as == "string":
            arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass(frozen=True)
class MalformedToolCall:
    """A call the model tried to make, with what was wrong; its ``id`` answers it in a tool result."""

    raw: str
    reason: str
    kind: MalformedKind = "bad_json"
    name: str | None = None
    id: str = ""
    index: int = 0


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[MalformedToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolParser:
    name: str
    split: Callable[[str], TurnSyntax]
    call_id_style: CallIdStyle
    end_markers: tuple[str, ...]  # end-of-turn tokens the text may end with (not part of a call)
    template_markers: tuple[str, ...]  # any of these in a chat template selects this parser


# Order matters for detection: the more specific markers first.
TOOL_PARSERS: dict[str, ToolParser] = {
    spec.name: spec
    for spec in (
        ToolParser("gpt_oss", harmony.split_gpt_oss, "openai", ("<|endoftext|>",), ("<|channel|>",)),
        ToolParser(
            "kimi_k2",
            split_kimi_k2,
            "kimi",
            ("<|im_end|>", "[EOS]"),
            ("tool_calls_section_begin", "<|im_middle|>"),
        ),
        ToolParser("deepseek_v3", split_deepseek_v3, "openai", ("<｜end▁of▁sentence｜>",), ("tool▁calls▁begin",)),
        ToolParser("mistral", split_mistral, "mistral", ("</s>",), ("[TOOL_CALLS]",)),
        ToolParser(
            "llama3_json",
            split_llama3_json,
            "openai",
            ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
            ("<|python_tag|>", "ipython"),
        ),
        ToolParser("hermes", split_hermes, "openai", ("<|im_end|>", "<|endoftext|>"), ("<tool_call>",)),
    )
}

_ALL_END_MARKERS = tuple(dict.fromkeys(mark for spec in TOOL_PARSERS.values() for mark in spec.end_markers))
_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"
_MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")
_KIMI_ID = re.compile(r"^functions\.[^\s:]+:\d+$")


def make_call_id(style: CallIdStyle, index: int, *, name: str) -> str:
    """A deterministic call id for call number ``index`` (unique within the rollout if the index is).

    ``openai``: ``call_<index>``; ``mistral``: 9 alphanumerics (its template refuses any other);
    ``kimi``: ``functions.<name>:<index>``, the form Kimi K2 writes and its template renders.
    """
    if index < 0:
        raise ValueError(f"call index must be >= 0, got {index}")
    if style == "mistral":
        digits = ""
        rest = index
        while True:
            rest, digit = divmod(rest, 36)
            digits = _BASE36[digit] + digits
            if rest == 0:
                break
        if len(digits) > 5:
            raise ValueError(f"call index {index} does not fit a 9-character Mistral id")
        return "call" + digits.rjust(5, "0")
    if style == "kimi":
        return f"functions.{name}:{index}"
    return f"call_{index}"


def conform_call_id(style: CallIdStyle, call_id: str | None, index: int, *, name: str) -> str:
    """``call_id`` if the family's template accepts it, else ``make_call_id``'s id for ``index``."""
    valid = {"mistral": _MISTRAL_ID, "kimi": _KIMI_ID}.get(style)
    if call_id and (valid is None or valid.match(call_id)):
        return call_id
    return make_call_id(style, index, name=name)


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise UnknownParserError(kind="tool", name=name, known=tuple(TOOL_PARSERS))
    return TOOL_PARSERS[name]


def detect_tool_parser(chat_template: str) -> str | None:
    """The tool parser a chat template's own markers call for, or None if it shows no tool format."""
    for spec in TOOL_PARSERS.values():
        if any(marker in chat_template for marker in spec.template_markers):
            return spec.name
    return None


def parse_tool_calls(
    text: str,
    parser: str,
    tools: ToolSet | Sequence[Mapping[str, Any]] | None,
    *,
    first_call_index: int = 0,
) -> ParsedTurn:
    """Content, calls and malformed calls of ``text`` (reasoning only where the format has it)."""
    spec = get_tool_parser(parser)
    toolset = tools if isinstance(tools, ToolSet) else ToolSet.from_openai(tools)
    syntax = spec.split(strip_end_markers(text, spec.end_markers))
    calls: list[ToolCall] = []
    malformed: list[MalformedToolCall] = []
    for offset, candidate in enumerate(syntax.candidates):
        checked = _check(candidate, toolset, spec.call_id_style, first_call_index + offset, offset)
        if isinstance(checked, ToolCall):
            calls.append(checked)
        else:
            malformed.append(checked)
    return ParsedTurn(syntax.content, reasoning=syntax.reasoning, tool_calls=calls, malformed=malformed)


def parse_assistant_turn(
    text: str,
    *,
    tool_parser: str | None,
    reasoning_parser: str | None = None,
    tools: ToolSet | Sequence[Mapping[str, Any]] | None = None,
    first_call_index: int = 0,
    starts_in_reasoning: bool | None = None,
) -> ParsedTurn:
    """Reasoning first (calls written inside reasoning are thoughts, not calls), then tool calls.

    gpt-oss's harmony carries reasoning and calls in one message stream, so a turn read with the
    ``gpt_oss`` reasoning parser and no tool parser is still cut by harmony's channels.
    """
    reasoning = None
    rest = strip_end_markers(text, _ALL_END_MARKERS)
    if reasoning_parser is not None:
        split = split_reasoning(rest, reasoning_parser, starts_in_reasoning=starts_in_reasoning)
        reasoning, rest = split.reasoning, split.rest
    if tool_parser is None and reasoning_parser == "gpt_oss":
        tool_parser = "gpt_oss"
    if tool_parser is None:
        return ParsedTurn(content=rest.strip(), reasoning=reasoning)
    parsed = parse_tool_calls(rest, tool_parser, tools, first_call_index=first_call_index)
    merged = "\n".join(part for part in (reasoning, parsed.reasoning) if part) or reasoning
    return ParsedTurn(parsed.content, merged, tool_calls=parsed.tool_calls, malformed=parsed.malformed)


def strip_end_markers(text: str, markers: Sequence[str]) -> str:
    """``text`` without the end-of-turn tokens it ends with (the sampled eos is kept in the ids)."""
    trimmed = text
    while True:
        stripped = trimmed.rstrip()
        for marker in markers:
            if stripped.endswith(marker):
                trimmed = stripped[: -len(marker)]
                break
        else:
            return trimmed


def _check(
    candidate: CallCandidate, tools: ToolSet, style: CallIdStyle, call_index: int, position: int
) -> ToolCall | MalformedToolCall:
    call_id = conform_call_id(style, candidate.call_id, call_index, name=candidate.name or "unknown")
    if style == "kimi" and candidate.call_id:
        call_id = candidate.call_id  # Kimi's ids are returned unchanged, as the model wrote them

    def malformed(kind: MalformedKind, reason: str) -> MalformedToolCall:
        return MalformedToolCall(candidate.raw, reason, kind, name=candidate.name, id=call_id, index=position)

    if candidate.syntax_error is not None:
        return malformed("truncated" if candidate.truncated else "bad_json", candidate.syntax_error)
    name = candidate.name or ""
    if name not in tools.validators:
        declared = ", ".join(tools.names) or "none"
        return malformed("unknown_tool", f"unknown tool {name!r}; declared tools: {declared}")
    arguments = candidate.arguments
    were_string = isinstance(arguments, str)
    if were_string:
        try:
            arguments = json.loads(arguments)  # once: a string inside the string stays a string
        except json.JSONDecodeError as exc:
            return malformed("bad_arguments", f"arguments are a string that is not JSON: {exc.msg}")
    if not isinstance(arguments, dict):
        return malformed("bad_arguments", f"arguments must be a JSON object, got {type(arguments).__name__}")
    problem = tools.argument_problem(name, arguments)
    if problem is not None:
        return malformed("schema_mismatch", f"arguments do not match the schema of {name!r}: {problem}")
    return ToolCall(call_id, name, arguments, index=position, arguments_were_string=were_string)
