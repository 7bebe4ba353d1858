"""Consumers: turn one ``Subscription`` into a live NATS subscription and its receive loop.

Knows nats-py (core subscriptions, JetStream pull consumers) and the streams layout; knows nothing
of Ray or of a role's logic. Each loop hands messages to a ``MessageDispatcher`` in tasks owned by
the caller's ``TaskSet``, never more than ``max_concurrent`` at once. A JetStream loop only fetches
as many messages as it has free slots, so no message waits locally while its ack deadline runs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from rollmesh.bus.dispatcher import MessageDispatcher
from rollmesh.bus.streams import stream_for
from rollmesh.bus.task_set import TaskSet

_log = structlog.get_logger("rollmesh.bus.consumers")

# A pull request lingers on the server this long; short, so one orphaned by a stop or a
# reconnect holds a message back (until ack_wait) only briefly.
FETCH_TIMEOUT_S = 2.0
FETCH_ERROR_BACKOFF_S = 0.5


@dataclass
class Consumer:
    """A live subscription and the task that reads it."""

    dispatcher: MessageDispatcher
    nats_subscription: Any  # core Subscription or JetStreamContext.PullSubscription
    loop: asyncio.Task[None]

    async def unsubscribe(self) -> None:
        self.loop.cancel()
        try:
            await self.nats_subscription.unsubscribe()
        except (nats.errors.Error, ValueError) as exc:  # connection already closing
            _log.debug("unsubscribe_failed", error=repr(exc))

    async def drain(self) -> None:
        """Core subscriptions: stop intake once every message already received is taken in (its
        dispatch is a task of the caller's ``TaskSet``); the loop then ends by itself."""
        try:
            await self.nats_subscription.drain()
        except (nats.errors.Error, ValueError) as exc:  # connection closing: nothing more comes
            _log.debug("drain_failed", error=repr(exc))
            await self.unsubscribe()


async def open_consumer(nc: Client, js: JetStreamContext, namespace: str,
                        dispatcher: MessageDispatcher, tasks: TaskSet) -> Consumer:
    sub = dispatcher.subscription
    concrete = sub.subject.format(namespace)
    if sub.mode == "jetstream":
        stream = stream_for(sub.subject, namespace)
        if stream is None:
            stream = await js.find_stream_name_by_subject(concrete)
        durable = sub.durable_name()
        config = ConsumerConfig(
            durable_name=durable, ack_policy=AckPolicy.EXPLICIT, filter_subject=concrete,
            max_deliver=dispatcher.max_deliver, ack_wait=dispatcher.ack_wait_s,
        )
        pull = await js.pull_subscribe(concrete, durable=durable, stream=stream, config=config)
        loop = tasks.spawn(_pull_loop(pull, dispatcher, tasks), name=f"pull:{concrete}")
        _log.debug("consumer_opened", subject=concrete, mode="jetstream", stream=stream,
                   durable=durable)
        return Consumer(dispatcher, pull, loop)
    queue = sub.queue_group()
    core = await nc.subscribe(concrete, queue=queue or "")
    loop = tasks.spawn(_core_loop(core, dispatcher, tasks), name=f"sub:{concrete}")
    _log.debug("consumer_opened", subject=concrete, mode=sub.mode, queue=queue)
    return Consumer(dispatcher, core, loop)


async def _core_loop(core: NatsSubscription, dispatcher: MessageDispatcher,
                     tasks: TaskSet) -> None:
    slots = asyncio.Semaphore(dispatcher.subscription.max_concurrent)
    async for msg in core.messages:
        await slots.acquire()
        tasks.spawn(_dispatch_then_release(dispatcher, msg, slots), name=f"msg:{msg.subject}")


async def _pull_loop(pull: JetStreamContext.PullSubscription, dispatcher: MessageDispatcher,
                     tasks: TaskSet) -> None:
    slots = asyncio.Semaphore(dispatcher.subscription.max_concurrent)
    while True:
        await slots.acquire()
        free = 1
        while not slots.locked():  # take every other free slot too: one fetch for all of them
            await slots.acquire()
            free += 1
        try:
            msgs = await pull.fetch(free, timeout=FETCH_TIMEOUT_S)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            msgs = []
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # disconnected, consumer deleted...: retry, never die
            _log.warning("fetch_failed", subject=dispatcher.subscription.subject.template,
                         error=repr(exc))
            msgs = []
            await asyncio.sleep(FETCH_ERROR_BACKOFF_S)  # backoff, not synchronization
        for _ in range(free - len(msgs)):
            slots.release()
        for msg in msgs:
            tasks.spawn(_dispatch_then_release(dispatcher, msg, slots), name=f"msg:{msg.subject}")


async def _dispatch_then_release(dispatcher: MessageDispatcher, msg: Any,
                                 slots: asyncio.Semaphore) -> None:
    try:
        await dispatcher.dispatch(msg)
    finally:
        slots.release()
