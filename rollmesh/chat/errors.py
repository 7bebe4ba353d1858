"""Errors raised inside the chat package: model directories, template rendering, parsing, appending.

Knows nothing but the standard library. Foreign exceptions (OSError, json's, jinja2's, the
tokenizer's) are wrapped at the boundary with ``raise X(...) from exc``::

    ChatError                      root of every chat error
    +-- ModelDirectoryError        a model directory that cannot be used (path, reason)
    +-- TemplateRenderError        the chat template failed to render (reason, template_message:
                                   the vendor template's own raise_exception text, "" when the
                                   failure was not one the template raised itself)
    +-- AppendError                a conversation's tokens cannot be extended (turn)
        +-- TruncatedTurnError     the last generated turn has no end-of-turn id (last_id): the
                                   rollout ends, nothing is appended after a broken turn
        +-- AppendOrderError       generated turns and appended messages out of order (reason)
    +-- JoinDerivationError        the template's text after a generated turn cannot be found in
                                   a stand-in render (reason, end_texts): the family needs a join rule
    +-- UnknownParserError         a tool or reasoning parser name not registered (kind, name, known)
    +-- InvalidToolDeclarationError  a declared tool that is no OpenAI function schema (tool_index,
                                   name, reason)
"""

from __future__ import annotations

from pathlib import Path


class ChatError(Exception):
    """Root of every chat error."""


class ModelDirectoryError(ChatError):
    """A Hugging Face model directory that cannot be loaded: not a directory, no tokenizer files,
    no chat template, an unreadable generation_config.json, a tokenizer that will not load."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"model directory {path}: {reason}")
        self.path = Path(path)
        self.reason = reason


class TemplateRenderError(ChatError):
    """The model's chat template did not render the conversation.

    ``template_message`` is what the template itself said through ``raise_exception`` (e.g.
    Mistral's "Tool call IDs should be alphanumeric strings with length 9!"), so callers can show
    the vendor's words; it is "" when rendering failed otherwise (a syntax error, a missing field).
    """

    def __init__(self, reason: str, *, template_message: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.template_message = template_message


class AppendError(ChatError):
    """A conversation's tokens cannot be extended at ``turn`` (generated turns so far)."""

    def __init__(self, message: str, *, turn: int) -> None:
        super().__init__(message)
        self.turn = turn


class TruncatedTurnError(AppendError):
    """Appending after a generated turn that ended without an end-of-turn id (cut by
    max_new_tokens): the rollout ends, no more turns run on a broken turn."""

    def __init__(self, *, turn: int, last_id: int | None) -> None:
        super().__init__(f"turn {turn} ended without an end-of-turn id (last id {last_id}); "
                         "nothing can be appended after a truncated turn", turn=turn)
        self.last_id = last_id


class AppendOrderError(AppendError):
    """Generated turns and appended messages must alternate, starting after the first prompt."""

    def __init__(self, *, turn: int, reason: str) -> None:
        super().__init__(f"turn {turn}: {reason}", turn=turn)
        self.reason = reason


class JoinDerivationError(ChatError):
    """What the template writes after a generated turn could not be derived from a stand-in render."""

    def __init__(self, *, reason: str, end_texts: tuple[str, ...]) -> None:
        super().__init__(f"cannot derive the template's text after a generated turn: {reason} "
                         f"(end-of-turn texts {list(end_texts)})")
        self.reason = reason
        self.end_texts = end_texts


class UnknownParserError(ChatError):
    """A tool (``kind="tool"``) or reasoning parser name that is not registered; ``known`` lists
    the names that are."""

    def __init__(self, *, kind: str, name: str, known: tuple[str, ...]) -> None:
        super().__init__(f"unknown {kind} parser {name!r}; known: {', '.join(known)}")
        self.kind = kind
        self.name = name
        self.known = known


class InvalidToolDeclarationError(ChatError):
    """A declared tool (number ``tool_index`` in the list) is not an OpenAI function schema, or its
    ``parameters`` are not a JSON Schema."""

    def __init__(self, *, tool_index: int, name: str | None, reason: str) -> None:
        super().__init__(f"tool {tool_index} ({name or 'unnamed'}): {reason}")
        self.tool_index = tool_index
        self.name = name
        self.reason = reason
