"""The host's end of a streamed upload: a file whose bytes are still arriving (the bulk stream's
socket reads) goes to the guest piece by piece, so the guest writes and hashes the first piece
while the next is on its way, instead of after the whole file is in the broker.

Knows the guest's upload frames (the same ``put_file`` / ``put_tar`` then ``chunk`` frames a
chunked upload uses) and ``GuestPipes``; nothing of sockets or leases. The guest refuses a file
whose sha256 is not the sender's, and pieces that end before ``size`` (or fail) abort the upload
in the guest: either way nothing lands in the workspace.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from rollmesh.sandbox import guest_wire as wire
from rollmesh.sandbox.errors import TransferError, WorkspacePathError
from rollmesh.sandbox.sandbox_protocol import FileTransfer

# Unwritten bytes at which reading the next piece waits for the pipe (bounds the broker's memory).
STREAM_HIGH_WATER = 2 * wire.CHUNK


class StreamedUploads:
    """Mixed into ``GuestSandbox``: ``put_stream``. Uses the pipes' ``_open``, ``_send``,
    ``_wait_drained`` and ``_raise_for``."""

    async def put_stream(self, path: str, size: int, pieces: AsyncIterator[bytes | memoryview], *,
                         kind: str = "file", mode: int = 0o644,
                         expected_sha256: str | Callable[[], str]) -> FileTransfer:
        """``expected_sha256``: the sender's digest, or (a sender that hashes while it sends) a
        function that gives it once the last piece is in; it goes with the last frame then."""
        first_sha = {"sha256": expected_sha256} if isinstance(expected_sha256, str) else {}

        def last_sha() -> dict[str, object]:
            return {"sha256": expected_sha256 if isinstance(expected_sha256, str) else expected_sha256()}

        try:
            rel = wire.workspace_relative(path, allow_root=kind == "tar")
        except ValueError as exc:
            raise WorkspacePathError(f"path {path!r} refused: {exc}", path=str(path)) from None
        op = "put_tar" if kind == "tar" else "put_file"
        extra: dict[str, object] = {} if kind == "tar" else {"mode": int(mode)}
        rid, call = self._open()  # type: ignore[attr-defined]
        sent, opened = 0, False
        try:
            try:
                async for piece in pieces:
                    if call.frames:  # refused early (a bad path, a full disk): its reply says why
                        break
                    sent += len(piece)
                    header = ({"id": rid, "op": "chunk"} if opened else
                              {"id": rid, "op": op, "path": rel, "size": size, **first_sha, **extra})
                    if sent >= size:
                        header.update(last_sha(), last=True)
                    self._send(header, piece)  # type: ignore[attr-defined]
                    opened = True
                    await self._wait_drained(STREAM_HIGH_WATER)  # type: ignore[attr-defined]
                if not opened and size == 0:  # an empty file
                    self._send({"id": rid, "op": op, "path": rel, "size": 0, **last_sha(),  # type: ignore[attr-defined]
                                "last": True, **extra})
                if sent < size and not call.frames:
                    raise TransferError(f"{sent} bytes came for a {size}-byte upload", path=rel,
                                        reason="size mismatch")
            except BaseException:
                if opened and sent < size and not call.frames:
                    self._send({"id": rid, "op": "chunk", "last": True, "abort": True})  # type: ignore[attr-defined]
                raise
            fields = self._raise_for(await call.next())  # type: ignore[attr-defined]
        finally:
            self._calls.pop(rid, None)  # type: ignore[attr-defined]
        return FileTransfer(path=rel, size=int(fields.get("size", -1)), sha256=str(fields.get("sha256", "")))
