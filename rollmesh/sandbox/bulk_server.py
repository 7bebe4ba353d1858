"""The broker's end of the bulk stream: a Unix socket for clients on its node and a TCP socket
on ``sandbox.bulk_bind_host`` (TLS when given a context), each serving one transfer per
connection with a token the broker issued over NATS.

Knows asyncio servers, the bulk frames and ``BulkTokens``; what a transfer does in the sandbox
is the ``BulkStore``'s (``workspace_ops``). Nothing is stored unless the token is good, every
announced byte arrived, and the sandbox found the client's sha256: a refusal is a Done frame
with ``error_kind``, and the connection is read to its end (up to the IO timeout) so the client
gets that frame even while it is still sending.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket
import ssl
import tempfile
import time
from dataclasses import dataclass
from typing import Protocol

import structlog

from rollmesh.messages.sandbox import SandboxBulkTicket
from rollmesh.messages.sandbox_bulk import SandboxBulkDone, SandboxBulkHello
from rollmesh.sandbox.bulk_stream import STREAM_LIMIT, PayloadPieces, frame, read_frame, this_node
from rollmesh.sandbox.bulk_tokens import BulkGrant, BulkTokens
from rollmesh.sandbox.errors import BulkStreamError, BulkTokenError

log = structlog.get_logger(__name__)
HELLO_TIMEOUT_S = 30.0  # a connection that says nothing is closed after this
# A transfer may take this long plus a second per MiB before it is cut off.
IO_TIMEOUT_S = 60.0
DRAIN_REFUSED_S = 5.0  # after a refusal, how long the rest of a client's bytes are read away


class BulkStore(Protocol):
    """What the server asks of the broker's side (``WorkspaceOps``)."""

    bulk_tokens: BulkTokens
    bulk_endpoint: BulkEndpoint | None  # what tickets advertise; None while nothing listens

    async def store_bulk(self, grant: BulkGrant, pieces: PayloadPieces, sha256: str) -> SandboxBulkDone: ...

    def read_bulk(self, grant: BulkGrant) -> tuple[SandboxBulkDone, bytes]: ...


@dataclass(frozen=True, slots=True)
class BulkEndpoint:
    """Where this broker's bulk stream listens, as tickets advertise it."""

    host: str
    port: int
    tls: bool
    unix_path: str
    node: str

    def ticket(self, grant: BulkGrant) -> SandboxBulkTicket:
        lapses_in = max(0.0, grant.expires_at - time.monotonic())
        return SandboxBulkTicket(token=grant.token, host=self.host, port=self.port, tls=self.tls,
                                 unix_path=self.unix_path, node=self.node, expires_at=time.time() + lapses_in)


class BulkServer:
    def __init__(self, store: BulkStore) -> None:
        self._store = store
        self._servers: list[asyncio.AbstractServer] = []
        self._scratch = ""
        self.endpoint: BulkEndpoint | None = None

    @classmethod
    async def start(cls, store: BulkStore, *, bind_host: str, tls: ssl.SSLContext | None = None,
                    tcp: bool = True) -> BulkServer:
        """Listen (the OS picks the TCP port). ``tcp=False``: the Unix socket only (e.g. with
        security but no certificate to serve TLS with)."""
        server = cls(store)
        # A short private directory: a Unix socket path must fit in 108 bytes, and only this
        # user may connect (the token is checked besides).
        server._scratch = tempfile.mkdtemp(prefix="rollmesh-bulk-")
        os.chmod(server._scratch, 0o700)
        unix_path = os.path.join(server._scratch, "s")
        try:
            server._servers.append(await asyncio.start_unix_server(server._serve, unix_path, limit=STREAM_LIMIT))
            host, port = "", 0
            if tcp:
                listening = await asyncio.start_server(server._serve, bind_host, 0, ssl=tls, limit=STREAM_LIMIT)
                server._servers.append(listening)
                host, port = advertised_host(bind_host), listening.sockets[0].getsockname()[1]
        except BaseException:
            await server.close()
            raise
        server.endpoint = BulkEndpoint(host, port, tls is not None and tcp, unix_path, this_node())
        store.bulk_endpoint = server.endpoint
        return server

    async def close(self) -> None:
        if self._store.bulk_endpoint is self.endpoint:
            self._store.bulk_endpoint = None  # no more tickets: uploads go over NATS again
        for listening in self._servers:
            listening.close()
        for listening in self._servers:
            await listening.wait_closed()
        self._servers.clear()
        self.endpoint = None
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello: SandboxBulkHello | None = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                hello = await read_frame(reader, SandboxBulkHello)
            grant = self._store.bulk_tokens.take(hello.token, hello.lease_id)
            if grant.direction == "download":
                done, data = self._store.read_bulk(grant)
                writer.write(frame(done))
                if not done.error_kind:
                    writer.write(data)
                await writer.drain()
                return
            if hello.size != grant.size:
                raise BulkStreamError(f"the stream announces {hello.size} bytes, its ticket {grant.size}",
                                      reason="size", expected_bytes=grant.size, received_bytes=hello.size)
            if not hello.sha256:
                raise BulkStreamError("a bulk upload must name its sha256", reason="framing")
            pieces = PayloadPieces(reader, grant.size)
            async with asyncio.timeout(IO_TIMEOUT_S + grant.size / 2**20):
                done = await self._store.store_bulk(grant, pieces, hello.sha256)
            if pieces.got < pieces.size:  # refused before every byte came: the rest is read away
                await self._refuse(reader, writer, done)
                return
            writer.write(frame(done))
            await writer.drain()
        except BulkTokenError as exc:
            log.warning("sandbox bulk stream refused", reason=exc.reason, lease_id=exc.lease_id)
            await self._refuse(reader, writer, SandboxBulkDone(error_kind="bad_token", error=str(exc)))
        except BulkStreamError as exc:
            log.info("sandbox bulk stream broken", reason=exc.reason, received=exc.received_bytes,
                     expected=exc.expected_bytes)
            await self._refuse(reader, writer, SandboxBulkDone(error_kind="transfer_error", error=str(exc)))
        except (TimeoutError, ConnectionError, ssl.SSLError) as exc:
            log.info("sandbox bulk stream dropped", error=repr(exc), lease_id=hello.lease_id if hello else "")
        finally:
            writer.close()

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      done: SandboxBulkDone) -> None:
        try:
            writer.write(frame(done))
            await writer.drain()
            async with asyncio.timeout(DRAIN_REFUSED_S):  # the client may still be sending
                while await reader.read(STREAM_LIMIT):
                    pass
        except (TimeoutError, ConnectionError, ssl.SSLError):
            pass


def advertised_host(bind_host: str) -> str:
    """The address clients are told: the bound one, or for a wildcard this host's address."""
    try:
        if not ipaddress.ip_address(bind_host).is_unspecified:
            return bind_host
    except ValueError:
        return bind_host  # a name: clients resolve it
    return socket.gethostbyname(socket.gethostname())
