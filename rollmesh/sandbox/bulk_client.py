"""The client's end of the bulk data path: tickets asked for over the broker client's request
path, the next upload's ticket kept, and uploads and downloads over the stream (``bulk_stream``).

Knows the sandbox messages, the bulk stream and a ``call`` (``SandboxBrokerClient._call``: a
request to the lease's broker, its refusals raised as ``SandboxRequestError``); nothing of NATS.
Every method answers None when the bulk path is of no use (no ticket, no route from here, a
socket that does not open): the caller then moves the file over NATS.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from rollmesh.messages.sandbox import (
    SandboxBulkTicket,
    SandboxDownloadReply,
    SandboxUploadReply,
    SandboxUploadRequest,
    TransferKind,
)
from rollmesh.messages.subjects import SANDBOX_UPLOAD
from rollmesh.sandbox.bulk_stream import download_over_stream, stream_route, upload_over_stream
from rollmesh.sandbox.errors import BulkStreamError, ChecksumMismatchError, SandboxRequestError

# A kept ticket is used only while it has this long left (clocks differ a little across nodes).
KEPT_TICKET_MARGIN_S = 5.0
MAX_KEPT_TICKETS = 1024  # leases with a kept ticket: the oldest goes first
# Hashing more than this goes to a thread: it drops the GIL, so it overlaps the event loop's work.
_HASH_IN_THREAD_BYTES = 256 * 1024


async def sha256_hex(data: bytes) -> str:
    if len(data) < _HASH_IN_THREAD_BYTES:
        return hashlib.sha256(data).hexdigest()
    return await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())


class BulkClient:
    """``tls``: the context a TLS stream's server is verified with (the NATS client's)."""

    def __init__(self, call: Callable[..., Awaitable[Any]], *, tls: ssl.SSLContext | None, timeout_s: float) -> None:
        self._call = call
        self.tls = tls
        self.timeout_s = timeout_s
        self.kept: OrderedDict[str, SandboxBulkTicket] = OrderedDict()  # lease id -> its next upload's ticket

    def forget(self, lease_id: str) -> None:
        """The lease ended: its kept ticket goes."""
        self.kept.pop(lease_id, None)

    async def upload(self, lease_id: str, path: str, data: bytes, *, kind: TransferKind,
                     mode: int, rollout_id: str, fresh: bool = False) -> SandboxUploadReply | None:
        """Over the bulk stream; None when the broker gave no ticket this client can use (the
        caller sends over NATS). A ticket is good for one upload to its lease; a stored upload's
        Done frame brings the next one, kept (until shortly before it lapses), so uploads after
        the first to a lease pay no ticket round trip. ``data`` is hashed while it is sent, its
        digest sent after it. A kept ticket the broker no longer knows, or whose stream is gone (the
        broker restarted), is replaced once by a fresh one (``fresh``)."""
        hashing = asyncio.ensure_future(sha256_hex(data))
        kept = None if fresh else self._kept_ticket(lease_id)
        try:
            ticket = kept or await self._upload_ticket(lease_id, path, len(data), kind, rollout_id)
        except BaseException:
            await asyncio.gather(hashing, return_exceptions=True)
            raise
        route = None if ticket is None else stream_route(ticket, self.tls)
        if ticket is None or route is None:
            await hashing
            if kept is not None:
                return await self.upload(lease_id, path, data, kind=kind, mode=mode, rollout_id=rollout_id, fresh=True)
            return None
        # The digest follows the bytes: hashing overlaps sending them and the sandbox storing them.
        send = upload_over_stream(ticket, route, lease_id=lease_id, path=path, data=data, sha256=hashing,
                                  tls=self.tls, kind=kind, mode=mode)
        try:
            sent = await asyncio.wait_for(send, self.timeout_s + len(data) / 2**20)
        except (OSError, asyncio.TimeoutError, BulkStreamError) as exc:
            sent = exc
        finally:
            sha256 = await hashing
        unreachable = isinstance(sent, BulkStreamError) and sent.reason == "unreachable"  # nothing was sent
        if kept is not None and (unreachable or getattr(sent, "error_kind", "") == "bad_token"):
            return await self.upload(lease_id, path, data, kind=kind, mode=mode, rollout_id=rollout_id, fresh=True)
        if unreachable:
            return None  # NATS still reaches the broker
        if isinstance(sent, BaseException):
            raise SandboxRequestError(f"the bulk stream failed: {sent!r}", kind="transfer_error",
                                      operation="upload") from sent
        if sent.next_ticket is not None:
            self._keep_ticket(lease_id, sent.next_ticket)
        if sent.error_kind:
            raise SandboxRequestError(sent.error, kind=sent.error_kind, operation="upload")
        if sent.size != len(data) or sent.sha256 != sha256:
            raise SandboxRequestError(f"{path!r}: the sandbox stored {sent.size} bytes with sha256 "
                                      f"{sent.sha256}, not {len(data)} with {sha256}",
                                      kind="checksum_mismatch", operation="upload")
        return SandboxUploadReply(received=sent.size, complete=True, size=sent.size, sha256=sent.sha256)

    async def download(self, reply: SandboxDownloadReply, lease_id: str, path: str) -> bytes | None:
        """The bytes a download reply's ticket names; None when the ticket is of no use here."""
        route = stream_route(reply.bulk, self.tls)
        if route is None:
            return None
        try:
            done, data = await asyncio.wait_for(download_over_stream(
                reply.bulk, route, lease_id=lease_id, tls=self.tls), self.timeout_s + reply.size / 2**20)
        except ChecksumMismatchError as exc:
            raise SandboxRequestError(f"{path!r}: {exc}", kind="checksum_mismatch", operation="download") from exc
        except BulkStreamError as exc:
            if exc.reason == "unreachable":
                return None
            raise SandboxRequestError(f"the bulk stream failed: {exc}", kind="transfer_error",
                                      operation="download") from exc
        except (OSError, asyncio.TimeoutError) as exc:
            raise SandboxRequestError(f"the bulk stream failed: {exc!r}", kind="transfer_error",
                                      operation="download") from exc
        if done.error_kind:
            raise SandboxRequestError(done.error, kind=done.error_kind, operation="download")
        if (done.size, done.sha256) != (reply.size, reply.sha256):
            raise SandboxRequestError(f"{path!r}: the stream's {done.size} bytes with sha256 {done.sha256} "
                                      f"are not the announced {reply.size} with {reply.sha256}",
                                      kind="checksum_mismatch", operation="download")
        return data

    async def _upload_ticket(self, lease_id: str, path: str, size: int, kind: TransferKind,
                             rollout_id: str) -> SandboxBulkTicket | None:
        reply = await self._call(SANDBOX_UPLOAD, SandboxUploadRequest(
            lease_id=lease_id, path=path, data=b"", size=size, sha256="", kind=kind, rollout_id=rollout_id,
            bulk=True), "upload")
        return reply.bulk

    def _kept_ticket(self, lease_id: str) -> SandboxBulkTicket | None:
        ticket = self.kept.pop(lease_id, None)
        if ticket is None or ticket.expires_at - time.time() < KEPT_TICKET_MARGIN_S:
            return None
        return ticket

    def _keep_ticket(self, lease_id: str, ticket: SandboxBulkTicket) -> None:
        self.kept[lease_id] = ticket
        while len(self.kept) > MAX_KEPT_TICKETS:
            self.kept.popitem(last=False)
