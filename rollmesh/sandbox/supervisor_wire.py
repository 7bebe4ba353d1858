"""What the sandbox supervisor and its clients share: the socket's place and blocking frame I/O
with file descriptors attached.

Standard library only, and no imports of rollmesh beyond ``guest_wire``: ``supervisor.py`` runs
as a plain script next to this file. Frames are ``guest_wire``'s (a JSON header and a payload);
descriptors travel as SCM_RIGHTS with a frame's first bytes. A client's handshake (spawn,
attach, list, destroy, status) is one frame each way on a blocking socket; after a spawn or an
attach the same socket carries the guest's frames in both directions.
"""

from __future__ import annotations

import array
import json
import os
import re
import socket
import sys

if __package__:
    from rollmesh.sandbox import guest_wire as wire
else:  # run as a script (the supervisor): its own directory is on sys.path
    import guest_wire as wire  # type: ignore[no-redef]

# Named by host: a run dir on a shared file system serves one supervisor per node.
_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64]
SOCKET_NAME = f"sandbox-supervisor.{_HOST}.sock"
LOCK_NAME = f"sandbox-supervisor.{_HOST}.lock"
LOG_NAME = f"sandbox-supervisor.{_HOST}.log"
MAX_FDS = 16
SOCKET_BUFFER = 4 * 1024 * 1024  # a 1 MiB upload is one write on both hops
_SUN_PATH_MAX = 104  # sockaddr_un's path, with room to spare on every Linux


class SupervisorProtocolError(OSError):
    """The other end said something that is not a frame, or hung up mid-frame."""


class RunDirPath:
    """A socket path under ``run_dir`` short enough for ``sockaddr_un``: the real one, or the
    same file named through an open descriptor of the directory (``/proc/self/fd/N/...``)."""

    def __init__(self, run_dir: str) -> None:
        self.real = os.path.join(run_dir, SOCKET_NAME)
        self._dir_fd = -1
        if len(self.real.encode()) < _SUN_PATH_MAX:
            self.address = self.real
        else:
            self._dir_fd = os.open(run_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            self.address = f"/proc/self/fd/{self._dir_fd}/{SOCKET_NAME}"

    def close(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1


def tune(sock: socket.socket) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError:
            pass


def send_frame(sock: socket.socket, header: dict, payload: bytes = b"", fds: list[int] = ()) -> None:  # type: ignore[assignment]
    data = wire.encode_head(header, len(payload)) + payload
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv_frame(sock: socket.socket) -> tuple[dict, bytes, list[int]]:
    """One frame and the descriptors that came with it (the caller owns and closes them)."""
    fds: list[int] = []
    prefix = bytearray()
    while len(prefix) < wire.PREFIX.size:
        data, ancillary, _flags, _addr = sock.recvmsg(wire.PREFIX.size - len(prefix),
                                                      socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(raw[:len(raw) - len(raw) % got.itemsize])
                fds.extend(got)
        if not data:
            _close_all(fds)
            raise SupervisorProtocolError("the other end hung up")
        prefix += data
    header_len, payload_len = wire.PREFIX.unpack(prefix)
    if header_len > wire.MAX_HEADER or payload_len > wire.CHUNK + 65536:
        _close_all(fds)
        raise SupervisorProtocolError(f"frame too large: {header_len}, {payload_len}")
    body = _recv_exactly(sock, header_len + payload_len, fds)
    try:
        header = json.loads(body[:header_len])
    except ValueError as exc:
        _close_all(fds)
        raise SupervisorProtocolError(f"bad frame header: {exc}") from exc
    return header, bytes(body[header_len:]), fds


def _recv_exactly(sock: socket.socket, size: int, fds: list[int]) -> bytearray:
    buffer = bytearray(size)
    view, filled = memoryview(buffer), 0
    while filled < size:
        count = sock.recv_into(view[filled:])
        if count == 0:
            _close_all(fds)
            raise SupervisorProtocolError("the other end hung up mid-frame")
        filled += count
    return buffer


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


if sys.platform != "linux":  # pragma: no cover - the sandbox runtimes are Linux-only anyway
    raise ImportError("the sandbox supervisor needs Linux (SCM_RIGHTS, /proc/self/fd)")
