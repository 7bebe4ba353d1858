"""Riding out a NATS outage: retry an operation while the server is unreachable or electing.

Knows nats-py's errors and asyncio; nothing of our messages. A restarted nats-server, or a
JetStream cluster electing a new leader after losing a node, makes publishes and KV writes fail
for a few seconds; the caller's work is not lost if the operation is retried until the server is
back. Retries are safe because everything retried here is idempotent (JetStream publishes carry a
``Nats-Msg-Id``; a KV put of the same value twice leaves the same value).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
import structlog

_log = structlog.get_logger("rollmesh.bus.outage")
T = TypeVar("T")

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
# Errors that mean "the server is not there right now", as opposed to a refusal of the request.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError, nats.errors.StaleConnectionError,
    nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError,
    # A publish nobody answered: the stream's leader is being elected (a cluster lost a node).
    nats.js.errors.NoStreamResponseError,
    TimeoutError, ConnectionError,
)


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, TRANSIENT_ERRORS):
        return True
    # JetStream answers 503 (no leader yet, or the stream's peers are catching up) as an APIError.
    return isinstance(exc, nats.js.errors.APIError) and getattr(exc, "code", None) == 503


async def retry_through_outage(operation: Callable[[], Awaitable[T]], *, within_s: float, what: str,
                               clock: Callable[[], float] = time.monotonic) -> T:
    """``await operation()``, retried with backoff on transient errors for up to ``within_s``;
    the last error is raised when the time is up, and any other error at once."""
    deadline = clock() + within_s
    backoff = FIRST_BACKOFF_S
    attempt = 0
    while True:
        attempt += 1
        try:
            return await operation()
        except Exception as exc:
            if not is_transient(exc) or clock() + backoff > deadline:
                raise
            if attempt == 1:
                _log.warning("nats_unavailable_retrying", what=what, error=repr(exc), within_s=within_s)
        await asyncio.sleep(backoff)  # backoff between attempts, not a synchronization
        backoff = min(MAX_BACKOFF_S, backoff * 2)
