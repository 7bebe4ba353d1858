"""MessageDispatcher: one received NATS message -> one handler call, with everything around it.

Knows nats-py messages, OpenTelemetry, structlog and our ports; knows nothing of Ray or of any
role's logic. Per message: extract the trace context, open a span named after the subject
*template*, bind log context, decode; a message that does not decode goes to the dead-letter
subject and is settled (JetStream: term; request: an error reply when the reply type has
``error_kind``/``error``) so it never blocks the consumer. Handler exceptions are logged and
counted, and never escape: the consumer goes on. Every message ends in one canonical
``message_handled`` log line (outcome, duration, attempt, ids, trace ids): grep one line per
message instead of stitching several.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg
from opentelemetry import trace

from rollmesh.bus.message_keys import log_fields, message_tag
from rollmesh.ports import MessageContext, Subscription
from rollmesh.bus.publisher import BusPublisher
from rollmesh.messages import WireMessage
from rollmesh.telemetry.conventions import message_attributes
from rollmesh.telemetry.trace_headers import extract_trace_context

_log = structlog.get_logger("rollmesh.bus.dispatcher")
_tracer = trace.get_tracer("rollmesh.bus")

ACK_TIMEOUT_S = 5.0
# A handler's keepalive beats this many times per ack wait (MessageContext.keep_alive_while).
KEEPALIVES_PER_ACK_WAIT = 3
# error_kind values tried, in order, for an error reply; the reply type's Literal decides.
_INVALID_KINDS = ("invalid_request",)
_FAILURE_KINDS = ("internal_error", "backend_error")

# How a message ended, in its canonical log line.
HANDLED, FAILED, RETRYING, DEAD_LETTERED = "handled", "failed", "retrying", "dead_lettered"


@dataclass
class SubjectStats:
    received: int = 0
    handled: int = 0
    failed: int = 0
    dead_lettered: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class MessageDispatcher:
    """Dispatches the messages of one Subscription; ``counters`` is its running tally.

    ``max_deliver`` and ``ack_wait_s`` are the shell's defaults for JetStream subscriptions (the
    subscription's own win); ``on_dead_lettered`` hears the subject template of each message
    dead-lettered (a watcher's owner counts what it could not read).
    """

    def __init__(self, *, actor_name: str, subscription: Subscription, publisher: BusPublisher,
                 max_deliver: int = 1, ack_wait_s: float | None = None,
                 on_dead_lettered: Callable[[str], None] | None = None) -> None:
        self.actor_name = actor_name
        self.subscription = subscription
        self.publisher = publisher
        self.max_deliver = subscription.max_deliver or max_deliver
        ack_wait_s = subscription.ack_wait_s or ack_wait_s
        if subscription.mode == "jetstream" and ack_wait_s is None:
            raise ValueError(f"{subscription.subject.template}: a JetStream subscription needs an ack wait")
        self.ack_wait_s = ack_wait_s or 0.0
        self.on_dead_lettered = on_dead_lettered
        self.counters = SubjectStats()

    async def dispatch(self, msg: Msg) -> None:
        """Never raises (but lets cancellation through, after handing a JetStream message back)."""
        try:
            await self._dispatch(msg)
        except asyncio.CancelledError:
            if self.subscription.mode == "jetstream" and not msg.is_acked:
                # Shutting down mid-handler: hand the message back now rather than at ack_wait.
                await _quietly(msg.nak())
            raise
        except Exception as exc:  # the machinery around the handler (ack, DLQ) failed
            _log.error("dispatch_failed", actor=self.actor_name, subject=msg.subject,
                       error=repr(exc), exc_info=exc)

    async def _dispatch(self, msg: Msg) -> None:
        sub = self.subscription
        self.counters.received += 1
        headers = dict(msg.headers or {})
        attempt = msg.metadata.num_delivered if sub.mode == "jetstream" else 1
        with _tracer.start_as_current_span(
            sub.subject.template, context=extract_trace_context(headers),
            kind=trace.SpanKind.CONSUMER,
            attributes={"messaging.system": "nats", "messaging.destination.name": msg.subject,
                        "messaging.destination.template": sub.subject.template,
                        "messaging.operation.type": "process", "messaging.operation.name": "process",
                        "messaging.nats.delivery_attempt": attempt, "actor": self.actor_name},
        ) as span:
            span_context = span.get_span_context()
            # Tracing off (no provider): the span is a no-op with an all-zero id; log none.
            trace_id = f"{span_context.trace_id:032x}" if span_context.is_valid else ""
            with structlog.contextvars.bound_contextvars(
                actor=self.actor_name, subject=msg.subject, trace_id=trace_id
            ):
                started = time.perf_counter()
                try:
                    message = sub.subject.decode(msg.data)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    span.set_status(trace.StatusCode.ERROR, "undecodable message")
                    outcome = await self._reject(msg, f"undecodable {sub.subject.type.__name__}: {exc}")
                    self._log_canonical(outcome, started, attempt, message_type="")
                    return
                fields = log_fields(message)
                span.set_attributes(fields)  # type: ignore[arg-type]
                span.set_attributes(message_attributes(fields.get("rollout_id"), fields.get("weight_version")))
                with structlog.contextvars.bound_contextvars(**fields):
                    jetstream = sub.mode == "jetstream"
                    context = MessageContext(
                        subject=msg.subject, headers=headers, delivery_attempt=attempt,
                        trace_id=trace_id, trace_context=trace.set_span_in_context(span),
                        keepalive_every_s=self.ack_wait_s / KEEPALIVES_PER_ACK_WAIT if jetstream else None,
                        _progress=msg.in_progress if jetstream else None,
                    )
                    outcome = await self._handle(msg, message, context, span)
                    self._log_canonical(outcome, started, attempt, message_type=message_tag(message))

    def _log_canonical(self, outcome: str, started: float, attempt: int, *, message_type: str) -> None:
        """The one line per message (inside the span, so it carries the trace and span ids)."""
        _log.info("message_handled", outcome=outcome, subject_template=self.subscription.subject.template,
                  message_type=message_type, mode=self.subscription.mode, attempt=attempt,
                  duration_ms=round((time.perf_counter() - started) * 1000, 3))

    async def _handle(self, msg: Msg, message: WireMessage, context: MessageContext,
                      span: trace.Span) -> str:
        sub = self.subscription
        try:
            result = await sub.handler(message, context)
            reply = self._encode_reply(result) if sub.mode == "request" else None
        except Exception as exc:
            self.counters.failed += 1
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
            _log.error("handler_failed", attempt=context.delivery_attempt,
                       error=repr(exc), exc_info=exc)
            return await self._after_failure(msg, exc, context.delivery_attempt)
        if sub.mode == "jetstream":
            # Acked only now that the handler returned (its effects are durable), and
            # synchronously, so "acked" means the server recorded it.
            await msg.ack_sync(timeout=ACK_TIMEOUT_S)
        self.counters.handled += 1  # before replying: a caller that got the reply sees the count
        if reply is not None:
            await self._respond(msg, reply)
        return HANDLED

    async def _after_failure(self, msg: Msg, exc: Exception, attempt: int) -> str:
        sub = self.subscription
        if sub.mode == "request":
            await self._respond_error(msg, _FAILURE_KINDS, f"{type(exc).__name__}: {exc}")
        elif sub.mode == "jetstream":
            if attempt >= self.max_deliver:
                reason = f"handler failed on delivery {attempt}/{self.max_deliver}: {exc!r}"
                return await self._reject(msg, reason)
            await msg.nak(delay=sub.retry_delay_s)
            return RETRYING
        return FAILED

    async def _reject(self, msg: Msg, reason: str) -> str:
        """Dead-letter ``msg`` and settle it so it is not redelivered forever."""
        mode = self.subscription.mode
        _log.warning("message_dead_lettered", reason=reason, payload_size=len(msg.data))
        try:
            await self.publisher.publish_dead_letter(
                subject=msg.subject, consumer=self.actor_name, reason=reason, payload=msg.data
            )
        except Exception as exc:
            _log.error("dead_letter_publish_failed", error=repr(exc))
            if mode == "jetstream":
                # Not recorded anywhere yet: let JetStream redeliver rather than lose it.
                await msg.nak(delay=self.subscription.retry_delay_s)
                return RETRYING
        self.counters.dead_lettered += 1
        if self.on_dead_lettered is not None:
            self.on_dead_lettered(self.subscription.subject.template)
        if mode == "jetstream":
            await msg.term()
        elif mode == "request":
            await self._respond_error(msg, _INVALID_KINDS, reason)
        return DEAD_LETTERED

    def _encode_reply(self, result: WireMessage | None) -> bytes:
        if result is None:
            raise TypeError(f"{self.subscription.subject.template}: request handler returned None")
        return self.subscription.subject.encode_reply(result)

    async def _respond_error(self, msg: Msg, kinds: tuple[str, ...], text: str) -> None:
        reply = error_reply(self.subscription.subject.reply_type, kinds, text)
        if reply is None:
            _log.warning("no_error_reply_possible", reply_type=str(self.subscription.subject.reply_type))
            return
        await self._respond(msg, self.subscription.subject.encode_reply(reply))

    async def _respond(self, msg: Msg, data: bytes) -> None:
        if msg.reply:
            await self.publisher.respond(msg.reply, data)


def error_reply(reply_type: type[WireMessage] | None, kinds: tuple[str, ...],
                text: str) -> WireMessage | None:
    """A reply with ``error_kind`` set to the first of ``kinds`` its type accepts, else None.

    Goes through ``msgspec.convert`` because constructing a Struct does not check Literal fields,
    and an invalid kind would make the *caller's* decode fail.
    """
    if reply_type is None:
        return None
    fields = set(getattr(reply_type, "__struct_fields__", ()))
    if not {"error_kind", "error"} <= fields:
        return None
    for kind in kinds:
        try:
            return msgspec.convert({"error_kind": kind, "error": text[:2000]}, reply_type)
        except msgspec.ValidationError:
            continue
    return None


async def _quietly(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception as exc:
        _log.debug("settle_failed", error=repr(exc))
