"""Does a session turn's ``messages`` extend the session's conversation? And what is new in it.

Knows the HTTP message shape only; not the store, Ray or the engine. A client that runs its own
agent loop sends, each turn, the whole conversation: the session's earlier messages, the assistant
message the server returned (echoed as the client holds it), then the new messages (tool results,
user turns). The comparison is semantic, as clients re-send what they were given in their own
form:

- ``content: null`` and ``""`` are the same (the ``openai`` client sends null beside calls);
- a call's ``arguments`` are compared as the JSON object they hold (a JSON string or an object);
- ``reasoning_content`` the client leaves out matches any (harnesses drop it); one it sends must
  be the server's;
- everything else (role, text, call ids and names, ``tool_call_id``, ``name``) must be equal.

Anything else (an edited or dropped message, a history shorter than the session's, no new
message, or an assistant message among the new ones: a session's assistant turns are the ones its
server generated) is a ``SessionHistoryError`` naming the first offending message, which the
caller answers with a 400: the trajectory is never silently built on a different history.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rollmesh.serve_apps.errors import ServeError
from rollmesh.serve_apps.http_shapes import ChatMessage


class SessionHistoryError(ServeError, ValueError):
    """The request's messages do not extend the session's; ``index``: the first message at fault."""

    def __init__(self, reason: str, *, index: int) -> None:
        super().__init__(f"messages.{index}: {reason}")
        self.reason = reason
        self.index = index


def new_messages(session: Sequence[Mapping[str, Any]], request: Sequence[ChatMessage]) -> list[ChatMessage]:
    """The request's messages after the session's (``session``: its messages in OpenAI form,
    the last answer included); raises ``SessionHistoryError``."""
    for index, (held, sent) in enumerate(zip(session, request)):
        held_form = comparable(ChatMessage.model_validate(held))
        sent_form = comparable(sent)
        if sent_form.get("reasoning_content") is None:
            held_form.pop("reasoning_content", None)
            sent_form.pop("reasoning_content", None)
        if held_form != sent_form:
            differing = sorted(key for key in held_form.keys() | sent_form.keys()
                               if held_form.get(key) != sent_form.get(key))
            raise SessionHistoryError(
                f"differs from the session's message in {', '.join(differing)}: a session's history "
                "cannot be edited (start a new session for a different history)", index=index)
    if len(request) <= len(session):
        raise SessionHistoryError(
            f"the session holds {len(session)} messages; a turn sends them all, then at least one "
            f"new one (got {len(request)} in all)", index=len(request) - 1 if request else 0)
    added = list(request[len(session):])
    for offset, message in enumerate(added):
        if message.role == "assistant":
            raise SessionHistoryError(
                "an assistant message among the new ones: a session's assistant turns are the ones "
                "its server generated", index=len(session) + offset)
    return added


def comparable(message: ChatMessage) -> dict[str, Any]:
    """The message in a form where what the module docstring calls the same compares equal."""
    form: dict[str, Any] = {"role": message.role, "content": message.content or ""}
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = getattr(message, key)
        if value is not None:
            form[key] = value
    if message.tool_calls:
        form["tool_calls"] = [(call.id, call.function.name, _arguments(call.function.arguments))
                              for call in message.tool_calls]
    return form


def _arguments(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments  # not JSON: compared as written (and refused as arguments later)
