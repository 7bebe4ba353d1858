"""BusPublisher: the one way actors emit messages (publish, request, dead-letter).

Knows nats-py, OpenTelemetry and our subjects; knows nothing of actors or Ray. Subjects captured by
a JetStream stream are published with an ack, so the effect is durable before ``publish``
returns (and ``publish`` returns the stream's ack), and carry a ``Nats-Msg-Id`` when the message
has a natural id (the server drops a repeat within the stream's duplicate window; the ack says so). A durable publish rides out a NATS outage (a restarted
server, a cluster electing a new leader): it is retried for up to ``outage_retry_s``, which the
dedup id makes safe. Everything else goes over core NATS. Every publish carries the current trace
context in W3C headers.
"""

from __future__ import annotations

import base64
import time

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck
from opentelemetry import trace

from rollmesh.bus.errors import (
    NoRespondersError,
    PublishError,
    ReplyDecodeError,
    RequestTimeoutError,
)
from rollmesh.bus.message_keys import dedup_id, log_fields
from rollmesh.bus.outage import retry_through_outage
from rollmesh.bus.streams import stream_for
from rollmesh.telemetry import conventions
from rollmesh.messages import DeadLettered, Subject, WireMessage
from rollmesh.messages.subjects import DEAD_LETTERED
from rollmesh.telemetry.trace_headers import inject_trace_headers

_log = structlog.get_logger("rollmesh.bus.publisher")
_tracer = trace.get_tracer("rollmesh.bus")

# A dead letter keeps the head of the payload for diagnosis, never the whole (maybe 1 MiB) thing.
DEAD_LETTER_PAYLOAD_BYTES = 1024


class BusPublisher:
    """Implements ``rollmesh.ports.Publisher`` over one NATS connection."""

    def __init__(self, nc: Client, js: JetStreamContext, namespace: str, *,
                 publish_timeout_s: float = 5.0, outage_retry_s: float = 60.0) -> None:
        self._nc = nc
        self._js = js
        self.namespace = namespace
        self.publish_timeout_s = publish_timeout_s
        self.outage_retry_s = outage_retry_s

    async def publish(self, subject: Subject, message: WireMessage) -> PubAck | None:
        concrete = subject.format(self.namespace)
        data = subject.encode(message)
        stream = stream_for(subject, self.namespace)
        with _tracer.start_as_current_span(
            f"publish {subject.template}", kind=trace.SpanKind.PRODUCER,
            attributes=_span_attributes(subject, concrete, "publish", message, len(data)),
        ):
            headers = inject_trace_headers({})
            if stream is None:
                await self._core_publish(concrete, data, headers)
                return None
            msg_id = dedup_id(message)
            if msg_id is not None:
                headers["Nats-Msg-Id"] = msg_id
            try:
                ack = await retry_through_outage(
                    lambda: self._js.publish(concrete, data, timeout=self.publish_timeout_s,
                                             stream=stream, headers=headers),
                    within_s=self.outage_retry_s, what=f"publish {subject.template}")
            except (nats.errors.Error, TimeoutError) as exc:
                raise PublishError(f"JetStream publish to {stream} failed: {exc!r}",
                                   subject=concrete) from exc
            if ack.duplicate:
                _log.info("publish_deduplicated", subject=concrete, msg_id=msg_id)
            return ack

    async def request(self, subject: Subject, message: WireMessage,
                      timeout_s: float) -> WireMessage:
        concrete = subject.format(self.namespace)
        data = subject.encode(message)
        with _tracer.start_as_current_span(
            f"request {subject.template}", kind=trace.SpanKind.CLIENT,
            attributes=_span_attributes(subject, concrete, "request", message, len(data)),
        ):
            try:
                reply = await self._nc.request(concrete, data, timeout=timeout_s,
                                               headers=inject_trace_headers({}))
            except nats.errors.NoRespondersError as exc:
                raise NoRespondersError(subject=concrete) from exc
            except (nats.errors.TimeoutError, TimeoutError) as exc:
                raise RequestTimeoutError(subject=concrete, timeout_s=timeout_s) from exc
            try:
                return subject.decode_reply(reply.data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ReplyDecodeError(str(exc), subject=concrete) from exc

    async def publish_dead_letter(self, *, subject: str, consumer: str, reason: str,
                                  payload: bytes) -> DeadLettered:
        """Publish a ``DeadLettered`` for an offending message on the ``rl.<ns>.dlq`` subject."""
        letter = DeadLettered(
            subject=subject, consumer=consumer, reason=reason[:2000],
            payload_b64=base64.b64encode(payload[:DEAD_LETTER_PAYLOAD_BYTES]).decode(),
            payload_size=len(payload), received_at=time.time(),
        )
        await self.publish(DEAD_LETTERED, letter)
        return letter

    async def respond(self, reply_to: str, data: bytes) -> None:
        """Send an already-encoded reply to a request's inbox, with the current trace context."""
        await self._core_publish(reply_to, data, inject_trace_headers({}))

    async def _core_publish(self, concrete: str, data: bytes, headers: dict[str, str]) -> None:
        try:
            await self._nc.publish(concrete, data, headers=headers or None)
        except nats.errors.Error as exc:
            raise PublishError(f"core publish failed: {exc!r}", subject=concrete) from exc


def _span_attributes(subject: Subject, concrete: str, operation: str, message: WireMessage,
                     size: int) -> dict[str, object]:
    """``messaging.*`` and ``rl.*`` attributes (docs/tracing.md); the bare ``rollout_id`` /
    ``weight_version`` keys are kept for readers of older trace files."""
    attributes: dict[str, object] = {
        conventions.MESSAGING_SYSTEM: conventions.MESSAGING_SYSTEM_NATS,
        conventions.MESSAGING_DESTINATION_NAME: concrete,
        conventions.MESSAGING_DESTINATION_TEMPLATE: subject.template,
        conventions.MESSAGING_OPERATION_TYPE: "send",
        conventions.MESSAGING_OPERATION_NAME: operation,
        conventions.MESSAGING_MESSAGE_BODY_SIZE: size,
    }
    fields = log_fields(message)
    attributes.update(fields)
    attributes.update(conventions.message_attributes(
        fields.get("rollout_id"), fields.get("weight_version")))  # type: ignore[arg-type]
    return attributes
