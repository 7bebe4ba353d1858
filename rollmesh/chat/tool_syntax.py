"""What a tool-call format module hands back: the syntax of one assistant turn, before meaning.

A format module (``tool_format_*.py``) only cuts the text into content and candidate calls, each
with its exact raw text, the name and arguments as written, and the call id when the format carries
one. Whether a name is a declared tool, whether arguments decode and match the schema, and which id
a call gets are decided once for every format in ``tool_calls.py``. Knows text, not tokenizers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class CallCandidate:
    """One call as written. ``syntax_error`` is set when the text is not a complete call."""

    raw: str
    name: str | None = None
    arguments: Any = None
    call_id: str | None = None
    syntax_error: str | None = None
    truncated: bool = False


@dataclass(frozen=True)
class TurnSyntax:
    """A turn cut into content and candidate calls, in the order they were written."""

    content: str
    candidates: list[CallCandidate] = field(default_factory=list)
    reasoning: str | None = None


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def decode_json_at(text: str, pos: int) -> tuple[Any, int]:
    """Decode one JSON value starting at ``pos`` (after whitespace); returns (value, end).

    A string-aware decoder rather than a regex up to the closing tag, so an argument value that
    contains the closing tag itself does not cut the call short. Raises ``json.JSONDecodeError``.
    """
    return _DECODER.raw_decode(text, skip_whitespace(text, pos))


def join_content(parts: list[str]) -> str:
    """Content pieces around the calls, each stripped, empty ones dropped, joined by a newline."""
    return "\n".join(piece.strip() for piece in parts if piece.strip())


def split_marked_calls(
    text: str,
    first: int,
    *,
    call_begin: str,
    call_end: str,
    read_call: Callable[[str, str], CallCandidate],
    section_markers: tuple[str, ...] = (),
) -> TurnSyntax:
    """A turn whose calls, from ``first`` on, each sit between ``call_begin`` and ``call_end``
    (DeepSeek V3, Kimi K2). ``read_call(raw, body)`` reads one call; a call the turn ended inside
    is a truncated candidate. Content: the text before ``first`` and after the last call, without
    the ``section_markers`` that enclose the calls."""
    candidates: list[CallCandidate] = []
    pos = first
    while (start := text.find(call_begin, pos)) != -1:
        end = text.find(call_end, start)
        if end == -1:
            reason = "the turn ended inside a tool call"
            candidates.append(CallCandidate(raw=text[start:], syntax_error=reason, truncated=True))
            pos = len(text)
            break
        candidates.append(read_call(text[start : end + len(call_end)], text[start + len(call_begin) : end]))
        pos = end + len(call_end)
    after = text[pos:]
    for marker in section_markers:
        after = after.replace(marker, "")
    return TurnSyntax(content=join_content([text[:first], after]), candidates=candidates)


def call_with_json_arguments(raw: str, name: str, arguments_text: str, *, call_id: str | None = None) -> CallCandidate:
    """A call whose arguments text is exactly one JSON value (whitespace around it allowed)."""
    try:
        arguments, end = decode_json_at(arguments_text, 0)
    except json.JSONDecodeError as exc:
        reason = f"invalid JSON arguments: {exc.msg}"
        return CallCandidate(raw=raw, name=name, call_id=call_id, syntax_error=reason)
    if skip_whitespace(arguments_text, end) != len(arguments_text):
        reason = "text after the JSON arguments"
        return CallCandidate(raw=raw, name=name, call_id=call_id, syntax_error=reason)
    return CallCandidate(raw=raw, name=name, arguments=arguments, call_id=call_id)


def call_from_object(raw: str, obj: Any, *, arguments_keys: tuple[str, ...]) -> CallCandidate:
    """A ``{"name": ..., "arguments": ...}`` object (the key spelling varies by family)."""
    if not isinstance(obj, dict):
        reason = f"a tool call must be a JSON object, got {type(obj).__name__}"
        return CallCandidate(raw=raw, syntax_error=reason)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return CallCandidate(raw=raw, syntax_error='the call has no "name" string')
    present = [key for key in arguments_keys if key in obj]
    if len(present) > 1:
        reason = f"the call has both {present[0]!r} and {present[1]!r}"
        return CallCandidate(raw=raw, name=name, syntax_error=reason)
    # A call without arguments is a call with none, as the OpenAI API spells it ({}).
    arguments = obj[present[0]] if present else {}
    call_id = obj.get("id") if isinstance(obj.get("id"), str) else None
    return CallCandidate(raw=raw, name=name, arguments=arguments, call_id=call_id)


def json_was_cut(fragment: str) -> bool:
    """Whether ``fragment`` reads as JSON that stops early (an open string, object or array).

    Tells a turn cut by max_new_tokens from JSON the model wrote wrongly; it tracks brackets and
    strings only, so a fragment that is both wrong and cut counts as cut.
    """
    closers = {"{": "}", "[": "]"}
    expected: list[str] = []
    in_string = escaped = False
    for char in fragment:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in closers:
            expected.append(closers[char])
        elif char in "}]":
            if not expected or expected.pop() != char:
                return False
            if not expected:
                return False  # a whole value ended: what went wrong is not the cut
    return in_string or bool(expected)


def arguments_json(arguments: Any, *, as_string: bool = False) -> str:
    """A call's arguments as a model writes them: JSON, or (``as_string``) that JSON inside a
    JSON string, as models sometimes write them and as OpenAI's wire form carries them."""
    text = json.dumps(arguments, ensure_ascii=False)
    return json.dumps(text, ensure_ascii=False) if as_string else text
