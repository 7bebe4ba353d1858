"""What plain logic classes see of the mesh: Subscription, MessageContext, Publisher, ActorLogic.

Imports neither nats nor opentelemetry nor ray (only our wire contract, and structlog for the
keepalive's warnings), so domain packages (engine, rollout, training...) can depend on it without
depending on the bus, and unit tests can build a ``MessageContext`` by hand. The shell (``rollmesh.actors.shell``) turns these declarations
into real NATS subscriptions; ``rollmesh.bus.publisher.BusPublisher`` implements ``Publisher``.
Top-level rather than in ``bus/`` because domain packages must never import the bus.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar, runtime_checkable

import structlog

from rollmesh.messages import RolloutState, Subject, TokenTrace, WireMessage

SubscriptionMode = Literal["core", "jetstream", "request"]
_CONSUMER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,200}$")
_log = structlog.get_logger("rollmesh.ports")
T = TypeVar("T")


@dataclass
class MessageContext:
    """Where a message came from and how to keep its JetStream delivery alive.

    ``delivery_attempt`` is JetStream's num_delivered (1 on first delivery; always 1 for core and
    request mode). ``trace_context`` is the OpenTelemetry context of the message's span, typed
    loosely so this module need not import opentelemetry. ``keepalive_every_s`` is how often
    ``keep_alive_while`` says "still working": the dispatcher sets it to a third of the
    consumer's ack wait, so two beats may fail before the message is redelivered.
    """

    subject: str
    headers: Mapping[str, str] = field(default_factory=dict)
    delivery_attempt: int = 1
    trace_id: str = ""
    trace_context: object | None = None
    keepalive_every_s: float | None = None
    _progress: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)

    async def in_progress(self) -> None:
        """Tell JetStream the handler is still working (resets the ack deadline); no-op otherwise."""
        if self._progress is not None:
            await self._progress()

    async def keep_alive_while(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` and return its result, telling JetStream every
        ``keepalive_every_s`` meanwhile that the handler is still working (a tool may run for an
        hour; a group may wait for its step as long).

        A future is only waited on, never cancelled with this delivery (another delivery of the
        same message may be waiting on it too); a coroutine runs in the caller's task. A beat
        that fails (NATS away for a moment) is logged, and the next one tries again.
        """
        every_s = self.keepalive_every_s
        beats = (asyncio.create_task(self._beat(every_s), name=f"keepalive:{self.subject}")
                 if self._progress is not None and every_s else None)
        try:
            if asyncio.isfuture(awaitable):
                await asyncio.wait({awaitable})
                return awaitable.result()
            return await awaitable
        finally:
            if beats is not None:
                beats.cancel()
                await asyncio.gather(beats, return_exceptions=True)

    async def _beat(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)  # the keepalive's period, not synchronisation
            try:
                await self.in_progress()
            except Exception as exc:
                _log.warning("keepalive_failed", subject=self.subject, error=repr(exc))


Handler = Callable[[WireMessage, MessageContext], Awaitable[WireMessage | None]]


@dataclass(frozen=True)
class Subscription:
    """One subject a logic class consumes, and how.

    - ``core``: plain subscribe (queue group if ``queue``); at-most-once, for ephemeral events.
    - ``request``: like core, and the handler's return value is the reply
      (``subject.encode_reply``). Replicas always share a queue group (default: derived from the
      subject), so each request is answered once.
    - ``jetstream``: durable pull consumer on the stream capturing the subject; a message is acked
      only after the handler returned, nak'ed with ``retry_delay_s`` when it raised, and
      dead-lettered after ``max_deliver`` attempts (None: the shell's NatsConfig.max_deliver).
      Replicas of a role share ``durable`` (default: derived from the subject) and so share work.

    Return values of ``core``/``jetstream`` handlers are ignored: publish through the Publisher.
    """

    subject: Subject
    handler: Handler
    mode: SubscriptionMode
    queue: str | None = None
    durable: str | None = None
    max_concurrent: int = 1
    ack_wait_s: float | None = None
    retry_delay_s: float = 1.0
    max_deliver: int | None = None

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError(f"{self.subject.template}: max_concurrent must be >= 1")
        if self.mode == "request" and self.subject.reply_type is None:
            raise ValueError(f"{self.subject.template} has no reply type; cannot serve requests")
        if self.durable is not None and not _CONSUMER_NAME.match(self.durable):
            raise ValueError(f"invalid durable name {self.durable!r}: use [A-Za-z0-9_-]")
        if self.mode != "jetstream" and (self.durable or self.ack_wait_s or self.max_deliver):
            raise ValueError(f"{self.subject.template}: durable/ack_wait_s/max_deliver "
                             "only apply to jetstream mode")

    def durable_name(self) -> str:
        """``rl.{ns}.rollout.requested`` -> ``rollout_requested`` unless ``durable`` is set."""
        return self.durable or self._subject_token()

    def queue_group(self) -> str | None:
        """The queue group to subscribe with (None: every subscriber gets every message)."""
        if self.queue is None and self.mode == "request":
            return self._subject_token()
        return self.queue

    def _subject_token(self) -> str:
        tail = self.subject.template.removeprefix("rl.{ns}.")
        return re.sub(r"[^A-Za-z0-9_-]", "_", tail)


