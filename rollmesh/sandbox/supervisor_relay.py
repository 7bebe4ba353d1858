"""One held sandbox in the supervisor: its guest's pipes, the brokers attached to it, and the
frames relayed between them.

Standard library only (run by ``supervisor.py`` as a script, next to ``guest_wire``). The relay
is plain non-blocking fds on the event loop with ``guest_wire``'s reader and writer, as the
broker's own end (``guest_pipes``) is: a tool call pays two more hops here, so no asyncio
streams or threads. It stays frame-aligned in both directions (a broker killed mid-frame leaves
a half frame in its socket, never in the guest's pipe) and rewrites request ids, since each
broker connection numbers its own from 1. A large frame from a broker (an upload's piece) whose
payload is all in the socket's receive queue already is moved into the guest's pipe with
``splice`` (``SplicePayload``), never through user space; one not all there yet is read and
copied as any other, so the guest's pipe never gets a frame its broker could leave unfinished.
An exec sent with ``key`` (the broker's ``exec_id``) keeps all its frames until ``keep_s``
after it ended: the same key sent again attaches to it (what it said so far is replayed)
instead of running the command twice. Backpressure: a full guest pipe pauses reading from the
brokers; a full broker socket pauses reading the guest.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import socket
import subprocess
import time

if __package__:
    from rollmesh.sandbox import guest_wire as wire
    from rollmesh.sandbox import supervisor_splice as splicing
else:  # run as a script: its own directory is on sys.path
    import guest_wire as wire  # type: ignore[no-redef]
    import supervisor_splice as splicing  # type: ignore[no-redef]

SPLICE_AT, SplicePayload, SpliceWriter = splicing.SPLICE_AT, splicing.SplicePayload, splicing.SpliceWriter
queued_bytes, splice_usable = splicing.queued_bytes, splicing.splice_usable

TERMINAL = ("done", "ok", "error")  # a guest answer that ends its request
UPLOADS = ("put_file", "put_tar")
MAX_PAYLOAD = wire.CHUNK + 64 * 1024
HIGH_WATER = 8 * 1024 * 1024  # bytes queued for one peer before the other side is paused
F_SETPIPE_SZ = 1031
PIPE_SIZE = 1024 * 1024
class Conn:
    """One broker's connection to one held sandbox."""

    def __init__(self, held: Held, sock: socket.socket) -> None:
        self.held = held
        self.sock = sock
        self.fd = sock.fileno()
        self.reader = wire.FrameReader(MAX_PAYLOAD)
        self.writer = wire.FrameWriter(self.fd)
        self.ids: dict[int, int] = {}  # this broker's request id -> the guest's
        self.alive = True
        self.closing = False  # close once what is queued is written (the guest is gone)
        self.splicing: SplicePayload | None = None  # its next bytes are that payload's: not read
        self._close_after_splice = False
        # Whether the loop watches the socket: changed only when that changes, since asking the
        # loop to (un)watch costs more than the frame's own write (every frame goes by here).
        self.reading = False
        self.writing = False
        self._loop = asyncio.get_running_loop()

    def start(self) -> None:
        self._loop.add_reader(self.fd, self._readable)
        self.reading = True

    def send(self, header: dict, payload: bytes | bytearray | memoryview = b"") -> None:
        if self.alive:
            self.writer.send(header, payload)
            self._flush()

    def _flush(self) -> None:
        try:
            done = self.writer.flush()
        except OSError:
            self.close()
            return
        if done:
            if self.writing:
                self._loop.remove_writer(self.fd)
                self.writing = False
            if self.closing:
                self.close()
                return
        elif not self.writing:
            self._loop.add_writer(self.fd, self._flush)
            self.writing = True
        self.held.conn_pressure(self, self.writer.pending > HIGH_WATER)

    def _readable(self) -> None:
        try:
            big = self._big_frame()
            if big is not None:
                self.held.from_broker(self, *big)
                return
            frames = self.reader.read(self.fd)
        except BlockingIOError:
            return
        except (EOFError, wire.WireError, OSError):
            self.close()  # the broker hung up, or died: its sandbox lives on
            return
        for header, payload in frames:
            self.held.from_broker(self, header, payload)

    def _big_frame(self) -> tuple[dict, SplicePayload] | None:
        """The next frame, its payload left in the socket to splice, when it is a large one all
        received; None (nothing read) otherwise, and whenever the reader holds a part frame."""
        reader = self.reader
        if reader._big is not None or reader._start != reader._end or not splice_usable():
            return None
        prefix = self.sock.recv(wire.PREFIX.size, socket.MSG_PEEK)
        if len(prefix) < wire.PREFIX.size:
            return None
        header_len, payload_len = wire.PREFIX.unpack(prefix)
        if payload_len < SPLICE_AT or payload_len > MAX_PAYLOAD or header_len > wire.MAX_HEADER:
            return None
        queued = queued_bytes(self.fd)
        head_len = wire.PREFIX.size + header_len
        if queued < head_len + payload_len:
            return None  # not all there: copied as it comes, so no half frame can reach the guest
        head = self.sock.recv(head_len)
        if len(head) != head_len:  # cannot be (it was queued); the stream is not to be trusted
            raise wire.WireError("a queued frame header came short")
        try:
            header = json.loads(head[wire.PREFIX.size:])
        except ValueError as exc:
            raise wire.WireError(f"bad frame header: {exc}") from exc
        if not isinstance(header, dict):
            raise wire.WireError("frame header is not an object")
        self.splicing = SplicePayload(self, payload_len)
        self._loop.remove_reader(self.fd)  # until its payload has left the socket
        self.reading = False
        return header, self.splicing

    def abandon(self) -> None:
        """Its payload will never be spliced (the guest is gone): the connection ends."""
        self.splicing = None
        if self.alive:
            self.close()
        else:
            self.sock.close()

    def spliced(self) -> None:
        """Its payload left the socket: the next frame may be read."""
        self.splicing = None
        if self._close_after_splice:
            self.sock.close()
        elif self.alive:
            self.pause(self.held.writer.pending > HIGH_WATER)

    def pause(self, paused: bool) -> None:
        if not self.alive or self.splicing is not None or paused != self.reading:
            return  # (already as asked)
        if paused:
            self._loop.remove_reader(self.fd)
        else:
            self._loop.add_reader(self.fd, self._readable)
        self.reading = not paused

    def close_when_flushed(self) -> None:
        self.closing = True
        if not self.writer.pending:
            self.close()

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self._loop.remove_reader(self.fd)
        self._loop.remove_writer(self.fd)
        self.reading = self.writing = False
        if self.splicing is None:
            self.sock.close()
        else:  # a payload still to splice from it: the socket stays open till that frame is whole
            self._close_after_splice = True
        self.held.detach(self)


