"""The bulk stream's socket and framing, and its client end: how a ticket becomes a connection,
and one upload or download over it.

Knows asyncio sockets, ssl and the bulk frames (``rollmesh.messages.sandbox_bulk``); nothing of
NATS, leases or sandboxes. The raw bytes follow their frame unchunked: the socket and the kernel
chunk them, and the receiver reads straight into one buffer of the announced size, so no length
prefix per piece is needed and nothing is reassembled. A stream that ends before ``size`` bytes
is ``BulkStreamError`` (reason "truncated"); bytes whose sha256 is not the announced one are
``ChecksumMismatchError``.

A plain connection (Unix socket, or TCP without TLS) uses the event loop's socket calls on the
caller's buffers: ``sock_sendall`` of the caller's bytes, ``sock_recv_into`` the receiver's
buffer, so a MiB crosses with no copy in either process (asyncio's streams copied it three times
and took about twice as long here). TLS goes through asyncio streams, which do the handshake.

Hand-rolled on asyncio sockets rather than HTTP (httpx, aiohttp): one transfer per connection,
two small frames and the raw bytes, read straight into the buffer the guest's pipe is fed from;
an HTTP layer would add a parser and copies per MiB and give nothing this needs.

The Unix socket is used when the ticket's broker runs on this node (same host name and boot id)
and its path is here; else TCP, with TLS when the ticket says so (verified against the caller's
context, which knows the CA). ``stream_route`` None: this client cannot use the ticket.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import socket
import ssl
import struct
from pathlib import Path
from collections.abc import Awaitable
from typing import Literal, TypeVar

import msgspec

from rollmesh.messages.sandbox import SandboxBulkTicket
from rollmesh.messages.sandbox_bulk import (
    MAX_BULK_FRAME_BYTES,
    SandboxBulkDigest,
    SandboxBulkDone,
    SandboxBulkHello,
)
from rollmesh.sandbox.errors import BulkStreamError, ChecksumMismatchError

T = TypeVar("T")
Route = Literal["unix", "tcp"]
_LENGTH = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()
# What one read takes at most; each piece is passed on (or hashed) as it comes. Every piece the
# broker passes on wakes the supervisor and the guest once more: on a loaded 2-core machine
# 256 KiB pieces made a 1 MiB upload 2-3 ms slower than 1 MiB ones (A/B in one run, 2026-12-02).
# Not above 1 MiB: the supervisor splices a piece only once all of it is in its 4 MiB socket buffer.
READ_BYTES = 1024 * 1024
STREAM_LIMIT = 1024 * 1024  # a TLS stream's reader buffers this much before pausing the socket
# Socket buffers asked for (the kernel caps them at net.core.wmem_max / rmem_max): a MiB fits in
# the kernel at once, so the sender is not woken for every 200 KiB the receiver takes.
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


def widen_buffers(sock: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:
            pass  # still correct, only slower


class BulkConnection:
    """One bulk stream: a plain non-blocking socket, or (TLS) an asyncio stream pair."""

    def __init__(self, sock: socket.socket | None = None, reader: asyncio.StreamReader | None = None,
                 writer: asyncio.StreamWriter | None = None) -> None:
        self._sock, self._reader, self._writer = sock, reader, writer
        self._loop = asyncio.get_running_loop()

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        if self._sock is not None:
            await self._loop.sock_sendall(self._sock, data)
        else:
            assert self._writer is not None
            self._writer.write(data)
            await self._writer.drain()

    async def recv_into(self, view: memoryview) -> int:
        """Up to ``len(view)`` bytes into ``view``; 0 at the end of the stream."""
        if self._sock is not None:
            return await self._loop.sock_recv_into(self._sock, view)
        assert self._reader is not None
        data = await self._reader.read(len(view))
        view[:len(data)] = data
        return len(data)

    async def recv_exactly(self, size: int) -> bytearray:
        buffer = bytearray(size)
        view, got = memoryview(buffer), 0
        while got < size:
            n = await self.recv_into(view[got:])
            if not n:
                raise BulkStreamError(f"the bulk stream ended after {got} of {size} bytes", reason="truncated",
                                      expected_bytes=size, received_bytes=got)
            got += n
        return buffer

    def unix_socket(self) -> socket.socket | None:
        """The connected socket of a plain Unix-socket stream (one that can be handed to another
        process on this node); None for TCP and TLS."""
        if self._sock is not None and self._sock.family == socket.AF_UNIX:
            return self._sock
        return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        elif self._writer is not None:
            self._writer.close()


def frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


async def read_frame(conn: BulkConnection, type_: type[T]) -> T:
    (length,) = _LENGTH.unpack(await conn.recv_exactly(_LENGTH.size))
    if length > MAX_BULK_FRAME_BYTES:
        raise BulkStreamError(f"a bulk frame of {length} bytes (at most {MAX_BULK_FRAME_BYTES})", reason="framing")
    body = await conn.recv_exactly(length)
    try:
        return msgspec.msgpack.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise BulkStreamError(f"a bulk frame that is not a {type_.__name__}: {exc}", reason="framing") from exc
    except msgspec.DecodeError as exc:
        raise BulkStreamError(f"an undecodable bulk frame: {exc}", reason="framing") from exc


class PayloadPieces:
    """Exactly ``size`` bytes of a stream, received into one buffer and handed out as the pieces
    the socket gives (an async iterator of views into that buffer, each stable once handed out,
    for a receiver that passes each on as it comes); ``BulkStreamError`` "truncated" when the
    stream ends first. ``sha256``: the hello's, or (``digest_follows``) the trailing
    ``SandboxBulkDigest``'s, read before the last piece is handed out."""

    def __init__(self, conn: BulkConnection, size: int, *, sha256: str = "", digest_follows: bool = False,
                 buffer: bytearray | None = None) -> None:
        """``buffer``: one of at least ``size`` bytes to receive into (``ReceiveBuffers``), else
        a fresh one."""
        self._conn = conn
        self.size = size
        self.got = 0
        self.sha256 = sha256
        self._digest_follows = digest_follows
        self.buffer = bytearray(size) if buffer is None else buffer
        self._view = memoryview(self.buffer)[:size]

    def __aiter__(self) -> PayloadPieces:
        return self

    async def __anext__(self) -> memoryview:
        if self.got >= self.size:
            if self._digest_follows and not self.sha256:  # an empty upload: only its digest follows
                self.sha256 = (await read_frame(self._conn, SandboxBulkDigest)).sha256
            raise StopAsyncIteration
        start = self.got
        n = await self._conn.recv_into(self._view[start:min(self.size, start + READ_BYTES)])
        if not n:
            raise BulkStreamError(f"the bulk stream ended after {start} of {self.size} bytes",
                                  reason="truncated", expected_bytes=self.size, received_bytes=start)
        self.got += n
        if self.got == self.size and self._digest_follows:
            self.sha256 = (await read_frame(self._conn, SandboxBulkDigest)).sha256
        return self._view[start:self.got]

    async def collect(self) -> bytes | bytearray:
        """All of it: the one buffer, or a copy of its first ``size`` bytes when it is larger
        (a kept buffer, which goes back for the next upload)."""
        async for _ in self:
            pass
        return self.buffer if len(self.buffer) == self.size else bytes(self._view)