class RequestFailedError(Exception):
    """A ``Publisher.request`` got no usable reply (no responder, timeout, undecodable reply).

    The bus raises its own subclasses; logic catches this one and so never imports the bus.
    """


class PublishAck(Protocol):
    """What a stream answered a durable publish (nats-py's ``PubAck``): where it stored the
    message, and whether it dropped it as a repeat of one within its duplicate window."""

    stream: str
    seq: int
    duplicate: bool | None


@runtime_checkable
class Publisher(Protocol):
    """Emits messages on the bus. Implemented by ``rollmesh.bus.publisher.BusPublisher``."""

    async def publish(self, subject: Subject, message: WireMessage) -> PublishAck | None:
        """Encode and publish; returns once the message is durable when a stream captures it,
        with the stream's ack (None for a subject no stream captures)."""

    async def request(self, subject: Subject, message: WireMessage,
                      timeout_s: float) -> WireMessage:
        """Send a request and return the decoded reply (``subject.reply_type``); raises
        ``RequestFailedError`` when no usable reply comes."""


@runtime_checkable
class ActorLogic(Protocol):
    """A plain logic class the shell can serve.

    Optionally it also has ``async start()``, ``async stop()`` and ``stats() -> dict``; the shell
    calls them when present.
    """

    def subscriptions(self) -> list[Subscription]: ...



class StateStoreError(Exception):
    """The rollout-state store could not be read or written (the bus raises subclasses)."""


@runtime_checkable
class RolloutStateStore(Protocol):
    """Where rollouts keep their resumable state, one key per rollout id.

    Implemented over the JetStream KV bucket by ``rollmesh.bus.rollout_states.KvRolloutStates``;
    ``rollmesh.rollout.saved_state.InMemoryRolloutStates`` serves in-process runs and tests.
    """

    async def load(self, rollout_id: str) -> RolloutState | None:
        """The saved state, or None when the rollout never saved one."""

    async def save(self, state: RolloutState) -> None:
        """Durably store ``state``; returns once the store acknowledged it."""

    async def delete(self, rollout_id: str) -> None:
        """Forget a rollout's state (missing keys are fine)."""


@runtime_checkable
class RoutedExpertsStore(Protocol):
    """Where MoE rollouts keep their routed-expert rows, one blob per turn (see
    ``rollmesh.routed_expert_rows``); ``rows`` are numpy arrays, typed loosely here."""

    async def save_turn(self, rollout_id: str, turn: int, start: int, rows: object) -> str:
        """Durably store one turn's rows (a retried turn replaces its blob); returns the
        rollout's reference, the same for all its turns."""

    async def load(self, ref: str) -> object:
        """Every row of the rollout, joined in position order."""


class TrajectoryLostError(LookupError):
    """The trajectory at ``ref`` is gone (expired, deleted) or does not decode (``reason``).
    Retrying cannot help, unlike a ``StateStoreError``."""

    def __init__(self, ref: str, reason: str = "no stored trajectory") -> None:
        super().__init__(f"{reason} at {ref!r}")
        self.ref = ref
        self.reason = reason


@runtime_checkable
class TrajectoryStore(Protocol):
    """Where long rollouts keep their TokenTrace when it is too large to travel inline (see
    ``rollmesh.rollout.trajectory_offload``); a reference is "<bucket>/<object name>"."""

    async def save(self, rollout_id: str, name: str, trace: TokenTrace) -> str:
        """Durably store ``trace`` as the rollout's object ``name`` (replacing one of that name);
        returns its reference."""

    async def load(self, ref: str) -> TokenTrace:
        """The stored trace; ``TrajectoryLostError`` when there is none (or it is unreadable),
        ``StateStoreError`` when the store cannot be read now."""

    async def delete(self, ref: str) -> None:
        """Forget a stored trace (a missing one is fine)."""

