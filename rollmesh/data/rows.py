"""One dataset row mapped to what a stage uses: chat messages, the answer, tools and metadata.

The stage's ``fields`` (``FieldMap``) say which column holds each field, as slime's
``--input-key``; what a row must hold depends on the stage's kind:

- ``rl``: ``messages`` (OpenAI chat messages, not ending with an assistant message) or ``prompt``
  (a string: one user message); ``answer`` (else ``label``), ``tools`` and ``metadata`` if given.
- ``sft``: ``messages`` with at least one assistant message; ``tools`` and ``metadata`` if given.
- ``midtrain``: raw text, in the column ``fields.prompt`` names; nothing else is read.

A field that is null counts as absent (Parquet and ``datasets`` tables give every row every
column). Knows row shapes; nothing of files, tokenizers or chat templates (a template can still
refuse a row's messages later: that is its caller's bad row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from rollmesh.data.errors import BadRowError, json_type
from rollmesh.run_config import FieldMap, StageKind

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class PromptRow:
    """A row as a stage reads it. ``messages`` are OpenAI chat messages (copies: appending to them
    leaves ``raw`` as read); ``prompt_text`` is the prompt when the row gave it as a string (for
    ``midtrain``, the text to train on, and ``messages`` is empty); ``answer`` is a string or None."""

    messages: list[dict[str, Any]]
    prompt_text: str | None = None
    answer: str | None = None
    tools: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)


def map_row(raw: dict[str, Any], fields: FieldMap, *, kind: StageKind, path: Path | str,
            row: int) -> PromptRow:
    """``raw`` as a ``kind`` stage reads it; BadRowError (naming ``path`` and ``row``, the row's
    1-based number in its file) when a field it needs is missing or of the wrong type."""
    check = _RowCheck(raw, Path(path), row)
    if kind == "midtrain":
        text = check.string(fields.prompt, "prompt")
        return PromptRow(messages=[], prompt_text=text, raw=raw)
    if kind == "sft":
        if not check.present(fields.messages):
            check.fail(f"no {fields.messages!r} field (fields.messages): an sft row is a chat")
        messages = check.messages(fields.messages)
        if not any(message["role"] == "assistant" for message in messages):
            check.fail(f"{fields.messages!r} has no assistant message to train on (fields.messages)")
        return PromptRow(messages=messages, tools=check.tools(fields.tools),
                         metadata=check.metadata(fields.metadata), raw=raw)
    if kind != "rl":
        raise ValueError(f"unknown stage kind {kind!r}")
    prompt_text = None
    if check.present(fields.messages):
        messages = check.messages(fields.messages)
        if messages[-1]["role"] == "assistant":
            check.fail(f"{fields.messages!r} ends with an assistant message: an rl row is a prompt "
                       "for the model to answer (fields.messages)")
    elif check.present(fields.prompt):
        prompt_text = check.string(fields.prompt, "prompt")
        messages = [{"role": "user", "content": prompt_text}]
    else:
        check.fail(f"no {fields.prompt!r} field (fields.prompt) and no {fields.messages!r} field "
                   "(fields.messages)")
    return PromptRow(messages=messages, prompt_text=prompt_text, answer=check.answer(fields),
                     tools=check.tools(fields.tools), metadata=check.metadata(fields.metadata),
                     raw=raw)


class _RowCheck:
    """Reads fields out of one raw row, raising BadRowError at the first one that does not fit."""

    def __init__(self, raw: dict[str, Any], path: Path, row: int) -> None:
        self.raw, self.path, self.row = raw, path, row

    def fail(self, reason: str) -> NoReturn:
        raise BadRowError(self.path, self.row, reason)

    def present(self, column: str) -> bool:
        return self.raw.get(column) is not None

    def string(self, column: str, key: str) -> str:
        if not self.present(column):
            self.fail(f"no {column!r} field (fields.{key})")
        value = self.raw[column]
        if not isinstance(value, str):
            self.fail(f"{column!r} is {json_type(value)}, not a string (fields.{key})")
        if not value.strip():
            self.fail(f"{column!r} is an empty string (fields.{key})")
        return value

    def messages(self, column: str) -> list[dict[str, Any]]:
        value = self.raw[column]
        if not isinstance(value, list) or not value:
            what = "an empty list" if isinstance(value, list) else json_type(value)
            self.fail(f"{column!r} is {what}, not a list of chat messages (fields.messages)")
        return [self._message(column, i, message) for i, message in enumerate(value)]

    def _message(self, column: str, i: int, message: object) -> dict[str, Any]:
        where = f"{column!r}[{i}]"
        if not isinstance(message, dict):
            self.fail(f"{where} is {json_type(message)}, not a message object (fields.messages)")
        role = message.get("role")
        if role not in ROLES:
            self.fail(f"{where}: role {role!r} is not one of {', '.join(ROLES)} (fields.messages)")
        content = message.get("content")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and (role != "assistant" or not isinstance(tool_calls, list)
                                       or not all(isinstance(call, dict) for call in tool_calls)):
            self.fail(f"{where}: tool_calls must be a list of objects on an assistant message "
                      "(fields.messages)")
        # OpenAI's content is a string or a list of parts ({"type": "text", "text": ...}); only
        # an assistant message that calls tools may have none.
        if content is None and not (role == "assistant" and tool_calls):
            self.fail(f"{where}: a {role} message without content (fields.messages)")
        if content is not None and not isinstance(content, (str, list)):
            self.fail(f"{where}: content is {json_type(content)}, not a string or a list of parts "
                      "(fields.messages)")
        if isinstance(content, list) and not all(isinstance(part, dict) for part in content):
            self.fail(f"{where}: content parts must be objects (fields.messages)")
        return dict(message)

    def answer(self, fields: FieldMap) -> str | None:
        for column, key in ((fields.answer, "answer"), (fields.label, "label")):
            if not self.present(column):
                continue
            value = self.raw[column]
            if isinstance(value, str):
                return value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            self.fail(f"{column!r} is {json_type(value)}, not a string or a number (fields.{key})")
        return None

    def tools(self, column: str) -> list[dict[str, Any]] | None:
        if not self.present(column):
            return None
        value = self.raw[column]
        if not isinstance(value, list):
            self.fail(f"{column!r} is {json_type(value)}, not a list of tool schemas (fields.tools)")
        for i, tool in enumerate(value):
            if (not isinstance(tool, dict) or tool.get("type") != "function"
                    or not isinstance(tool.get("function"), dict)):
                self.fail(f"{column!r}[{i}] is not {{\"type\": \"function\", \"function\": {{...}}}} "
                          "(fields.tools)")
            name = tool["function"].get("name")
            if not isinstance(name, str) or not name:
                self.fail(f"{column!r}[{i}]: function.name must be a non-empty string (fields.tools)")
        # No tools and an empty list render differently in some templates: [] means none.
        return value or None

    def metadata(self, column: str) -> dict[str, Any]:
        if not self.present(column):
            return {}
        value = self.raw[column]
        if not isinstance(value, dict):
            self.fail(f"{column!r} is {json_type(value)}, not an object (fields.metadata)")
        return value

