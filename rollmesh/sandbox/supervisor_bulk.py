"""The supervisor's end of handed-off bulk uploads: a client's bulk-stream socket, passed here by
its broker (SCM_RIGHTS, a ``bulk_put`` frame on the broker's standing ``bulk_channel``
connection) once the broker checked the client's one-time token, so the upload's bytes go from
the client's socket into the guest's pipe without the broker.

Standard library only, no imports of rollmesh beyond ``guest_wire`` and ``supervisor_splice``
(run by ``supervisor.py`` as a script). Knows the bulk stream's layout
after the hello (``size`` raw bytes, then a length-prefixed digest frame unless the hello named
the sha256), the guest's upload frames and what the relay's ``Held`` asks of a connection
(``send``, ``pause``, ``spliced``, ``abandon``, ``close_when_flushed``, ``ids``); nothing of
tokens or leases (the broker checked them) and nothing of msgpack beyond that one-field frame.
Frame-aligned like the relay: a piece goes to the guest only whole (spliced when all of it is
queued in the client's socket, else read into a buffer first), so a client that hangs up
mid-piece leaves no half frame in the pipe; the relay then tells the guest to abort the upload
and nothing lands. The outcome (the guest's reply, or why the stream broke) goes back on the
broker's channel; the broker answers the client (its Done frame is msgpack).
"""

from __future__ import annotations

import array
import asyncio
import json
import os
import re
import socket
import struct
from collections import deque
from collections.abc import Callable

if __package__:
    from rollmesh.sandbox import guest_wire as wire
    from rollmesh.sandbox import supervisor_splice as splicing
else:  # run as a script: its own directory is on sys.path
    import guest_wire as wire  # type: ignore[no-redef]
    import supervisor_splice as splicing  # type: ignore[no-redef]

# One guest frame per MiB of the upload: the client's 4 MiB socket buffer holds a whole piece,
# so a piece is usually spliced, and the guest writes one while the next arrives.
PIECE = 1024 * 1024
MAX_DIGEST_FRAME = 64 * 1024  # the bulk stream's own bound on a frame (MAX_BULK_FRAME_BYTES)
HIGH_WATER = 8 * 1024 * 1024  # the relay's: queued for the guest before reading pauses
_LENGTH = struct.Struct(">I")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RID = 1  # the one request on this "connection"
MAX_FDS = 16
MAX_CHANNEL_FRAME = 64 * 1024


class HandOffChannel:
    """A broker's standing connection for hand-offs (its first frame was ``bulk_channel``): each
    ``bulk_put`` frame comes with one socket (SCM_RIGHTS) and an ``upload`` number, and gets one
    outcome frame with that number; ``bulk_cancel`` ends one. When the broker goes, so do its
    uploads (nobody is left to answer their clients), and nothing of them lands."""

    def __init__(self, sock: socket.socket, held: Callable[[str], object], *, on_close: Callable[[], None]) -> None:
        self.sock = sock
        self._held = held  # sandbox id -> its Held (None: not held, or its guest is gone)
        self._on_close = on_close
        self._buffer = bytearray()
        self._fds: deque[int] = deque()
        self.uploads: dict[int, HandedOffUpload] = {}
        self._out = bytearray()  # outcomes the socket did not take yet
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            data, ancillary, _flags, _addr = self.sock.recvmsg(MAX_CHANNEL_FRAME, socket.CMSG_SPACE(MAX_FDS * 4))
        except BlockingIOError:
            return
        except OSError:
            data, ancillary = b"", []
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(raw[:len(raw) - len(raw) % got.itemsize])
                self._fds.extend(got)
        if not data:
            self.close()
            return
        self._buffer += data
        while len(self._buffer) >= wire.PREFIX.size:
            header_len, payload_len = wire.PREFIX.unpack_from(self._buffer)
            if header_len > MAX_CHANNEL_FRAME or payload_len:
                self.close()  # not a channel frame: the stream cannot be trusted
                return
            end = wire.PREFIX.size + header_len
            if len(self._buffer) < end:
                return
            try:
                header = json.loads(self._buffer[wire.PREFIX.size:end])
            except ValueError:
                self.close()
                return
            del self._buffer[:end]
            if isinstance(header, dict):
                self._request(header)

    def _request(self, header: dict) -> None:
        number = header.get("upload")
        if header.get("op") == "bulk_cancel":
            upload = self.uploads.get(number)  # type: ignore[arg-type]
            if upload is not None:
                upload.fail("the broker gave up on the upload", "timeout")
            return
        if header.get("op") != "bulk_put":
            return
        if not self._fds:  # a bulk_put without its socket: nothing to take the bytes from
            self._send({"upload": number, "t": "broken", "reason": "framing", "received": 0,
                        "message": "a hand-off came without its socket"})
            return
        client = socket.socket(fileno=self._fds.popleft())
        held = self._held(str(header.get("sandbox_id")))
        if held is None or not isinstance(number, int) or number in self.uploads:
            client.close()
            self._send({"upload": number, "t": "broken", "reason": "died", "received": 0,
                        "message": "the sandbox died"})
            return
        client.setblocking(False)

        def report(outcome: dict) -> None:
            self.uploads.pop(number, None)
            self._send({**outcome, "upload": number})

        upload = self.uploads[number] = HandedOffUpload(held, client, report, header,
                                                        timeout_s=float(header.get("timeout_s") or 60.0))
        upload.start()

    def _send(self, outcome: dict) -> None:
        if self.sock.fileno() < 0:
            return
        self._out += wire.encode_head(outcome)
        self._flush()

    def _flush(self) -> None:
        try:
            sent = self.sock.send(self._out)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.close()
            return
        del self._out[:sent]
        if self._out:
            self._loop.add_writer(self.sock.fileno(), self._flush)
        else:
            self._loop.remove_writer(self.sock.fileno())

    def close(self) -> None:
        if self.sock.fileno() < 0:
            return
        self._loop.remove_reader(self.sock.fileno())
        self._loop.remove_writer(self.sock.fileno())
        self.sock.close()
        while self._fds:
            os.close(self._fds.popleft())
        for upload in list(self.uploads.values()):
            upload.fail("the broker hung up", "broker_gone")
        self._on_close()


