"""The broker's side of handing a bulk upload to the sandbox supervisor: once the broker checked
a client's one-time token, the client's connected Unix socket goes to the supervisor that holds
the lease's sandbox (SCM_RIGHTS, op ``bulk_put``), which moves the bytes into the guest itself
(``supervisor_bulk``), so a MiB is not received and sent again by the broker. The broker waits
for the outcome on its hand-off connection and answers the client as before.

Knows the supervisor's socket and frames (``supervisor_wire``, ``guest_wire``) and the upload's
fields; nothing of tokens, leases or NATS. Only for a plain Unix-socket stream to a supervised
sandbox: TCP and TLS streams, and sandboxes this broker spawned itself, keep the broker's relay.
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


class HandOffTarget:
    """Where a supervised sandbox's uploads can be handed: its supervisor's socket address."""

    def __init__(self, address: str, sandbox_id: str, backend: str) -> None:
        self.address = address
        self.sandbox_id = sandbox_id
        self.backend = backend

    async def upload(self, client: socket.socket, *, path: str, size: int, sha256: str, kind: str, mode: int,
                     timeout_s: float) -> tuple[int, str]:
        """Hand ``client`` (its hello read, its bytes not) to the supervisor and wait for the
        upload's end: the stored size and sha256 (hashed in the sandbox), or the typed error
        (``BulkStreamError`` for a stream that broke or ended early, nothing stored then).
        The broker keeps its own copy of the socket, to answer the client."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, self.address)
                head = wire.encode_head({"op": "bulk_put", "sandbox_id": self.sandbox_id, "path": path, "size": size,
                                         "sha256": sha256, "kind": kind, "mode": mode, "timeout_s": timeout_s})
                # A small frame into a fresh socket: the kernel takes it whole, descriptor attached.
                sent = sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [client.fileno()]))])
                if sent != len(head):
                    raise OSError("the supervisor's socket took part of a hand-off frame")
                outcome = await _read_outcome(loop, sock)
            except OSError as exc:
                raise SandboxDiedError("the sandbox supervisor could not take the upload", backend=self.backend,
                                       sandbox_id=self.sandbox_id, reason=str(exc)) from exc
        finally:
            sock.close()
        return self._result(outcome, path, size)

    def _result(self, outcome: dict, path: str, size: int) -> tuple[int, str]:
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


async def _read_outcome(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> dict:
    """The supervisor's one frame: a JSON header, no payload."""
    data = bytearray()
    while True:
        if len(data) >= wire.PREFIX.size:
            header_len, payload_len = wire.PREFIX.unpack_from(data)
            if header_len > MAX_OUTCOME_BYTES or payload_len:
                raise OSError(f"an outcome frame of {header_len} + {payload_len} bytes")
            if len(data) >= wire.PREFIX.size + header_len:
                try:
                    outcome = json.loads(data[wire.PREFIX.size:wire.PREFIX.size + header_len])
                except ValueError as exc:
                    raise OSError(f"a bad outcome frame: {exc}") from exc
                if not isinstance(outcome, dict):
                    raise OSError("an outcome frame that is not an object")
                return outcome
        chunk = await loop.sock_recv(sock, MAX_OUTCOME_BYTES)
        if not chunk:
            raise OSError("the supervisor hung up before the upload's outcome")
        data += chunk
