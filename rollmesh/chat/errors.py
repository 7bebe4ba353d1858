"""Errors raised inside the chat package: model directories, template rendering, parsing, appending.

Knows nothing but the standard library. Foreign exceptions (OSError, json's, jinja2's, the
tokenizer's) are wrapped at the boundary with ``raise X(...) from exc``::

    ChatError                      root of every chat error
    +-- ModelDirectoryError        a model directory that cannot be used (path, reason)
    +-- TemplateRenderError        the chat template failed to render (reason, template_message:
                                   the vendor template's own raise_exception text, "" when the
                                   failure was not one the template raised itself)
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
