"""The frames of the sandbox bulk stream: a direct socket from a client to a lease's broker for
files above ``sandbox.bulk_threshold_bytes``, opened with a ticket an upload or download reply
carried over NATS (``SandboxBulkTicket``). Knows msgspec only.

One transfer per connection. A frame is a 4-byte big-endian length and one msgpack message:

    client -> broker   frame(SandboxBulkHello)   upload: then exactly ``size`` raw bytes, then
                                                 frame(SandboxBulkDigest) unless the hello
                                                 named the sha256 (a client hashing as it sends)
    broker -> client   frame(SandboxBulkDone)    download without error: then exactly ``size``
                                                 raw bytes

An upload's Done comes after the bytes are stored in the sandbox (or refused); ``error_kind``
uses the broker replies' kinds ("bad_token", "transfer_error", "checksum_mismatch", ...). A
stored upload's Done carries the ticket of the lease's next upload (``next_ticket``), so a
client uploading again pays no ticket round trip over NATS.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from rollmesh.messages.base import WireMessage
from rollmesh.messages.sandbox import LeaseId, SandboxBulkTicket, SandboxErrorKind, Sha256Hex, TransferKind

# The largest frame either side reads: hello and done are a few hundred bytes.
MAX_BULK_FRAME_BYTES = 64 * 1024


class SandboxBulkHello(WireMessage, frozen=True, tag="sandbox.bulk_hello"):
    """The first frame a client sends: which ticket, for which lease. An upload names its file
    and the size and sha256 of the bytes that follow; the sandbox refuses to store any others.
    (An upload's ticket is for one upload to its lease, so a client may hold one before it
    knows the file: ``SandboxBrokerClient`` keeps the one a stored upload's Done brought.)"""

    token: Annotated[str, Meta(min_length=1, max_length=200)]
    lease_id: LeaseId
    size: Annotated[int, Meta(ge=0)] = 0
    sha256: Sha256Hex = ""  # upload: "" when a SandboxBulkDigest follows the bytes
    path: str = ""  # upload: the file, or for kind "tar" the directory to extract into
    kind: TransferKind = "file"
    mode: Annotated[int, Meta(ge=0, le=0o7777)] = 0o644


class SandboxBulkDigest(WireMessage, frozen=True, tag="sandbox.bulk_digest"):
    """An upload's sha256, after its bytes (when its hello had none)."""

    sha256: Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]


class SandboxBulkDone(WireMessage, frozen=True, tag="sandbox.bulk_done"):
    """The broker's only frame: how the transfer ended. ``size`` and ``sha256`` are of what the
    sandbox stored (upload) or read (download), hashed inside the sandbox."""

    size: int = 0
    sha256: str = ""
    error_kind: SandboxErrorKind = ""
    error: str = ""
    # A stored upload's: a fresh one-time ticket for the same lease's next upload (None from a
    # broker that predates it, or when it has none to give: the client then asks over NATS).
    next_ticket: SandboxBulkTicket | None = None