class HandOffStreamError(Exception):
    """The client's stream cannot give a whole upload: ``reason`` as ``BulkStreamError``'s."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class HandedOffUpload:
    """One upload from a client's socket into ``held``'s guest, shaped like a relay ``Conn`` so
    the relay routes, splices and aborts it as it does a broker's."""

    def __init__(self, held, client: socket.socket, report: Callable[[dict], None], header: dict, *,
                 timeout_s: float) -> None:
        self.held = held
        self.sock = client
        self.fd = client.fileno()
        self._send_outcome = report
        self.size = int(header["size"])
        self.sha256 = str(header.get("sha256") or "")
        kind = "put_tar" if header.get("kind") == "tar" else "put_file"
        self._first = {"op": kind, "path": str(header["path"]), "size": self.size}
        if kind == "put_file":
            self._first["mode"] = int(header.get("mode", 0o644))
        if self.sha256:
            self._first["sha256"] = self.sha256
        self.ids: dict[int, int] = {}
        self.alive = True
        self.splicing: splicing.SplicePayload | None = None
        self.sent = 0  # bytes handed to the guest's writer
        self.phase = "bytes"  # then "digest" (a trailing digest frame to read), then "reply"
        self._opened = False
        self._paused = False
        self._piece: bytearray | None = None  # a piece being read (not all of it was queued)
        self._piece_got = 0
        self._digest = bytearray()
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(timeout_s, self._fail, "the upload took too long", "timeout")

    def start(self) -> None:
        self.held.conns.add(self)
        if self.size == 0:
            self._after_bytes()
        if self.phase != "reply":
            self._loop.add_reader(self.fd, self._readable)

    # -- from the client ---------------------------------------------------------------------

    def _readable(self) -> None:
        try:
            if self.phase == "bytes":
                self._read_piece()
            elif self.phase == "digest":
                self._read_digest()
        except BlockingIOError:
            return
        except HandOffStreamError as exc:
            self._fail(str(exc), exc.reason)
        except OSError as exc:
            self._fail(f"the bulk stream broke: {exc}", "truncated")

    def _read_piece(self) -> None:
        need = min(PIECE, self.size - self.sent)
        if self._piece is None and splicing.splice_usable() and splicing.queued_bytes(self.fd) >= need:
            self.splicing = splicing.SplicePayload(self, need)  # type: ignore[arg-type]
            self._loop.remove_reader(self.fd)  # until its bytes have left the socket
            self._forward(self.splicing, need)
            return
        if self._piece is None:
            self._piece, self._piece_got = bytearray(need), 0
        count = self.sock.recv_into(memoryview(self._piece)[self._piece_got:])
        if count == 0:
            raise HandOffStreamError(f"the bulk stream ended after {self.sent + self._piece_got} of {self.size} bytes",
                               "truncated")
        self._piece_got += count
        if self._piece_got == len(self._piece):
            piece, self._piece = self._piece, None
            self._forward(piece, len(piece))

    def _forward(self, payload, count: int) -> None:
        self.sent += count
        header = {"id": _RID, **self._first} if not self._opened else {"id": _RID, "op": "chunk"}
        self._opened = True
        if self.sent == self.size and self.sha256:
            header.update(last=True, sha256=self.sha256)
        self.held.from_broker(self, header, payload)
        if self.sent == self.size:
            self._after_bytes()

    def _after_bytes(self) -> None:
        if self.sha256:
            if not self._opened:  # an empty upload with its digest known: one frame
                self.held.from_broker(self, {"id": _RID, **self._first, "last": True}, b"")
                self._opened = True
            self._to_reply_phase()
        else:
            self.phase = "digest"

    def _read_digest(self) -> None:
        have = len(self._digest)
        if have < _LENGTH.size:
            want = _LENGTH.size
        else:
            length = _LENGTH.unpack_from(self._digest)[0]
            if not 0 < length <= MAX_DIGEST_FRAME:
                raise HandOffStreamError(f"a bulk digest frame of {length} bytes", "framing")
            want = _LENGTH.size + length
        data = self.sock.recv(want - have)
        if not data:
            raise HandOffStreamError(f"the bulk stream ended after the {self.size} bytes, before their digest",
                               "truncated")
        self._digest += data
        if len(self._digest) <= _LENGTH.size or len(self._digest) < want:
            return  # more to come (the next readable event)
        sha256 = digest_of(bytes(self._digest[_LENGTH.size:]))
        last = {"id": _RID, "op": "chunk", "last": True, "sha256": sha256} if self._opened else \
            {"id": _RID, **self._first, "sha256": sha256, "last": True}
        self._opened = True
        self.held.from_broker(self, last, b"")
        self._to_reply_phase()

    def _to_reply_phase(self) -> None:
        self.phase = "reply"  # the client has said everything: what follows is the guest's
        self._loop.remove_reader(self.fd)

    # -- what the relay asks of a connection -------------------------------------------------

    def send(self, header: dict, payload: object = b"") -> None:
        """A frame from the guest for this upload: its answer ends it."""
        if header.get("t") == "ok":
            self._report({"t": "stored", "size": header.get("size"), "sha256": header.get("sha256"),
                          "received": self.sent})
        elif header.get("t") == "error":
            self._report({**header, "t": "refused", "received": self.sent})

    def pause(self, paused: bool) -> None:
        self._paused = paused
        self._watch()

    def spliced(self) -> None:
        self.splicing = None
        if not self.alive:  # ended while the relay still held a piece of its socket
            self.sock.close()
        self._watch()

    def abandon(self) -> None:
        """Its piece will never be spliced (the guest is gone)."""
        self.splicing = None
        if self.alive:
            self._fail("the sandbox died", "died")
        else:
            self.sock.close()

    def close_when_flushed(self) -> None:
        self._fail("the sandbox died", "died")

    def close(self) -> None:
        """The sandbox is being forgotten (destroyed)."""
        self._fail("the sandbox was destroyed", "died")

    def _watch(self) -> None:
        if not self.alive or self.splicing is not None or self.phase == "reply":
            return
        if self._paused or self.held.writer.pending > HIGH_WATER:
            self._loop.remove_reader(self.fd)
        else:
            self._loop.add_reader(self.fd, self._readable)

    # -- the end -----------------------------------------------------------------------------

    def fail(self, message: str, reason: str) -> None:
        """End it now (the broker gave up on it, or is gone): the guest drops what it has."""
        self._fail(message, reason)

    def _fail(self, message: str, reason: str) -> None:
        self._report({"t": "broken", "reason": reason, "message": message, "received": self.sent})

    def _report(self, outcome: dict) -> None:
        if not self.alive:
            return
        self.alive = False
        self._timer.cancel()
        self._loop.remove_reader(self.fd)
        # Detached first: an upload the guest has not finished is aborted there (nothing lands).
        self.held.conns.discard(self)
        self.held.detach(self)
        self._send_outcome(outcome)
        if self.splicing is None:
            self.sock.close()
        # else: the relay's writer still splices a whole piece from it; ``spliced`` (or
        # ``abandon``) closes the socket once it has.


