"""Sandbox broker request/reply pairs. Knows msgspec only.

A failed request is answered with a reply whose ``error_kind`` is set, never with silence.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from rollmesh.messages.base import WireMessage

SandboxErrorKind = Literal[
    "",
    "invalid_request",
    "unknown_lease",
    "lease_expired",
    "capacity",
    "timeout",
    "backend_error",
    "output_too_large",
]


class SandboxLeaseRequest(WireMessage, frozen=True, tag="sandbox.lease_request"):
    holder: str
    ttl_s: Annotated[float, Meta(gt=0, le=7 * 24 * 3600)] = 600.0
    network: bool = False
    writable_root: bool = False


class SandboxLeaseReply(WireMessage, frozen=True, tag="sandbox.lease_reply"):
    lease_id: str = ""
    backend: str = ""
    isolated: bool = False
    expires_at: float = 0.0
    error_kind: SandboxErrorKind = ""
    error: str = ""


class SandboxExecRequest(WireMessage, frozen=True, tag="sandbox.exec_request"):
    lease_id: str
    argv: Annotated[list[str], Meta(min_length=1)]
    stdin: str = ""
    timeout_s: Annotated[float, Meta(gt=0, le=24 * 3600)] = 10.0


class SandboxExecReply(WireMessage, frozen=True, tag="sandbox.exec_reply"):
    exit_code: int = -1
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    timed_out: bool = False
    error_kind: SandboxErrorKind = ""
    error: str = ""


class SandboxReleaseRequest(WireMessage, frozen=True, tag="sandbox.release_request"):
    lease_id: str


class SandboxReleaseReply(WireMessage, frozen=True, tag="sandbox.release_reply"):
    released: bool = False
    error_kind: SandboxErrorKind = ""
    error: str = ""
