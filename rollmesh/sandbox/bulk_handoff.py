"""The broker's side of handing bulk uploads to the sandbox supervisor: once the broker checked a
client's one-time token, the client's connected Unix socket goes to the supervisor that holds
the lease's sandbox (SCM_RIGHTS), which moves the bytes into the guest itself
(``supervisor_bulk``), so a MiB is not received and sent again by the broker. The broker waits
for the outcome and answers the client as before.

Knows the supervisor's socket and frames (``guest_wire``) and the upload's fields; nothing of
tokens, leases or NATS. One standing connection per supervisor (``HandOffChannel``, opened with
a ``bulk_channel`` request) carries every hand-off, numbered, so an upload pays no connection
setup in either process. Only for a plain Unix-socket stream to a supervised sandbox: TCP and
TLS streams, and sandboxes this broker spawned itself, keep the broker's relay.
"""

from __future__ import annotations

import array
import asyncio
import json
import socket

from rollmesh.sandbox import guest_wire as wire
from rollmesh.sandbox.errors import BulkStreamError, SandboxDiedError
from rollmesh.sandbox.guest_calls import error_from_frame

MAX_OUTCOME_BYTES = 64 * 1024


class HandOffChannel:
    """A broker's standing connection to one supervisor for hand-offs: ``bulk_put`` frames, each
    with its client's socket attached and an ``upload`` number, each answered by one outcome
    frame carrying that number. Opened at the first hand-off, again after it broke (an upload
    in flight then fails: the supervisor ended it, and nothing of it landed)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Future[socket.socket] | None = None
        self._reader = wire.FrameReader(0)
        self._waiting: dict[int, asyncio.Future[dict]] = {}
        self._next = 1

    async def put(self, client: socket.socket, header: dict) -> dict:
        """Hand ``client`` over with ``header`` (a ``bulk_put``); the supervisor's outcome.
        OSError when the supervisor cannot be reached or the channel broke."""
        sock = await self._connected()
        number, self._next = self._next, self._next + 1
        outcome: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self._waiting[number] = outcome
        try:
            head = wire.encode_head({**header, "op": "bulk_put", "upload": number})
            try:
                sent = sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [client.fileno()]))])
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._broke(OSError(f"the supervisor's hand-off channel broke: {exc}"))
                sent = len(head)
            if sent != len(head):  # a frame cut in the channel would desynchronise it: start over
                self._broke(OSError("the supervisor's channel took part of a hand-off frame"))
            return await outcome
        except asyncio.CancelledError:
            self._cancel(number)
            raise
        finally:
            self._waiting.pop(number, None)

    def _cancel(self, number: int) -> None:
        """The broker gave up (its timeout): the supervisor ends the upload, nothing lands."""
        if self._sock is not None:
            try:
                self._sock.send(wire.encode_head({"op": "bulk_cancel", "upload": number}))
            except OSError:
                self._broke(OSError("the supervisor's channel broke"))

    async def _connected(self) -> socket.socket:
        if self._sock is not None and self._loop is not asyncio.get_running_loop():
            self._sock.close()  # opened in a loop that is gone (its reader went with it)
            self._sock = None
        if self._sock is not None:
            return self._sock
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
            self._opening.add_done_callback(lambda _: setattr(self, "_opening", None))
        return await asyncio.shield(self._opening)

    async def _open(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, self.address)
            await loop.sock_sendall(sock, wire.encode_head({"op": "bulk_channel"}))
            reply = await _read_frame(loop, sock)  # its ack: only then may sockets travel
            if reply.get("t") != "channel":
                raise OSError(f"the supervisor refused a hand-off channel: {reply.get('message', reply)}")
        except BaseException:
            sock.close()
            raise
        self._reader = wire.FrameReader(0)
        self._sock, self._loop = sock, loop
        loop.add_reader(sock.fileno(), self._readable)
        return sock

    def _readable(self) -> None:
        assert self._sock is not None
        try:
            frames = self._reader.read(self._sock.fileno())
        except BlockingIOError:
            return
        except (EOFError, OSError, wire.WireError) as exc:
            self._broke(OSError(f"the supervisor's hand-off channel ended: {exc!r}"))
            return
        for header, _payload in frames:
            waiting = self._waiting.get(header.get("upload"))  # type: ignore[arg-type]
            if waiting is not None and not waiting.done():
                waiting.set_result(header)

    def _broke(self, exc: OSError) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(exc)

    def close(self) -> None:
        self._broke(OSError("the hand-off channel was closed"))


class HandOffTarget:
    """Where a supervised sandbox's uploads are handed: its supervisor's channel."""

    def __init__(self, channel: HandOffChannel, sandbox_id: str, backend: str) -> None:
        self.channel = channel
        self.sandbox_id = sandbox_id
        self.backend = backend

    async def upload(self, client: socket.socket, *, path: str, size: int, sha256: str, kind: str, mode: int,
                     timeout_s: float) -> tuple[int, str]:
        """Hand ``client`` (its hello read, its bytes not) to the supervisor and wait for the
        upload's end: the stored size and sha256 (hashed in the sandbox), or the typed error
        (``BulkStreamError`` for a stream that broke or ended early, nothing stored then).
        The broker keeps its own copy of the socket, to answer the client."""
        try:
            outcome = await self.channel.put(client, {
                "sandbox_id": self.sandbox_id, "path": path, "size": size, "sha256": sha256, "kind": kind,
                "mode": mode, "timeout_s": timeout_s})
        except OSError as exc:  # the supervisor's channel, not the sandbox: a failed transfer
            raise BulkStreamError(f"the sandbox supervisor could not take the upload: {exc}",
                                  reason="unreachable", expected_bytes=size) from exc
        return self._result(outcome, size)

    def _result(self, outcome: dict, size: int) -> tuple[int, str]:
        kind = outcome.get("t")
        if kind == "stored":
            return int(outcome.get("size", -1)), str(outcome.get("sha256", ""))
        if kind == "refused":
            raise error_from_frame(outcome, backend=self.backend)
        reason, message = str(outcome.get("reason", "")), str(outcome.get("message", ""))
        if reason == "died":
            raise SandboxDiedError("the sandbox died", backend=self.backend, sandbox_id=self.sandbox_id,
                                   reason=message)
        raise BulkStreamError(message or f"the handed-off upload ended: {reason}", reason=reason or "truncated",
                              expected_bytes=size, received_bytes=int(outcome.get("received", 0)))


async def _read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> dict:
    """One small frame, read exactly (nothing after it is taken from the socket)."""
    data = bytearray()
    while True:
        want = wire.PREFIX.size
        if len(data) >= wire.PREFIX.size:
            header_len, payload_len = wire.PREFIX.unpack_from(data)
            if header_len > MAX_OUTCOME_BYTES or payload_len:
                raise OSError(f"a supervisor frame of {header_len} + {payload_len} bytes")
            want += header_len
            if len(data) == want:
                header = json.loads(data[wire.PREFIX.size:])
                if not isinstance(header, dict):
                    raise OSError("a supervisor frame that is not an object")
                return header
        chunk = await loop.sock_recv(sock, want - len(data))
        if not chunk:
            raise OSError("the supervisor hung up")
        data += chunk
