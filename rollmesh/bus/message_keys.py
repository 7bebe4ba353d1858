"""The ids a message carries that logs, spans and dedup care about.

Knows our wire contract only (duck-typed on field names, so new message types need no change here).
"""

from __future__ import annotations

from rollmesh.messages import WireMessage


def message_tag(message: WireMessage) -> str:
    return str(type(message).__struct_config__.tag)


def rollout_id_of(message: WireMessage) -> str | None:
    value = getattr(message, "rollout_id", None)
    return value if isinstance(value, str) and value else None


def weight_version_of(message: WireMessage) -> int | None:
    """``weight_version`` when the message has one; ``version`` for weight events; for a
    trajectory (per-token ``versions``, -1 where no weights generated the token), the version of
    its last generated token (None when it has none): its ``weight_version``, or, from a sender
    that predates that field, its inline TokenTrace's."""
    value = getattr(message, "weight_version", None)
    if value is None and message_tag(message).startswith("weights."):
        value = getattr(message, "version", None)
    if value is None or (value == -1 and hasattr(message, "token_trace")):
        value = _last_generated_version(_versions_of(message))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _versions_of(message: WireMessage) -> object:
    token_trace = getattr(message, "token_trace", None)
    if token_trace is None:
        return getattr(message, "versions", None)
    try:
        return token_trace().versions
    except (LookupError, ValueError):  # stored elsewhere, or broken: no version to log
        return None


def _last_generated_version(versions: object) -> int | None:
    """The last entry >= 0 of per-token weight versions (prompt and tool tokens carry -1)."""
    if not isinstance(versions, list):
        return None
    return next((v for v in reversed(versions) if isinstance(v, int) and v >= 0), None)


def dedup_id(message: WireMessage) -> str | None:
    """A ``Nats-Msg-Id`` for JetStream dedup, or None when the message has no natural id.

    The tag is part of the id because one stream holds several types (a completion and a failure
    of the same rollout must not dedup each other).
    """
    key = rollout_id_of(message)
    if key is None and message_tag(message).startswith("weights."):
        version = weight_version_of(message)
        key = None if version is None else str(version)
    return f"{message_tag(message)}:{key}" if key is not None else None


def log_fields(message: WireMessage) -> dict[str, object]:
    """``rollout_id`` / ``weight_version`` when present, for structlog and span attributes."""
    fields: dict[str, object] = {}
    rollout_id = rollout_id_of(message)
    if rollout_id is not None:
        fields["rollout_id"] = rollout_id
    weight_version = weight_version_of(message)
    if weight_version is not None:
        fields["weight_version"] = weight_version
    return fields
