"""The newest message a stream holds on one subject: how a restarted actor catches up on state
it missed while it was down (the current weight version, for an inference worker).

Knows nats-py's JetStream API and the streams layout; nothing of actors.
"""

from __future__ import annotations

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext

from rollmesh.bus.streams import stream_for
from rollmesh.messages import Subject, WireMessage

_log = structlog.get_logger("rollmesh.bus.last_message")


async def last_message(js: JetStreamContext, namespace: str, subject: Subject) -> WireMessage | None:
    """The newest ``subject`` message in its stream; None when there is none (or it does not
    decode: a catch-up is best effort, the live subscription carries on either way)."""
    stream = stream_for(subject, namespace)
    if stream is None:
        raise ValueError(f"{subject.template} is not captured by a stream")
    try:
        raw = await js.get_last_msg(stream, subject.format(namespace))
    except nats.js.errors.NotFoundError:
        return None
    except nats.errors.Error as exc:
        _log.warning("last_message_unavailable", subject=subject.template, error=repr(exc))
        return None
    try:
        return subject.decode(raw.data or b"")
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        _log.warning("last_message_undecodable", subject=subject.template, error=str(exc))
        return None