class Kept:
    """A keyed exec: every frame the guest sent for it, until ``keep_s`` after it ended."""

    def __init__(self, aid: int) -> None:
        self.aid = aid
        self.frames: list[tuple[dict, bytes | bytearray]] = []
        self.ended_at: float | None = None


class Held:
    """A sandbox's guest process and everything relayed to and from it."""

    def __init__(self, sandbox_id: str, record: dict, process: subprocess.Popen, stderr_fd: int,
                 keep_fds: list[int]) -> None:
        self.sandbox_id = sandbox_id
        self.record = record
        self.process = process
        self.stderr_fd = stderr_fd  # kept open (and passed to each broker): never read here
        self.keep_fds = keep_fds  # the uid's lock (taken while the sandbox lives), its egress socket
        self.egress = None  # its EgressForwarder (profiles with network_allow), served here
        assert process.stdin is not None and process.stdout is not None
        self.in_fd, self.out_fd = process.stdin.fileno(), process.stdout.fileno()
        for fd in (self.in_fd, self.out_fd):
            os.set_blocking(fd, False)
            try:
                fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)
            except OSError:
                pass
        self.reader = wire.FrameReader(MAX_PAYLOAD)
        self.writer = SpliceWriter(self.in_fd)
        self.writing = False  # the loop watches the guest's stdin for room (as Conn.writing)
        self.conns: set[Conn] = set()
        self.routes: dict[int, list[tuple[Conn, int]]] = {}  # the guest's id -> who waits for it
        self.keyed: dict[str, Kept] = {}
        self.kept: dict[int, Kept] = {}
        self.uploads: set[int] = set()  # the guest's ids of uploads whose last chunk is not sent
        self.pressing: set[Conn] = set()  # connections whose queues pause the guest's reading
        self.hello: dict | None = None
        self.exit_code: int | None = None
        self.exited = asyncio.Event()
        self.stdin_closed = False
        self.guest_eof = False  # its stdout ended: the guest is gone (its exit code may lag)
        self._next_aid = 1
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.out_fd, self._guest_readable)
        try:
            self._pidfd = os.pidfd_open(process.pid)
            self._loop.add_reader(self._pidfd, self._reap)
        except OSError:  # already gone: its stdout's end says so
            self._pidfd = -1

    # -- the guest's side --------------------------------------------------------------------

    def _guest_readable(self) -> None:
        try:
            frames = self.reader.read(self.out_fd)
        except BlockingIOError:
            return
        except (EOFError, wire.WireError, OSError):
            self.guest_eof = True
            self._loop.remove_reader(self.out_fd)
            for conn in list(self.conns):  # each attached broker sees its sandbox gone
                conn.close_when_flushed()
            return
        for header, payload in frames:
            self.from_guest(header, payload)

    def _reap(self) -> None:
        code = self.process.poll()
        if code is None:
            return
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        self.exit_code = code
        self.exited.set()

    def to_guest(self, header: dict, payload: bytes | bytearray | memoryview | SplicePayload = b"") -> None:
        if self.stdin_closed:
            if isinstance(payload, SplicePayload):
                payload.discard()
            return
        self.writer.send(header, payload)
        self._flush_guest()

    def _flush_guest(self) -> None:
        try:
            done = self.writer.flush()
        except OSError:  # the guest is gone; its stdout's end tells the brokers
            self.close_stdin()
            return
        if done:
            if self.writing:
                self._loop.remove_writer(self.in_fd)
                self.writing = False
        elif not self.writing:
            self._loop.add_writer(self.in_fd, self._flush_guest)
            self.writing = True
        paused = self.writer.pending > HIGH_WATER
        for conn in self.conns:
            conn.pause(paused)

    def close_stdin(self) -> None:
        """The guest reads EOF: it kills its commands and exits (a destroy's first step)."""
        if not self.stdin_closed:
            self.stdin_closed = True
            for item in self.writer.drop():  # a broker mid-splice: its stream cannot go on
                item.conn.abandon()
            self._loop.remove_writer(self.in_fd)
            self.writing = False
            assert self.process.stdin is not None
            self.process.stdin.close()

    def conn_pressure(self, conn: Conn, over: bool) -> None:
        was = bool(self.pressing)
        (self.pressing.add if over else self.pressing.discard)(conn)
        if bool(self.pressing) != was and not self.guest_eof:
            if self.pressing:
                self._loop.remove_reader(self.out_fd)
            else:
                self._loop.add_reader(self.out_fd, self._guest_readable)

    # -- routing -----------------------------------------------------------------------------

    def attach(self, conn: Conn, hello: dict | None) -> None:
        self.conns.add(conn)
        hello = hello or self.hello  # a spawned guest's own hello, if it came before this
        if hello is not None:
            conn.send(hello)
        conn.start()

    def from_guest(self, header: dict, payload: bytes | bytearray) -> None:
        if header.get("t") == "ready":
            self.hello = header
            for conn in list(self.conns):
                conn.send(header, payload)
            return
        aid = header.get("id")
        ended = header.get("t") in TERMINAL
        kept = self.kept.get(aid)  # type: ignore[arg-type]
        if kept is not None:
            kept.frames.append((header, payload))
            if ended:
                kept.ended_at = time.monotonic()
        routes = self.routes.pop(aid, []) if ended else self.routes.get(aid, [])  # type: ignore[arg-type]
        for conn, rid in routes:
            header["id"] = rid
            conn.send(header, payload)
            if ended:
                conn.ids.pop(rid, None)
        if kept is not None:
            header["id"] = aid  # the kept copy replays with the asker's id
        if ended:
            self.uploads.discard(aid)  # type: ignore[arg-type]

    def from_broker(self, conn: Conn, header: dict, payload: bytes | bytearray | SplicePayload) -> None:
        rid, op = header.get("id"), header.get("op")
        if op == "chunk":
            aid = conn.ids.get(rid)  # type: ignore[arg-type]
            if aid is not None:
                if header.get("last"):
                    self.uploads.discard(aid)
                header["id"] = aid
                self.to_guest(header, payload)
            elif isinstance(payload, SplicePayload):
                payload.discard()
            return
        if op == "cancel":
            target = conn.ids.get(header.get("target"))  # type: ignore[arg-type]
            if target is not None:
                header["target"] = target
                self.to_guest(header)
            if isinstance(payload, SplicePayload):
                payload.discard()
            return
        key = header.pop("key", None) if op == "exec" else None
        if key and key in self.keyed:  # the same exec again: attach to it
            if isinstance(payload, SplicePayload):
                payload.discard()
            kept = self.keyed[key]
            for old, data in kept.frames:
                conn.send({**old, "id": rid}, data)
            if kept.ended_at is None:
                conn.ids[rid] = kept.aid  # type: ignore[index]
                self.routes.setdefault(kept.aid, []).append((conn, rid))  # type: ignore[arg-type]
            return
        aid = self._next_aid
        self._next_aid += 1
        conn.ids[rid] = aid  # type: ignore[index]
        self.routes[aid] = [(conn, rid)]  # type: ignore[list-item]
        if key:
            self.keyed[key] = self.kept[aid] = Kept(aid)
        if op in UPLOADS and not header.get("last"):
            self.uploads.add(aid)
        header["id"] = aid
        self.to_guest(header, payload)

    def detach(self, conn: Conn) -> None:
        self.conns.discard(conn)
        self.conn_pressure(conn, False)
        for aid in set(conn.ids.values()):
            routes = [route for route in self.routes.get(aid, []) if route[0] is not conn]
            if routes:
                self.routes[aid] = routes
            else:
                self.routes.pop(aid, None)
            if aid in self.uploads:  # an upload its broker will never finish: the guest drops it
                self.uploads.discard(aid)
                self.to_guest({"id": aid, "op": "chunk", "last": True, "abort": True})
        conn.ids.clear()

    def expire(self, keep_s: float) -> None:
        now = time.monotonic()
        for key, kept in list(self.keyed.items()):
            if kept.ended_at is not None and now - kept.ended_at > keep_s:
                del self.keyed[key]
                self.kept.pop(kept.aid, None)

    def forget(self) -> None:
        """After the guest exited: nothing of it stays registered or open."""
        for conn in list(self.conns):
            conn.close()
        self._loop.remove_reader(self.out_fd)
        self.close_stdin()
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        assert self.process.stdout is not None
        self.process.stdout.close()
        if self.egress is not None:
            self.egress.close()
            self.egress = None
        for fd in (self.stderr_fd, *self.keep_fds):
            try:
                os.close(fd)
            except OSError:
                pass
