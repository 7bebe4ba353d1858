"""The broker's end of the bulk stream: a Unix socket for clients on its node and a TCP socket
on ``sandbox.bulk_bind_host`` (TLS when given a context), each serving one transfer per
connection with a token the broker issued over NATS. Plain sockets are accepted and served with
the event loop's socket calls (``bulk_stream.BulkConnection``); TLS by an asyncio server.

Knows asyncio servers, the bulk frames and ``BulkTokens``; what a transfer does in the sandbox
is the ``BulkStore``'s (``workspace_ops``). Nothing is stored unless the token is good, every
announced byte arrived, and the sandbox found the client's sha256: a refusal is a Done frame
with ``error_kind``, and the rest of what the client sends is read away (for up to
``DRAIN_REFUSED_S``) so it gets that frame even while it is still sending. An upload over the
Unix socket to a sandbox the node's supervisor holds is handed there once its token is checked
(``bulk_handoff``): the supervisor moves its bytes into the guest and this server only answers
the client, so a MiB is not received and sent again here.
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

import msgspec
import structlog

from rollmesh.messages.sandbox import SandboxBulkTicket
from rollmesh.messages.sandbox_bulk import SandboxBulkDone, SandboxBulkHello
from rollmesh.sandbox.bulk_handoff import HandOffTarget
from rollmesh.sandbox.bulk_stream import (
    STREAM_LIMIT,
    BulkConnection,
    PayloadPieces,
    ReceiveBuffers,
    frame,
    read_frame,
    this_node,
    widen_buffers,
)
from rollmesh.sandbox.bulk_tokens import BulkGrant, BulkTokens
from rollmesh.sandbox.errors import BulkStreamError, BulkTokenError
from rollmesh.sandbox.leases import Lease

log = structlog.get_logger(__name__)
HELLO_TIMEOUT_S = 30.0  # a connection that says nothing is closed after this
# A transfer may take this long plus a second per MiB before it is cut off.
IO_TIMEOUT_S = 60.0
# A handed-off upload's supervisor gives up after IO_TIMEOUT_S (and a second per MiB); the
# broker waits this much longer for its word, so the outcome is the supervisor's.
HAND_OFF_GRACE_S = 5.0
DRAIN_REFUSED_S = 5.0  # after a refusal, how long the rest of a client's bytes are read away
DRAIN_BYTES = 256 * 1024


class BulkStore(Protocol):
    """What the server asks of the broker's side (``WorkspaceOps``)."""

    bulk_tokens: BulkTokens
    bulk_endpoint: BulkEndpoint | None  # what tickets advertise; None while nothing listens

    async def store_bulk(self, grant: BulkGrant, hello: SandboxBulkHello, pieces: PayloadPieces) -> SandboxBulkDone: ...

    def upload_ticket(self, lease: Lease) -> SandboxBulkTicket | None: ...

    def read_bulk(self, grant: BulkGrant) -> tuple[SandboxBulkDone, bytes]: ...

    def hand_off_target(self, grant: BulkGrant) -> HandOffTarget | None: ...

    async def store_handed_off(self, grant: BulkGrant, hello: SandboxBulkHello, target: HandOffTarget,
                               client: socket.socket) -> SandboxBulkDone: ...


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
        self._listening: list[socket.socket] = []
        self._tls_server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # accept loops and connections, cancelled at close
        self._scratch = ""
        self._buffers = ReceiveBuffers()
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
            server._listen(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), unix_path)
            host, port = "", 0
            if tcp and tls is not None:
                server._tls_server = await asyncio.start_server(server._serve_tls, bind_host, 0, ssl=tls,
                                                                limit=STREAM_LIMIT)
                port = server._tls_server.sockets[0].getsockname()[1]
            elif tcp:
                family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
                listening = socket.socket(family, socket.SOCK_STREAM)
                listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                port = server._listen(listening, (bind_host, 0)).getsockname()[1]
            if tcp:
                host = advertised_host(bind_host)
        except BaseException:
            await server.close()
            raise
        server.endpoint = BulkEndpoint(host, port, tls is not None and tcp, unix_path, this_node())
        store.bulk_endpoint = server.endpoint
        return server

    async def close(self) -> None:
        if self._store.bulk_endpoint is self.endpoint:
            self._store.bulk_endpoint = None  # no more tickets: uploads go over NATS again
        # The accept loops first: a socket closed under a waiting sock_accept stays in the selector.
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for listening in self._listening:
            listening.close()
        self._listening.clear()
        if self._tls_server is not None:
            self._tls_server.close()
            await self._tls_server.wait_closed()
        self.endpoint = None
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def _listen(self, listening: socket.socket, address: object) -> socket.socket:
        self._listening.append(listening)
        listening.bind(address)
        listening.listen(64)
        listening.setblocking(False)
        self._spawn(self._accept_forever(listening))
        return listening

    def _spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_forever(self, listening: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listening)
            except OSError as exc:  # closed under us, or out of file descriptors
                if listening.fileno() < 0:
                    return
                log.warning("sandbox bulk accept failed", error=repr(exc))
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            widen_buffers(sock)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._serve(BulkConnection(sock)))

    async def _serve_tls(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve(BulkConnection(reader=reader, writer=writer))

    async def _serve(self, conn: BulkConnection) -> None:
        hello: SandboxBulkHello | None = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                hello = await read_frame(conn, SandboxBulkHello)
            grant = self._store.bulk_tokens.take(hello.token, hello.lease_id)
            if grant.direction == "download":
                done, data = self._store.read_bulk(grant)
                await conn.send(frame(done))
                if not done.error_kind:
                    await conn.send(data)
                return
            if hello.size > grant.size:
                raise BulkStreamError(f"the stream announces {hello.size} bytes, above its ticket's {grant.size}"
                                      " (sandbox.max_transfer_bytes)", reason="size", expected_bytes=grant.size,
                                      received_bytes=hello.size)
            if not hello.path:
                raise BulkStreamError("a bulk upload must name its file", reason="framing")
            client = conn.unix_socket()
            target = self._store.hand_off_target(grant) if client is not None else None
            if target is not None and client is not None:  # the bytes skip this process
                async with asyncio.timeout(IO_TIMEOUT_S + HAND_OFF_GRACE_S + hello.size / 2**20):
                    done = await self._store.store_handed_off(grant, hello, target, client)
                if done.error_kind:  # the client may still be sending: read away the rest
                    await self._refuse(conn, done)
                    return
                done = msgspec.structs.replace(done, next_ticket=self._store.upload_ticket(grant.lease))
                await conn.send(frame(done))
                return
            buffer = self._buffers.take(hello.size)
            pieces = PayloadPieces(conn, hello.size, sha256=hello.sha256, digest_follows=not hello.sha256,
                                   buffer=buffer)
            async with asyncio.timeout(IO_TIMEOUT_S + hello.size / 2**20):
                done = await self._store.store_bulk(grant, hello, pieces)
            if pieces.got < pieces.size:  # refused before every byte came: the rest is read away
                await self._refuse(conn, done)
                return
            if not done.error_kind:
                # Stored: every piece reached the sandbox, so nothing reads the buffer any more.
                self._buffers.give_back(buffer)
                # The lease's next upload needs no ticket round trip over NATS.
                done = msgspec.structs.replace(done, next_ticket=self._store.upload_ticket(grant.lease))
            await conn.send(frame(done))
        except BulkTokenError as exc:
            log.warning("sandbox bulk stream refused", reason=exc.reason, lease_id=exc.lease_id)
            await self._refuse(conn, SandboxBulkDone(error_kind="bad_token", error=str(exc)))
        except BulkStreamError as exc:
            log.info("sandbox bulk stream broken", reason=exc.reason, received=exc.received_bytes,
                     expected=exc.expected_bytes)
            await self._refuse(conn, SandboxBulkDone(error_kind="transfer_error", error=str(exc)))
        except (TimeoutError, ConnectionError, ssl.SSLError) as exc:
            log.info("sandbox bulk stream dropped", error=repr(exc), lease_id=hello.lease_id if hello else "")
        except Exception as exc:  # noqa: BLE001 - one stream's failure must not go unseen or stop the server
            log.error("sandbox bulk stream failed", error=repr(exc), lease_id=hello.lease_id if hello else "")
        finally:
            conn.close()

    async def _refuse(self, conn: BulkConnection, done: SandboxBulkDone) -> None:
        try:
            await conn.send(frame(done))
            scratch = memoryview(bytearray(DRAIN_BYTES))
            async with asyncio.timeout(DRAIN_REFUSED_S):  # the client may still be sending
                while await conn.recv_into(scratch):
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