class ReceiveBuffers:
    """Receive buffers kept for the next uploads. A fresh buffer costs a page fault for every
    page it fills, dear in a VM: filling a fresh 1 MiB bytearray measured 5 ms here on a busy
    2-core VM, a kept one 0.2-1 ms. Sizes are rounded up to a power of two (at least
    ``MIN_KEPT``) so uploads of similar sizes share buffers; at most ``keep_bytes`` are kept.
    A buffer is given back only once nothing can still read it (its upload stored)."""

    MIN_KEPT = 64 * 1024

    def __init__(self, keep_bytes: int = 64 * 1024 * 1024) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[bytearray]] = {}
        self._kept = 0

    def take(self, size: int) -> bytearray:
        rounded = max(self.MIN_KEPT, 1 << max(0, size - 1).bit_length())
        free = self._free.get(rounded)
        if free:
            self._kept -= rounded
            return free.pop()
        return bytearray(rounded)

    def give_back(self, buffer: bytearray) -> None:
        if self._kept + len(buffer) <= self.keep_bytes:
            self._free.setdefault(len(buffer), []).append(buffer)
            self._kept += len(buffer)


@functools.cache
def this_node() -> str:
    """This host's name and boot id: two processes with the same one share a kernel (and, where
    the socket's path exists, a filesystem), so a Unix socket reaches across."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def stream_route(ticket: SandboxBulkTicket, tls: ssl.SSLContext | None) -> Route | None:
    if ticket.unix_path and ticket.node == this_node() and os.path.exists(ticket.unix_path):
        return "unix"
    if ticket.host and ticket.port and (tls is not None or not ticket.tls):
        return "tcp"
    return None


async def open_stream(ticket: SandboxBulkTicket, route: Route, tls: ssl.SSLContext | None) -> BulkConnection:
    """BulkStreamError "unreachable" when no connection could be made (nothing was sent)."""
    loop = asyncio.get_running_loop()
    try:
        if route == "tcp" and ticket.tls:
            reader, writer = await asyncio.open_connection(ticket.host, ticket.port, ssl=tls, limit=STREAM_LIMIT,
                                                           server_hostname=ticket.host)
            return BulkConnection(reader=reader, writer=writer)
        if route == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: object = ticket.unix_path
        else:
            info = await loop.getaddrinfo(ticket.host, ticket.port, type=socket.SOCK_STREAM)
            family, kind, proto, _, address = info[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        widen_buffers(sock)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return BulkConnection(sock)
    except OSError as exc:  # ssl.SSLError included: a certificate this side does not trust
        raise BulkStreamError(f"the bulk stream at {ticket.unix_path if route == 'unix' else ticket.host} "
                              f"could not be opened: {exc}", reason="unreachable") from exc


async def upload_over_stream(ticket: SandboxBulkTicket, route: Route, *, lease_id: str, path: str,
                             data: bytes, sha256: str | Awaitable[str], tls: ssl.SSLContext | None,
                             kind: str = "file", mode: int = 0o644) -> SandboxBulkDone:
    """Send ``data`` to ``path`` and wait for the broker's verdict: stored and verified in the
    sandbox, or refused. ``sha256``: its digest, or one being computed (a future), sent after
    the bytes once it is there: the hashing overlaps the sending and the sandbox's storing."""
    conn = await open_stream(ticket, route, tls)
    known = sha256 if isinstance(sha256, str) else ""
    try:
        try:
            await conn.send(frame(SandboxBulkHello(token=ticket.token, lease_id=lease_id, size=len(data),
                                                   sha256=known, path=path, kind=kind, mode=mode)))  # type: ignore[arg-type]
            await conn.send(memoryview(data).cast("B"))
            if not known:
                await conn.send(frame(SandboxBulkDigest(sha256=await sha256)))  # type: ignore[misc]
        except ConnectionError:
            pass  # refused before it took every byte: its verdict is in what it sent
        return await read_frame(conn, SandboxBulkDone)
    finally:
        conn.close()


async def download_over_stream(ticket: SandboxBulkTicket, route: Route, *, lease_id: str,
                               tls: ssl.SSLContext | None) -> tuple[SandboxBulkDone, bytes]:
    """The file's bytes, checked against the size and sha256 the sandbox computed (the Done
    frame's); a refusal comes back as the Done with ``error_kind`` and no bytes."""
    conn = await open_stream(ticket, route, tls)
    try:
        await conn.send(frame(SandboxBulkHello(token=ticket.token, lease_id=lease_id)))
        done = await read_frame(conn, SandboxBulkDone)
        if done.error_kind:
            return done, b""
        hasher = hashlib.sha256()
        pieces = PayloadPieces(conn, done.size)
        async for piece in pieces:  # hashed while the broker sends the rest
            hasher.update(piece)
    finally:
        conn.close()
    if hasher.hexdigest() != done.sha256:
        raise ChecksumMismatchError(f"the {done.size} bytes received have sha256 {hasher.hexdigest()}, "
                                    f"not the sandbox's {done.sha256}", path="")
    return done, bytes(pieces.buffer)
