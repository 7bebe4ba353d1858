"""Errors raised by the bus: the embedded server, connections, streams, publish and request.

Knows the standard library and ``rollmesh.ports`` (request failures are also its
RequestFailedError, which logic catches without importing the bus). Foreign exceptions (nats-py,
subprocess) are wrapped at the boundary with ``raise X(...) from exc`` so callers catch one tree::

    BusError
    +-- NatsServerError            the embedded nats-server (binary, log_tail, returncode)
    |   +-- NatsServerNotFoundError    no nats-server binary next to python or on PATH
    |   +-- NatsServerStartError       exited or not ready in time
    +-- BusConnectError            could not connect (url is redacted)
    |   +-- BusTlsError                the TLS handshake failed before connecting (reason, verify_failed)
    +-- BusSecurityError           credentials or TLS files missing or unusable (role, path)
    +-- StreamSetupError           a JetStream stream or KV bucket could not be created/updated
    +-- PublishError               a publish failed (subject)
    +-- BusRequestError            a request got no usable reply (subject)
        +-- RequestTimeoutError        no reply within timeout_s
        +-- NoRespondersError          nobody subscribes to the subject
        +-- ReplyDecodeError           the reply did not decode as the subject's reply type
"""

from __future__ import annotations

from rollmesh.ports import RequestFailedError


class BusError(Exception):
    """Root of every bus error."""


class NatsServerError(BusError):
    def __init__(self, message: str, *, binary: str = "", log_tail: str = "",
                 returncode: int | None = None) -> None:
        details = f"\n--- nats-server log tail ---\n{log_tail}" if log_tail else ""
        super().__init__(f"{message}{details}")
        self.binary = binary
        self.log_tail = log_tail
        self.returncode = returncode


class NatsServerNotFoundError(NatsServerError):
    pass


class NatsServerStartError(NatsServerError):
    pass


class BusConnectError(BusError):
    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(f"{message} (url={url})")
        self.url = url


class BusTlsError(BusConnectError):
    """The TLS handshake failed before the first connection: retrying cannot help.
    ``verify_failed``: this side did not verify the server's certificate (wrong or missing CA,
    a name not in its SAN); else the server refused this side (no or an untrusted client
    certificate). ``reason`` is the ssl module's."""

    def __init__(self, message: str, *, url: str, reason: str, verify_failed: bool) -> None:
        super().__init__(message, url=url)
        self.reason = reason
        self.verify_failed = verify_failed


class BusSecurityError(BusError):
    """Credentials or TLS material cannot be used; the message names files and variables, never
    their contents."""

    def __init__(self, message: str, *, role: str = "", path: str = "") -> None:
        super().__init__(f"{role}: {message}" if role else message)
        self.role = role
        self.path = path


class StreamSetupError(BusError):
    def __init__(self, message: str, *, stream: str) -> None:
        super().__init__(f"{stream}: {message}")
        self.stream = stream


class PublishError(BusError):
    def __init__(self, message: str, *, subject: str) -> None:
        super().__init__(f"{subject}: {message}")
        self.subject = subject


class BusRequestError(BusError, RequestFailedError):
    def __init__(self, message: str, *, subject: str) -> None:
        super().__init__(f"{subject}: {message}")
        self.subject = subject


class RequestTimeoutError(BusRequestError):
    def __init__(self, *, subject: str, timeout_s: float) -> None:
        super().__init__(f"no reply within {timeout_s}s", subject=subject)
        self.timeout_s = timeout_s


class NoRespondersError(BusRequestError):
    def __init__(self, *, subject: str) -> None:
        super().__init__("no responders", subject=subject)


class ReplyDecodeError(BusRequestError):
    def __init__(self, message: str, *, subject: str) -> None:
        super().__init__(f"undecodable reply: {message}", subject=subject)