def digest_of(body: bytes) -> str:
    """The ``sha256`` of a msgpack-encoded ``SandboxBulkDigest``: a map of strings (its tag and
    its digest). Hand-rolled because the supervisor is standard library only; any other shape is
    refused as a framing error rather than guessed at."""
    fields, pos = {}, 0

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(body):
            raise HandOffStreamError("a short bulk digest frame", "framing")
        pos += n
        return body[pos - n:pos]

    def string() -> str:
        lead = take(1)[0]
        if 0xA0 <= lead <= 0xBF:
            size = lead & 0x1F
        elif lead == 0xD9:
            size = take(1)[0]
        elif lead == 0xDA:
            size = int.from_bytes(take(2), "big")
        else:
            raise HandOffStreamError("a bulk digest frame that is not a map of strings", "framing")
        try:
            return take(size).decode()
        except UnicodeDecodeError as exc:
            raise HandOffStreamError("a bulk digest frame with a bad string", "framing") from exc

    lead = take(1)[0]
    if 0x80 <= lead <= 0x8F:
        count = lead & 0x0F
    elif lead == 0xDE:
        count = int.from_bytes(take(2), "big")
    else:
        raise HandOffStreamError("a bulk digest frame that is not a map", "framing")
    for _ in range(count):
        key = string()
        fields[key] = string()
    sha256 = fields.get("sha256", "")
    if pos != len(body) or fields.get("type") != "sandbox.bulk_digest" or not _SHA256.fullmatch(sha256):
        raise HandOffStreamError("a bulk digest frame without a sha256", "framing")
    return sha256
