"""What both ends of the guest's pipes share: the frame codec and the workspace path rule.

Standard library only, and no imports of rollmesh: ``guest.py`` imports this file from its own
directory inside the sandbox (run by ``/usr/bin/python3 -I -S``), the host imports it as
``rollmesh.sandbox.guest_wire``. Hand-rolled rather than msgspec because the guest must run on
the bare system Python.

A frame is ``<u32 header length><u32 payload length>``, a JSON object (the header: ``id``,
``op`` or ``t`` and fields), then raw payload bytes (file data, stdin, output). Large transfers
are split into frames of at most ``CHUNK`` bytes, so neither side ever holds a whole 100 MiB
file in one frame. Both ends use non-blocking pipes: a reader never waits for the rest of a
frame, and a writer keeps what the pipe would not take.
"""

from __future__ import annotations

import json
import os
import posixpath
import struct
from collections import deque

PREFIX = struct.Struct("<II")
CHUNK = 4 * 1024 * 1024  # payload bytes per frame of a chunked transfer
MAX_HEADER = 1024 * 1024
# Frames whose payload is at least this big are read straight into their own buffer instead of
# through the staging buffer (one copy fewer for file data).
DIRECT_READ_AT = 64 * 1024
READ_SIZE = 256 * 1024


class WireError(Exception):
    """The other end sent something that is not a frame: the pipe cannot be trusted any more."""


def encode_head(header: dict[str, object], payload_len: int = 0) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    return PREFIX.pack(len(body), payload_len) + body


class FrameReader:
    """Turns what arrives on a non-blocking fd into ``(header, payload)`` frames.

    ``max_payload`` bounds what one frame may make us allocate: the host reads a pipe that code
    in the sandbox can write to, so a length field is never trusted beyond it.

    Fresh memory is slow (every new page is a fault, dear in a VM), so reads land in buffers
    kept across calls: a staging buffer for headers and small frames, and (``reuse``) one
    scratch buffer that large payloads are read straight into. Such payloads come back as
    memoryviews valid only until the next ``read``; without ``reuse`` each gets a fresh
    bytearray. Small payloads are always ``bytes``.
    """

    def __init__(self, max_payload: int, *, reuse: bool = False) -> None:
        self.max_payload = max_payload
        self.reuse = reuse
        self._scratch = bytearray()
        self._stage = bytearray(READ_SIZE)
        self._start = 0  # unparsed bytes are _stage[_start:_end]
        self._end = 0
        self._big: bytearray | memoryview | None = None
        self._big_header: dict = {}
        self._big_filled = 0

    def read(self, fd: int) -> list[tuple[dict, bytes | bytearray | memoryview]]:
        """Read once from ``fd``; the complete frames so far. EOFError at the end of the stream;
        BlockingIOError when nothing was there."""
        if self._big is not None:
            count = os.readv(fd, [memoryview(self._big)[self._big_filled:]])
            if count == 0:
                raise EOFError
            self._big_filled += count
            if self._big_filled < len(self._big):
                return []
            frame = (self._big_header, self._big)
            self._big = None
            return [frame]
        self._make_room()
        count = os.readv(fd, [memoryview(self._stage)[self._end:]])
        if count == 0:
            raise EOFError
        self._end += count
        return self._parse()

    def _make_room(self) -> None:
        start, end = self._start, self._end
        if start == end:
            self._start = self._end = 0
        elif end == len(self._stage):
            if start == 0:  # one frame larger than the stage (a big header): grow, never shrink
                grown = bytearray(2 * len(self._stage))
                grown[:end] = self._stage
                self._stage = grown
            else:
                self._stage[:end - start] = self._stage[start:end]
                self._start, self._end = 0, end - start

    def _parse(self) -> list[tuple[dict, bytes | bytearray | memoryview]]:
        frames: list[tuple[dict, bytes | bytearray | memoryview]] = []
        stage, pos, end = self._stage, self._start, self._end
        while end - pos >= PREFIX.size:
            header_len, payload_len = PREFIX.unpack_from(stage, pos)
            if header_len > MAX_HEADER or payload_len > self.max_payload:
                raise WireError(f"frame too large: header {header_len}, payload {payload_len}")
            body_end = pos + PREFIX.size + header_len
            if end < body_end:
                break
            try:
                header = json.loads(stage[pos + PREFIX.size:body_end])
            except ValueError as exc:
                raise WireError(f"bad frame header: {exc}") from exc
            if not isinstance(header, dict):
                raise WireError("frame header is not an object")
            frame_end = body_end + payload_len
            if end >= frame_end:
                frames.append((header, bytes(memoryview(stage)[body_end:frame_end])))
                pos = frame_end
                continue
            if payload_len >= DIRECT_READ_AT:
                big = bytearray(payload_len) if not self.reuse else self._scratch_view(payload_len)
                big[:end - body_end] = memoryview(stage)[body_end:end]
                self._big, self._big_header, self._big_filled = big, header, end - body_end
                pos = end
            break
        self._start = pos
        return frames

    def _scratch_view(self, size: int) -> memoryview:
        if len(self._scratch) < size:
            self._scratch = bytearray(size)  # replaced, never resized: old views may live on
        return memoryview(self._scratch)[:size]


class FrameWriter:
    """Queues frames for a non-blocking fd; ``flush`` writes what the pipe takes now."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._queue: deque[memoryview] = deque()
        self.pending = 0  # bytes queued, not yet written

    def send(self, header: dict[str, object], payload: bytes | bytearray | memoryview = b"") -> None:
        head = encode_head(header, len(payload))
        self._queue.append(memoryview(head))
        self.pending += len(head)
        if len(payload):
            view = memoryview(payload).cast("B")
            self._queue.append(view)
            self.pending += len(view)

    def flush(self) -> bool:
        """True once everything queued is written. BrokenPipeError when the reader is gone."""
        queue = self._queue
        while queue:
            batch = [queue[i] for i in range(min(len(queue), 64))]
            try:
                written = os.writev(self.fd, batch)
            except BlockingIOError:
                return False
            self.pending -= written
            drop_written(queue, written)
        return True


def drop_written(queue: deque, written: int) -> None:
    """Take ``written`` bytes off the front of a queue of buffers (what a writev sent)."""
    while written:
        head = queue[0]
        if written >= len(head):
            written -= len(head)
            queue.popleft()
        else:
            queue[0] = head[written:]
            written = 0


def workspace_relative(path: str, *, allow_root: bool = False) -> str:
    """The normalized relative form of ``path``, a path inside the workspace; ValueError when
    it is absolute, empty, or leaves the workspace with ``..``.

    A lexical check only: the guest also resolves symlinks on disk before it touches a file.
    """
    if not isinstance(path, str) or "\0" in path:
        raise ValueError("not a path")
    if path.startswith("/"):
        raise ValueError("absolute path")
    normal = posixpath.normpath(path) if path else "."
    if normal == ".." or normal.startswith("../"):
        raise ValueError("leaves the workspace")
    if normal == "." and not allow_root:
        raise ValueError("names the workspace itself")
    return normal
