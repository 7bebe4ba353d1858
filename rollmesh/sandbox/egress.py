"""Per-sandbox egress allowlist (``network_allow``): a forwarder outside the sandbox, listening on
a Unix socket that is bound into the sandbox at ``/.rollmesh/egress.sock``, which opens TCP
connections only to the profile's allowed ``host:port`` pairs.

Knows asyncio streams and HTTP CONNECT's request line; nothing of bwrap or leases. Enforcement
is outside the sandbox: the sandbox keeps its own empty network namespace (loopback only), so
this socket is its only way out, and the forwarder decides. A tool asks for a target as an HTTP
proxy is asked (``CONNECT host:port HTTP/1.1`` then a blank line), gets ``200`` and a byte
stream, or ``403`` for a target not on the list (``502`` when an allowed one cannot be reached).
Targets are matched as written in the config (a host name is not widened to its addresses).
Hand-rolled rather than a proxy server package: it is one request line and two byte pumps, and
what it must refuse is this module's whole point.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
from collections.abc import Sequence
from pathlib import Path

EGRESS_SOCKET = "/.rollmesh/egress.sock"
HANDSHAKE_TIMEOUT_S = 30.0
_MAX_HEADER_LINES = 64
_CHUNK = 64 * 1024


def _split(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]").lower(), int(port)


class EgressForwarder:
    """One sandbox's forwarder. ``start`` makes the socket (its path: ``socket_path``);
    ``close`` stops listening and cuts every open connection."""

    def __init__(self, allow: Sequence[str]) -> None:
        self.targets = list(allow)  # as written in the config (what a supervisor is handed)
        self.allow = frozenset(_split(target) for target in allow)
        self._dir = ""
        self.socket_path = ""
        self._server: asyncio.AbstractServer | None = None
        self.listener: socket.socket | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.refused = 0

    async def start(self) -> str:
        """Listen and serve here (the broker holding its sandboxes itself)."""
        await self.serve(self.listen())
        return self.socket_path

    def listen(self) -> socket.socket:
        """The bound, listening socket, not yet served: a supervisor that holds the sandbox
        serves it (``serve``), so the allowlist outlives the broker that made it."""
        # A private directory reachable (not listable) by the sandbox's uid: bwrap binds the
        # socket as that user. Short path: Unix socket names are limited to 108 bytes.
        self._dir = tempfile.mkdtemp(prefix="rollmesh-egress-")
        os.chmod(self._dir, 0o711)
        self.socket_path = str(Path(self._dir) / "egress.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.socket_path)
        os.chmod(self.socket_path, 0o666)
        self.listener.listen(64)
        return self.listener

    async def serve(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        self._server = await asyncio.start_unix_server(self._serve, sock=listener)

    def close(self) -> None:
        """Stop serving and cut every open connection; the socket's directory goes too."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for writer in list(self._writers):
            writer.close()
        if self._dir:
            remove_socket_dir(self._dir)


    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            target = await asyncio.wait_for(self._request(reader), HANDSHAKE_TIMEOUT_S)
            if target is None or target not in self.allow:
                self.refused += 1
                writer.write(b"HTTP/1.1 403 Forbidden\r\n\r\n")
                await writer.drain()
                return
            try:
                up_reader, upstream = await asyncio.wait_for(asyncio.open_connection(*target), HANDSHAKE_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError):
                writer.write(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
                await writer.drain()
                return
            self._writers.add(upstream)
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await asyncio.gather(_pump(reader, upstream), _pump(up_reader, writer))
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the tool went away or spoke nonsense: its connection ends, nothing else does
        finally:
            for end in (writer, upstream):
                if end is not None:
                    self._writers.discard(end)
                    end.close()

    @staticmethod
    async def _request(reader: asyncio.StreamReader) -> tuple[str, int] | None:
        words = (await reader.readline()).decode("latin-1").split()
        for _ in range(_MAX_HEADER_LINES):  # the headers, unused
            if (await reader.readline()) in (b"\r\n", b"\n", b""):
                break
        if len(words) != 3 or words[0] != "CONNECT" or ":" not in words[1]:
            return None
        try:
            return _split(words[1])
        except ValueError:
            return None


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while chunk := await source.read(_CHUNK):
            sink.write(chunk)
            await sink.drain()
    finally:
        if sink.can_write_eof():
            with contextlib.suppress(OSError):
                sink.write_eof()


def remove_socket_dir(directory: str) -> None:
    """The forwarder's private directory and its socket (whoever served it)."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(directory, "egress.sock"))
    with contextlib.suppress(OSError):
        os.rmdir(directory)
