"""The supervisor relay's zero-copy path for large frames from a broker: the payload goes from
the broker's socket into the guest's pipe with ``splice(2)``, never through user space (no read
into a fresh buffer, no write out of it).

Standard library only (run by ``supervisor.py`` as a script, next to ``guest_wire``). Knows the
frame writer's queue and what it needs of a broker's connection (``sock``, ``fd``,
``spliced()``), nothing of routing. A payload is only spliced once all of it is in the socket's
receive queue (``queued_bytes``): received bytes stay readable after their sender died, so the
frame is always finished and the guest's pipe stays frame-aligned whatever the broker does.
"""

from __future__ import annotations

import fcntl
import functools
import os
import socket
import struct
import termios
from collections import deque
from typing import TYPE_CHECKING

if __package__:
    from rollmesh.sandbox import guest_wire as wire
else:  # run as a script: its own directory is on sys.path
    import guest_wire as wire  # type: ignore[no-redef]

if TYPE_CHECKING:
    from rollmesh.sandbox.supervisor_relay import Conn

# A broker frame whose payload is at least this big is spliced when all of it has arrived.
SPLICE_AT = 64 * 1024
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
_INT = struct.Struct("i")


class SplicePayload:
    """A frame's payload still in a broker's socket, all of it already received (so the frame
    can always be finished): ``size`` bytes to splice from ``conn``'s socket into the pipe."""

    def __init__(self, conn: Conn, size: int) -> None:
        self.conn = conn
        self.size = size
        self.left = size

    def __len__(self) -> int:
        return self.size

    def discard(self) -> None:
        """A frame nobody takes (a chunk of an upload already ended): its bytes are read away."""
        scratch = bytearray(min(self.left, 256 * 1024))
        while self.left:
            count = self.conn.sock.recv_into(scratch, min(self.left, len(scratch)))
            if count == 0:
                raise OSError("the socket ended inside a payload it had received")
            self.left -= count
        self.conn.spliced()


class SpliceWriter(wire.FrameWriter):
    """``guest_wire.FrameWriter`` whose queue may also hold ``SplicePayload``s, moved into the
    fd with ``splice`` in their turn (frames from other brokers wait behind them)."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self._items: deque[memoryview | SplicePayload] = self._queue  # type: ignore[assignment]

    def send(self, header: dict[str, object], payload: bytes | bytearray | memoryview | SplicePayload = b"") -> None:
        if not isinstance(payload, SplicePayload):
            super().send(header, payload)
            return
        head = memoryview(wire.encode_head(header, len(payload)))
        self._items.append(head)
        self._items.append(payload)
        self.pending += len(head) + len(payload)

    def drop(self) -> list[SplicePayload]:
        """Forget what is queued (the fd is closed); the payloads that were still to splice."""
        left = [item for item in self._items if isinstance(item, SplicePayload)]
        self._items.clear()
        self.pending = 0
        return left

    def flush(self) -> bool:
        items = self._items
        while items:
            if isinstance(items[0], SplicePayload):
                spliced = items[0]
                while spliced.left:
                    try:
                        count = os.splice(spliced.conn.fd, self.fd, spliced.left, flags=_SPLICE_FLAGS)
                    except BlockingIOError:
                        return False
                    if count == 0:  # cannot be: every byte was in the socket's receive queue
                        raise BrokenPipeError("the socket ended inside a payload it had received")
                    spliced.left -= count
                    self.pending -= count
                items.popleft()
                spliced.conn.spliced()
                continue
            count = 0
            while count < len(items) and count < 64 and not isinstance(items[count], SplicePayload):
                count += 1
            batch = [items[i] for i in range(count)]
            try:
                written = os.writev(self.fd, batch)  # type: ignore[arg-type]
            except BlockingIOError:
                return False
            self.pending -= written
            wire.drop_written(items, written)  # only buffers: the batch stopped before a splice
        return True


def queued_bytes(fd: int) -> int:
    """How many bytes wait in a socket's receive queue (FIONREAD)."""
    return _INT.unpack(fcntl.ioctl(fd, termios.FIONREAD, _INT.pack(0)))[0]


@functools.cache
def splice_usable() -> bool:
    """Whether this kernel splices from a Unix socket into a pipe (asked once, with one byte):
    where it does not, every frame takes the copying path instead of failing its sandbox."""
    try:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        read_end, write_end = os.pipe()
    except OSError:
        return False
    try:
        theirs.sendall(b"x")
        return os.splice(ours.fileno(), write_end, 1, flags=_SPLICE_FLAGS) == 1
    except (OSError, AttributeError):  # AttributeError: a Python without os.splice
        return False
    finally:
        for sock in (ours, theirs):
            sock.close()
        for fd in (read_end, write_end):
            os.close(fd)
