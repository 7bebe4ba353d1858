"""A broker in this process, reached without a bus: for ``rollmesh sandbox run`` when no mesh is
running, and for plain-logic tests of the client and the broker together.

Knows the broker, the sandbox subjects and the ``Publisher`` port; not NATS. Every request and
reply still goes through its subject's encoder and decoder, so what works here cannot break on
the wire for a type or constraint reason.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from rollmesh.messages import Subject, WireMessage
from rollmesh.messages.subjects import (
    SANDBOX_DOWNLOAD,
    SANDBOX_EXEC,
    SANDBOX_FORK,
    SANDBOX_HEARTBEAT,
    SANDBOX_LEASE,
    SANDBOX_RELEASE,
    SANDBOX_SNAPSHOT,
    SANDBOX_UPLOAD,
)
from rollmesh.sandbox.broker import SandboxBroker


def broker_handlers(broker: SandboxBroker) -> dict[Subject, Callable[[Any], Awaitable[WireMessage]]]:
    """Each request subject and the broker method that answers it."""
    return {
        SANDBOX_LEASE: broker.lease,
        SANDBOX_EXEC: broker.exec,
        SANDBOX_UPLOAD: broker.upload,
        SANDBOX_DOWNLOAD: broker.download,
        SANDBOX_SNAPSHOT: broker.snapshot,
        SANDBOX_FORK: broker.fork,
        SANDBOX_HEARTBEAT: broker.heartbeat,
        SANDBOX_RELEASE: broker.release,
    }


class InProcessRequester:
    """Implements the ``request`` half of ``rollmesh.ports.Publisher`` by calling the broker."""

    def __init__(self, broker: SandboxBroker) -> None:
        self._handlers = broker_handlers(broker)

    async def request(self, subject: Subject, message: WireMessage, timeout_s: float) -> WireMessage:
        request = subject.decode(subject.encode(message))
        reply = await self._handlers[subject](request)
        return subject.decode_reply(subject.encode_reply(reply))

    async def publish(self, subject: Subject, message: WireMessage) -> None:
        raise TypeError(f"nothing is published in process ({subject.template})")


class OutputCallbackPublisher:
    """Implements ``publish`` of ``rollmesh.ports.Publisher`` for the broker's output chunks by
    handing each message to ``on_message``."""

    def __init__(self, on_message: Callable[[WireMessage], Awaitable[None] | None]) -> None:
        self._on_message = on_message

    async def publish(self, subject: Subject, message: WireMessage) -> None:
        result = self._on_message(subject.decode(subject.encode(message)))
        if result is not None:
            await result

    async def request(self, subject: Subject, message: WireMessage, timeout_s: float) -> WireMessage:
        raise TypeError(f"no requests from the broker ({subject.template})")
