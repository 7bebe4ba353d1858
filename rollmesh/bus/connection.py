"""Connecting to NATS: one client per actor, reconnecting forever.

Knows nats-py and structlog; knows nothing of streams, subjects or Ray. A NATS restart must not
kill an actor, so reconnection never gives up; every connection event is logged with the URL's
credentials redacted. With ``credentials`` the connection authenticates as a role (its secrets
are read here, never logged) and uses the role's reply inbox; with ``tls`` it speaks TLS.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Awaitable

import nats
import structlog
from nats.aio.client import Client

from rollmesh.bus.errors import BusConnectError, BusTlsError
from rollmesh.bus.security import BusCredentials
from rollmesh.telemetry.redaction import redact_url

_log = structlog.get_logger("rollmesh.bus.connection")

RECONNECT_WAIT_S = 0.5


async def connect_bus(url: str, *, name: str, connect_timeout_s: float = 5.0,
                      credentials: BusCredentials | None = None,
                      tls: ssl.SSLContext | None = None) -> Client:
    """Connect to ``url`` (comma-separated for a cluster), reconnecting forever afterwards.

    The first connection is retried until ``connect_timeout_s`` has passed, then
    ``BusConnectError`` is raised (with the last refusal, e.g. an authorization violation): a
    wrong URL or wrong credentials at startup must fail, not hang.
    """
    safe_url = redact_url(url)
    connected = False
    last_error: list[str] = []
    # The server refused the credentials, or the TLS handshake failed: retrying cannot help, so
    # the first connect stops at once.
    refused = asyncio.Event()
    tls_failure: list[ssl.SSLError] = []
    auth = credentials.connect_options() if credentials is not None else {}
    if tls is not None:
        auth["tls"] = tls

    def log(level: str, event: str, **fields: object) -> None:
        # Looked up per call (not bound once): these callbacks outlive any logging setup order.
        getattr(_log, level)(event, actor=name, url=safe_url, **fields)

    async def on_error(exc: Exception) -> None:
        # Before the first connection every refused attempt would log; the final error says it.
        text = redact_url(str(exc)) or type(exc).__name__
        if not refused.is_set():  # a refusal stays the reason, whatever the retries meet after it
            last_error[:] = [text]
        if not connected and _is_tls_failure(exc) and not refused.is_set():
            tls_failure.append(exc)
            refused.set()
        if not connected and _is_refusal(text):
            refused.set()
        log("warning" if connected else "debug", "nats_error", error=text,
            error_type=type(exc).__name__)

    async def on_disconnected() -> None:
        # Our own close() also reports a disconnect; only an unexpected one is a warning.
        log("warning" if connected and not nc.is_closed else "debug", "nats_disconnected")

    async def on_reconnected() -> None:
        server = nc.connected_url.geturl() if nc.connected_url else ""
        log("info", "nats_reconnected", server=redact_url(str(server)))

    async def on_closed() -> None:
        log("info", "nats_closed")

    nc = Client()
    try:
        # max_reconnect_attempts=-1 also makes nats-py retry the *first* connect forever, so the
        # startup deadline is enforced here.
        await _first_connect(nc.connect(
            servers=[part.strip() for part in url.split(",") if part.strip()],
            name=name,
            connect_timeout=connect_timeout_s,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=RECONNECT_WAIT_S,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            closed_cb=on_closed,
            **auth,
        ), refused, timeout_s=connect_timeout_s)
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        await nc.close()
        if tls_failure:
            raise _tls_error(tls_failure[0], safe_url) from tls_failure[0]
        if refused.is_set():
            reason = f"the server refused the credentials ({last_error[0]})"
        else:
            reason = redact_url(str(exc)) or f"not connected within {connect_timeout_s}s"
            if last_error and last_error[0] not in reason:
                reason = f"{reason} (last error: {last_error[0]})"
        raise BusConnectError(f"cannot connect: {reason}", url=safe_url) from exc
    connected = True
    log("debug", "nats_connected")
    return nc


async def flush_to_server(nc: Client) -> None:
    """Return once the server has processed every command given to ``nc`` so far (a SUB is
    active, a PUB delivered). nats-py's ``flush()`` alone is no such barrier: it writes its PING
    straight to the socket, ahead of the commands still waiting in its pending buffer for the
    flusher task. Under CPU load the PONG came back before the SUB was even sent, and the first
    message published after it never reached the new subscription. So the pending buffer is
    written out first (nats-py has no public call for that), and the PING follows it."""
    await nc._flush_pending(force_flush=True)
    await nc.flush()


# What nats-server says when it refuses a connection's credentials or its TLS identity.
_REFUSALS = ("authorization violation", "authentication", "user authentication expired")


def _is_refusal(text: str) -> bool:
    lowered = text.lower()
    return any(refusal in lowered for refusal in _REFUSALS)


def _is_tls_failure(exc: BaseException) -> bool:
    """A handshake that failed for good: the server's certificate was not verified, or the
    server refused ours. A TLS connection cut short (EOF) may be a server going away; that is
    retried like any lost connection."""
    return isinstance(exc, ssl.SSLError) and not isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError))


def _tls_error(failure: ssl.SSLError, url: str) -> BusTlsError:
    """The ssl module's error in a few words: "certificate verify failed: unable to get local
    issuer certificate" (ours), or the server's alert ("tlsv13 alert certificate required")."""
    verify_failed = isinstance(failure, ssl.SSLCertVerificationError)
    if verify_failed and failure.verify_message:
        reason = f"certificate verify failed: {failure.verify_message}"
    else:
        text = str(failure.args[-1]) if failure.args else str(failure)
        reason = re.sub(r"^\[SSL: \w+\]\s*|\s*\(_ssl\.c:\d+\)$", "", text)
    return BusTlsError(f"cannot connect: TLS handshake failed ({reason})", url=url, reason=reason,
                       verify_failed=verify_failed)


async def _first_connect(connecting: Awaitable[None], refused: asyncio.Event, *, timeout_s: float) -> None:
    """Await ``connecting`` for at most ``timeout_s``; a refusal ends it at once (TimeoutError,
    whose reason the caller takes from the refusal it recorded)."""
    connect = asyncio.ensure_future(connecting)
    refusal = asyncio.ensure_future(refused.wait())
    try:
        done, _ = await asyncio.wait({connect, refusal}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if connect in done:
            connect.result()
            return
        raise TimeoutError()
    finally:
        for task in (connect, refusal):
            if not task.done():
                task.cancel()
        await asyncio.gather(connect, refusal, return_exceptions=True)
