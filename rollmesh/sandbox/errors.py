"""Errors raised inside the sandbox package: backends, backend selection and tool lookup.

Knows nothing but the standard library. The broker never lets these reach its callers: it answers
with a reply whose ``error_kind`` is set. Foreign exceptions (OSError from spawning) are wrapped at
the boundary with ``raise X(...) from exc``::

    SandboxError                   backend
    +-- BackendUnavailableError    this backend cannot run on this host (reason)
    +-- BackendFailedError         the backend could not run one command (reason, argv0,
    |                              stderr_tail: what the guest, bwrap or runsc said last):
    |                              the sandbox failed, not the tool, so it is an infra failure
    +-- ToolNotFoundError          no tool script of that name ships with rollmesh (tool)
    +-- SandboxDiedError           the sandbox's guest is gone (sandbox_id, reason): infra
    +-- WorkspacePathError         a path that is absolute or leaves the workspace (path)
    +-- UnsafeArchiveError         a tar member that would land outside the workspace (member)
    +-- TransferError              a file could not be stored or read (path, reason)
    +-- RequestRefusedError        a broker request asks for what the config does not allow
    |                              (field): the caller's mistake, answered "invalid_request"
    +-- SandboxCapacityError       no room for another sandbox now: answered "capacity"
    |   |                          (was CapacityError, a name the engine's decode slots also use)
    |   +-- LeaseAbandonedError    every request for this lease gave up waiting before it could be
    |                              granted (holder, deadline): no sandbox made or kept for it
    +-- ChecksumMismatchError      bytes whose sha256 is not the one announced (path)
    +-- BulkTokenError             a bulk stream's token is unknown, spent, expired or another
    |                              lease's (reason, lease_id): answered "bad_token"
    +-- BulkStreamError            a bulk stream broke off or broke its framing (reason,
    |                              expected_bytes, received_bytes): answered "transfer_error"
    +-- SandboxRequestError        (client side) the broker answered error_kind, or could not be
    |                              reached (kind "unreachable"); retry_after_s, operation
    +-- ImageLayoutError           an OCI layout or docker-save tarball that cannot be read as
    |                              one (image, reason): missing index, bad digest, zstd layer
    +-- UnsafeImageError           an image layer's tar member that climbs out of the root or
    |                              would be written through a link (image, member, reason)
    +-- ImageBuildError            a profile's image (root, Python environment) could not be made
                                   ready (profile, reason): at broker start, never in a lease
"""

from __future__ import annotations

from rollmesh.moved_names import forward_moved_names


class SandboxError(Exception):
    """Root of every sandbox error."""

    def __init__(self, message: str, *, backend: str = "") -> None:
        super().__init__(message)
        self.backend = backend


class BackendUnavailableError(SandboxError):
    def __init__(self, message: str, *, backend: str, reason: str = "") -> None:
        super().__init__(f"{message}: {reason}" if reason else message, backend=backend)
        self.reason = reason


class BackendFailedError(SandboxError):
    def __init__(self, message: str, *, backend: str, reason: str = "", argv0: str = "",
                 stderr_tail: str = "") -> None:
        text = f"{message}: {reason}" if reason else message
        if stderr_tail:
            text += f"\n--- its stderr, last lines ---\n{stderr_tail}"
        super().__init__(text, backend=backend)
        self.reason = reason
        self.argv0 = argv0
        self.stderr_tail = stderr_tail


class ToolNotFoundError(SandboxError):
    def __init__(self, message: str, *, tool: str) -> None:
        super().__init__(message)
        self.tool = tool


class SandboxDiedError(SandboxError):
    def __init__(self, message: str, *, backend: str = "", sandbox_id: str = "", reason: str = "") -> None:
        super().__init__(f"{message}: {reason}" if reason else message, backend=backend)
        self.sandbox_id = sandbox_id
        self.reason = reason


class WorkspacePathError(SandboxError):
    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class UnsafeArchiveError(SandboxError):
    def __init__(self, message: str, *, member: str) -> None:
        super().__init__(message)
        self.member = member


class TransferError(SandboxError):
    def __init__(self, message: str, *, path: str, reason: str = "") -> None:
        super().__init__(f"{message}: {reason}" if reason else message)
        self.path = path
        self.reason = reason


class RequestRefusedError(SandboxError):
    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class SandboxCapacityError(SandboxError):
    """The broker leases ``max_sandboxes`` already: no room for another sandbox now."""


class LeaseAbandonedError(SandboxCapacityError):
    """The broker was too slow for this lease: its requests' ``deadline`` (the latest of them)
    passed before a sandbox was ready, so none is made, or the one made is destroyed."""

    def __init__(self, message: str, *, holder: str, deadline: float) -> None:
        super().__init__(message)
        self.holder = holder
        self.deadline = deadline


class ChecksumMismatchError(SandboxError):
    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class BulkTokenError(SandboxError):
    """``reason``: "unknown", "spent" (used once already), "expired" or "other_lease". A token
    refused for another lease is spent too: it was shown to the wrong place."""

    def __init__(self, message: str, *, reason: str, lease_id: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.lease_id = lease_id


class BulkStreamError(SandboxError):
    def __init__(self, message: str, *, reason: str, expected_bytes: int = 0, received_bytes: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.expected_bytes = expected_bytes
        self.received_bytes = received_bytes


class SandboxRequestError(SandboxError):
    def __init__(self, message: str, *, kind: str, operation: str = "", retry_after_s: float = 0.0) -> None:
        super().__init__(f"sandbox {operation} failed ({kind}): {message}" if operation else message)
        self.kind = kind
        self.operation = operation
        self.retry_after_s = retry_after_s


class ImageLayoutError(SandboxError):
    def __init__(self, message: str, *, image: str, reason: str = "") -> None:
        super().__init__(f"{message}: {reason}" if reason else message)
        self.image = image
        self.reason = reason


class UnsafeImageError(SandboxError):
    def __init__(self, message: str, *, image: str, member: str, reason: str = "") -> None:
        super().__init__(f"{message} ({member!r} in {image}): {reason}" if reason else message)
        self.image = image
        self.member = member
        self.reason = reason


class ImageBuildError(SandboxError):
    def __init__(self, message: str, *, profile: str, reason: str = "") -> None:
        super().__init__(f"sandbox profile {profile!r}: {message}: {reason}" if reason
                         else f"sandbox profile {profile!r}: {message}")
        self.profile = profile
        self.reason = reason


# The engine has its own CapacityError (decode slots); the sandbox's old name warns for one release.
__getattr__ = forward_moved_names(__name__, {"CapacityError": "rollmesh.sandbox.errors:SandboxCapacityError"})
