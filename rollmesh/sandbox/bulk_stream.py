"""The bulk stream's framing, and its client end: how a ticket becomes a socket, and one upload
or download over it.

Knows asyncio sockets, ssl and the bulk frames (``rollmesh.messages.sandbox_bulk``); nothing of
NATS, leases or sandboxes. The raw bytes follow their frame unchunked: the socket and the kernel
chunk them, and the receiver reads straight into one buffer of the announced size, so no length
prefix per piece is needed and nothing is reassembled. A stream that ends before ``size`` bytes
is ``BulkStreamError`` (reason "truncated"); bytes whose sha256 is not the announced one are
``ChecksumMismatchError``.

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
from typing import Literal, TypeVar

import msgspec

from rollmesh.messages.sandbox import SandboxBulkTicket
from rollmesh.messages.sandbox_bulk import MAX_BULK_FRAME_BYTES, SandboxBulkDone, SandboxBulkHello
from rollmesh.sandbox.errors import BulkStreamError, ChecksumMismatchError

T = TypeVar("T")
Route = Literal["unix", "tcp"]
_LENGTH = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()
# What one read takes at most: large enough that a MiB is a few reads, small enough to hash
# each piece while the next is on its way.
READ_BYTES = 256 * 1024
# The stream's reader buffers up to this before pausing the socket.
STREAM_LIMIT = 4 * 1024 * 1024


def frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, type_: type[T]) -> T:
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if length > MAX_BULK_FRAME_BYTES:
            raise BulkStreamError(f"a bulk frame of {length} bytes (at most {MAX_BULK_FRAME_BYTES})",
                                  reason="framing")
        return msgspec.msgpack.decode(await reader.readexactly(length), type=type_)
    except asyncio.IncompleteReadError as exc:
        raise BulkStreamError("the bulk stream closed inside a frame", reason="truncated",
                              expected_bytes=exc.expected, received_bytes=len(exc.partial)) from exc
    except msgspec.ValidationError as exc:
        raise BulkStreamError(f"a bulk frame that is not a {type_.__name__}: {exc}", reason="framing") from exc
    except msgspec.DecodeError as exc:
        raise BulkStreamError(f"an undecodable bulk frame: {exc}", reason="framing") from exc


async def read_payload(reader: asyncio.StreamReader, size: int, hasher) -> bytearray:
    """Exactly ``size`` bytes into one buffer, hashed piece by piece as they come (the sender
    is still sending meanwhile)."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    pieces = PayloadPieces(reader, size)
    async for piece in pieces:
        view[pieces.got - len(piece):pieces.got] = piece
        hasher.update(piece)
    return buffer


class PayloadPieces:
    """Exactly ``size`` bytes of a stream as the pieces the socket gives them (an async
    iterator, for a receiver that passes each on as it comes); ``BulkStreamError``
    "truncated" when the stream ends first."""

    def __init__(self, reader: asyncio.StreamReader, size: int) -> None:
        self._reader = reader
        self.size = size
        self.got = 0

    def __aiter__(self) -> PayloadPieces:
        return self

    async def __anext__(self) -> bytes:
        if self.got >= self.size:
            raise StopAsyncIteration
        piece = await self._reader.read(min(READ_BYTES, self.size - self.got))
        if not piece:
            raise BulkStreamError(f"the bulk stream ended after {self.got} of {self.size} bytes",
                                  reason="truncated", expected_bytes=self.size, received_bytes=self.got)
        self.got += len(piece)
        return piece

    async def collect(self) -> bytearray:
        """All of it in one buffer."""
        buffer = bytearray(self.size)
        view = memoryview(buffer)
        async for piece in self:
            view[self.got - len(piece):self.got] = piece
        return buffer


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


async def open_stream(ticket: SandboxBulkTicket, route: Route, tls: ssl.SSLContext | None):
    """BulkStreamError "unreachable" when no connection could be made (nothing was sent)."""
    try:
        if route == "unix":
            return await asyncio.open_unix_connection(ticket.unix_path, limit=STREAM_LIMIT)
        secure = tls if ticket.tls else None
        return await asyncio.open_connection(ticket.host, ticket.port, ssl=secure, limit=STREAM_LIMIT,
                                             server_hostname=ticket.host if secure is not None else None)
    except OSError as exc:  # ssl.SSLError included: a certificate this side does not trust
        raise BulkStreamError(f"the bulk stream at {ticket.unix_path if route == 'unix' else ticket.host} "
                              f"could not be opened: {exc}", reason="unreachable") from exc


async def upload_over_stream(ticket: SandboxBulkTicket, route: Route, *, lease_id: str, data: bytes,
                             sha256: str, tls: ssl.SSLContext | None) -> SandboxBulkDone:
    """Send ``data`` (whose sha256 the caller computed) and wait for the broker's verdict:
    stored and verified in the sandbox, or refused."""
    reader, writer = await open_stream(ticket, route, tls)
    try:
        writer.write(frame(SandboxBulkHello(token=ticket.token, lease_id=lease_id, size=len(data),
                                            sha256=sha256)))
        writer.write(data)
        try:
            await writer.drain()
        except ConnectionError:
            pass  # refused before it took every byte: its verdict is in what it sent
        return await read_frame(reader, SandboxBulkDone)
    finally:
        writer.close()


async def download_over_stream(ticket: SandboxBulkTicket, route: Route, *, lease_id: str,
                               tls: ssl.SSLContext | None) -> tuple[SandboxBulkDone, bytes]:
    """The file's bytes, checked against the size and sha256 the sandbox computed (the Done
    frame's); a refusal comes back as the Done with ``error_kind`` and no bytes."""
    reader, writer = await open_stream(ticket, route, tls)
    try:
        writer.write(frame(SandboxBulkHello(token=ticket.token, lease_id=lease_id)))
        await writer.drain()
        done = await read_frame(reader, SandboxBulkDone)
        if done.error_kind:
            return done, b""
        hasher = hashlib.sha256()
        data = await read_payload(reader, done.size, hasher)
    finally:
        writer.close()
    if hasher.hexdigest() != done.sha256:
        raise ChecksumMismatchError(f"the {done.size} bytes received have sha256 {hasher.hexdigest()}, "
                                    f"not the sandbox's {done.sha256}", path="")
    return done, bytes(data)
