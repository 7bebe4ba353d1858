"""BusWatcher: the events a process that is no actor follows, on the path every actor's take.

Knows nats-py (through ``open_consumer``) and the dispatcher; nothing of Ray or of what a watcher's
owner does with the events. The CLI, a Serve replica, the metrics hub and a training job follow
events too: each subject they watch becomes a core ``Subscription`` handed to a
``MessageDispatcher``, as an actor's are, so every message gets its span (named after the subject
template), its canonical ``message_handled`` line, and one that does not decode is dead-lettered
(``consumer`` = the watcher's name) while the watcher goes on. Core subscriptions only: watching
never takes work off a queue or holds an ack. A callback that raises is logged and counted, never
raised; messages of one subject reach it in order, one at a time.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import nats.errors
import structlog
from nats.aio.client import Client

from rollmesh.bus.connection import flush_to_server
from rollmesh.bus.consumers import Consumer, open_consumer
from rollmesh.bus.dispatcher import MessageDispatcher
from rollmesh.bus.publisher import BusPublisher
from rollmesh.bus.task_set import TaskSet
from rollmesh.messages import Subject, WireMessage
from rollmesh.ports import MessageContext, Subscription

_log = structlog.get_logger("rollmesh.bus.watcher")

# How long ``close`` lets the events already received be handled before it cancels them.
DRAIN_TIMEOUT_S = 5.0


class BusWatcher:
    """Core subscriptions of one watcher on ``nc`` (which stays its owner's to close)."""

    def __init__(self, nc: Client, namespace: str, *, name: str,
                 on_dead_lettered: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.namespace = namespace
        self._nc = nc
        # Dead letters only: not retried through an outage as an actor's are, so a watcher whose
        # dead-letter stream is away (a bus without a mesh yet) logs the letter and goes on
        # rather than holding its subject's next events for a minute.
        self._publisher = BusPublisher(nc, nc.jetstream(), namespace, outage_retry_s=0.0)
        self._on_dead_lettered = on_dead_lettered
        self._tasks = TaskSet(f"watch:{name}")
        self._consumers: list[Consumer] = []

    async def __aenter__(self) -> BusWatcher:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def watch(self, subject: Subject, on_event: Callable[[Any], object]) -> None:
        """Follow ``subject``: ``on_event`` gets each decoded message (and is awaited when it
        returns an awaitable). Returns once the server has the subscription, so nothing
        published after this returns can slip past."""

        async def handle(message: WireMessage, context: MessageContext) -> None:
            handled = on_event(message)
            if inspect.isawaitable(handled):
                await handled

        dispatcher = MessageDispatcher(actor_name=self.name, subscription=Subscription(subject, handle, "core"),
                                       publisher=self._publisher, on_dead_lettered=self._on_dead_lettered)
        self._consumers.append(await open_consumer(self._nc, self._nc.jetstream(), self.namespace,
                                                   dispatcher, self._tasks))
        await flush_to_server(self._nc)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per subject template: received, handled, failed, dead_lettered."""
        return {consumer.dispatcher.subscription.subject.template: consumer.dispatcher.counters.as_dict()
                for consumer in self._consumers}

    async def close(self, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Stop watching. What the server sent before this call is handled first, for up to
        ``drain_timeout_s`` (0: stop at once); then what still runs is cancelled. Idempotent."""
        consumers, self._consumers = self._consumers, []
        if consumers and drain_timeout_s > 0:
            try:
                async with asyncio.timeout(drain_timeout_s):
                    await self._drain(consumers, drain_timeout_s)
            except TimeoutError:
                _log.warning("watcher_drain_timed_out", watcher=self.name, timeout_s=drain_timeout_s)
        for consumer in consumers:  # those not drained (a drained one's loop has ended already)
            if not consumer.loop.done():
                await consumer.unsubscribe()
        await self._tasks.close()

    async def _drain(self, consumers: list[Consumer], timeout_s: float) -> None:
        if not self._nc.is_closed:
            try:
                await flush_to_server(self._nc)  # everything sent to us so far is in our queues
            except (nats.errors.Error, TimeoutError):  # going away: drain what did arrive
                pass
        for consumer in consumers:
            await consumer.drain()
        await self._tasks.wait(timeout_s)
