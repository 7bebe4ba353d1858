"""Sandbox broker request/reply pairs and the exec output event. Knows msgspec only.

Every request is answered, never with silence: a request that could not run at all gets a reply
whose ``error_kind`` is set (and ``retry_after_s`` when waiting may help, e.g. "capacity"). An
exec that did run reports how it ended in ``result``; a tool's own failure (non-zero exit,
timeout, oom, signal, output cut) is a normal result, while "sandbox_died" and "infra_error"
say the sandbox failed, not the tool. Bytes (stdin, output, file data) travel as msgpack bin.

Files larger than one NATS message travel in chunks: uploads carry ``upload_id``, ``offset`` and
the size and sha256 of the whole file; downloads are read at ``offset`` until ``eof``. The
sandbox side computes the sha256 of what it stored or read; a mismatch is "checksum_mismatch".

Every request made for a rollout carries its ``rollout_id`` ("" otherwise, e.g. from the CLI).
The broker only logs and traces it: the request's spans and log lines name the rollout.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from rollmesh.messages.base import WireMessage

SandboxErrorKind = Literal[
    "",
    "invalid_request",  # the request is malformed or asks for more than the broker allows
    "unknown_lease",  # no such lease (released, reaped, or never granted)
    "lease_expired",  # its TTL ran out without a heartbeat
    "unknown_snapshot",  # no such snapshot (expired or evicted)
    "capacity",  # max sandboxes or max concurrent execs reached: retry after retry_after_s
    "path_error",  # a path that is absolute or leaves the workspace, or an unsafe archive
    "transfer_error",  # a file could not be stored or read (missing, not a file, too large)
    "checksum_mismatch",  # the sha256 of what was stored or read is not what was sent
    "sandbox_died",  # the leased sandbox is gone; the lease is useless
    "infra_error",  # the runtime failed (could not create a sandbox, ...): not the caller's fault
    "internal_error",  # the broker itself failed on this request
    "bad_token",  # a bulk stream's token is unknown, spent, expired, or another lease's
]
ExecResultKind = Literal[
    "", "exit", "timeout", "oom", "signal", "output_truncated", "sandbox_died", "infra_error"
]
TransferKind = Literal["file", "tar"]  # "tar": a tar of a workspace directory
Token = Annotated[str, Meta(min_length=1, max_length=200)]
LeaseId = Annotated[str, Meta(min_length=1, max_length=200)]
WorkspacePath = Annotated[str, Meta(min_length=1, max_length=4096)]
TtlSeconds = Annotated[float, Meta(gt=0, le=30 * 24 * 3600)]
Sha256Hex = Annotated[str, Meta(pattern="^([0-9a-f]{64})?$")]
RolloutRef = Annotated[str, Meta(max_length=200)]  # the rollout a request is made for, or ""


class SandboxLimitsSpec(Struct, frozen=True, kw_only=True):
    """Per-sandbox limits. In a request each field is an override of the profile's value (None:
    keep the profile's); in a reply every field is filled with what the sandbox got."""

    memory_mb: Annotated[int, Meta(ge=16)] | None = None
    pids: Annotated[int, Meta(ge=8)] | None = None
    workspace_mb: Annotated[int, Meta(ge=1)] | None = None
    exec_timeout_s: Annotated[float, Meta(gt=0)] | None = None
    cpu_s: Annotated[int, Meta(ge=1)] | None = None
    file_size_mb: Annotated[int, Meta(ge=1)] | None = None
    max_output_bytes: Annotated[int, Meta(ge=1024)] | None = None


class SandboxLeaseRequest(WireMessage, frozen=True, tag="sandbox.lease_request"):
    # The idempotency token (a rollout's id): while its lease lives, a retried request with the
    # same token gets the same lease, never a second sandbox.
    holder: Token
    ttl_s: TtlSeconds | None = None  # None: the broker's default; a heartbeat extends by this
    network: bool = False  # refused unless the profile allows network
    profile: str = "default"
    limits: SandboxLimitsSpec = SandboxLimitsSpec()
    rollout_id: RolloutRef = ""
    # When the requester stops waiting for the reply (wall clock, seconds since the epoch; 0: it
    # waits however long). A broker serving it later makes no sandbox for it, and gives back at
    # once a lease it granted too late, unless a retry with the same holder waits on it still.
    deadline: Annotated[float, Meta(ge=0)] = 0.0


class SandboxLeaseReply(WireMessage, frozen=True, tag="sandbox.lease_reply"):
    lease_id: str = ""
    backend: str = ""
    isolated: bool = False
    expires_at: float = 0.0
    error_kind: SandboxErrorKind = ""
    error: str = ""
    profile: str = ""
    ttl_s: float = 0.0
    limits: SandboxLimitsSpec = SandboxLimitsSpec()
    warm: bool = False  # it came from the warm pool (no creation wait)
    retry_after_s: float = 0.0
    broker: str = ""  # the broker holding it ("" from a broker without an id: in process)


class SandboxExecRequest(WireMessage, frozen=True, tag="sandbox.exec_request"):
    """Run ``argv`` (no shell) or ``shell`` (one ``sh -c`` string): exactly one of the two."""

    lease_id: LeaseId
    argv: Annotated[list[str], Meta(max_length=4096)] = []
    shell: str = ""
    stdin: bytes = b""
    timeout_s: Annotated[float, Meta(gt=0)] | None = None  # None: the lease's exec_timeout_s
    env: dict[str, str] = {}
    cwd: str = ""  # workspace-relative; "" is the workspace
    # With stream_output, output chunks are published on rl.<ns>.sandbox.output as they come,
    # tagged with exec_id (the caller's, or one the broker picks).
    exec_id: Annotated[str, Meta(max_length=200)] = ""
    stream_output: bool = False
    rollout_id: RolloutRef = ""


class SandboxExecReply(WireMessage, frozen=True, tag="sandbox.exec_reply"):
    result: ExecResultKind = ""  # "" only when error_kind says the exec could not run at all
    exit_code: int | None = None
    signal: int | None = None
    truncated: bool = False
    stdout: bytes = b""
    stderr: bytes = b""
    duration_s: float = 0.0
    error_kind: SandboxErrorKind = ""
    error: str = ""
    cpu_s: float = 0.0
    detail: str = ""  # why, for infra_error / sandbox_died / oom
    exec_id: str = ""
    retry_after_s: float = 0.0


class SandboxOutputProduced(WireMessage, frozen=True, tag="sandbox.output"):
    """A chunk of a streamed exec's output (core NATS: at most once; the reply has it all)."""

    lease_id: str
    exec_id: str
    stream: Literal["stdout", "stderr"]
    offset: int  # bytes of this stream published before this chunk
    data: bytes


class SandboxBulkTicket(Struct, frozen=True, kw_only=True):
    """Where and how to open the direct stream of one bulk transfer (rollmesh/messages/
    sandbox_bulk.py): a one-time token for this lease and file, usable until ``expires_at``."""

    token: str
    host: str = ""  # TCP ("" and port 0: not offered over TCP)
    port: int = 0
    tls: bool = False  # the TCP stream is TLS (with the security.nats_tls certificates)
    unix_path: str = ""  # a Unix socket, for a client on the broker's node ("" when none)
    node: str = ""  # the broker's node (host name and boot id): whether unix_path is reachable
    expires_at: float = 0.0


class SandboxUploadRequest(WireMessage, frozen=True, tag="sandbox.upload_request"):
    """One chunk of an upload; chunks of one upload share ``upload_id`` and come in order."""

    lease_id: LeaseId
    path: WorkspacePath  # the file, or for kind "tar" the directory to extract into
    data: bytes
    size: Annotated[int, Meta(ge=0)]  # of the whole file
    # Of the whole file: the sandbox refuses to store bytes whose sha256 differs. "" only for a
    # single-chunk upload whose sender checks the reply's sha256 itself (it can then hash while
    # the bytes are on their way instead of before sending them).
    sha256: Sha256Hex
    kind: TransferKind = "file"
    upload_id: Annotated[str, Meta(max_length=200)] = ""  # "" for a single-chunk upload
    offset: Annotated[int, Meta(ge=0)] = 0
    mode: Annotated[int, Meta(ge=0, le=0o7777)] = 0o644
    rollout_id: RolloutRef = ""
    # Ask for a bulk ticket instead of sending ``data`` (empty then): a file's bytes then go over
    # the direct stream, its name and sha256 with them. The ticket is good for one upload to this
    # lease of at most sandbox.max_transfer_bytes. A broker without a bulk path gives none.
    bulk: bool = False


class SandboxUploadReply(WireMessage, frozen=True, tag="sandbox.upload_reply"):
    received: int = 0  # bytes of this upload the broker holds
    complete: bool = False  # stored in the sandbox and verified
    size: int = 0
    sha256: str = ""  # computed in the sandbox, of what it stored
    error_kind: SandboxErrorKind = ""
    error: str = ""
    bulk: SandboxBulkTicket | None = None  # the answer to a request with ``bulk``


class SandboxDownloadRequest(WireMessage, frozen=True, tag="sandbox.download_request"):
    lease_id: LeaseId
    path: WorkspacePath
    kind: TransferKind = "file"
    # Chunks of one download share download_id (the broker reads the file once, at offset 0).
    download_id: Annotated[str, Meta(max_length=200)] = ""
    offset: Annotated[int, Meta(ge=0)] = 0
    max_bytes: Annotated[int, Meta(ge=1)] = 4 * 1024 * 1024
    rollout_id: RolloutRef = ""
    # The client can take a bulk stream: a file above sandbox.bulk_threshold_bytes is then
    # answered with a ticket (and its size and sha256) instead of its first chunk.
    bulk: bool = False


class SandboxDownloadReply(WireMessage, frozen=True, tag="sandbox.download_reply"):
    data: bytes = b""
    offset: int = 0
    size: int = 0  # of the whole file (or tar)
    sha256: str = ""  # of the whole file, computed in the sandbox
    eof: bool = False
    error_kind: SandboxErrorKind = ""
    error: str = ""
    bulk: SandboxBulkTicket | None = None  # read it over the direct stream (no data here)


class SandboxSnapshotRequest(WireMessage, frozen=True, tag="sandbox.snapshot_request"):
    """Keep a tar of the lease's workspace in the broker, to fork new leases from."""

    lease_id: LeaseId
    rollout_id: RolloutRef = ""


class SandboxSnapshotReply(WireMessage, frozen=True, tag="sandbox.snapshot_reply"):
    snapshot_id: str = ""
    size: int = 0
    sha256: str = ""
    expires_at: float = 0.0
    error_kind: SandboxErrorKind = ""
    error: str = ""


class SandboxForkRequest(WireMessage, frozen=True, tag="sandbox.fork_request"):
    """``count`` new leases whose workspaces start as the snapshot, with the snapshot's profile
    and limits. Idempotent by ``holder``: fork i gets the token ``<holder>/<i>``."""

    snapshot_id: Annotated[str, Meta(min_length=1, max_length=200)]
    holder: Token
    count: Annotated[int, Meta(ge=1, le=256)] = 1
    ttl_s: TtlSeconds | None = None
    rollout_id: RolloutRef = ""


class ForkedLease(Struct, frozen=True, kw_only=True):
    lease_id: str
    holder: str
    expires_at: float


class SandboxForkReply(WireMessage, frozen=True, tag="sandbox.fork_reply"):
    leases: list[ForkedLease] = []
    error_kind: SandboxErrorKind = ""
    error: str = ""
    retry_after_s: float = 0.0


class SandboxHeartbeatRequest(WireMessage, frozen=True, tag="sandbox.heartbeat_request"):
    """Extend the lease by its TTL from now: the holder is alive. With ``exec_id``, also ask
    whether that exec is running here (or just ended): a client waiting for an exec's reply
    probes so, and sends the exec again when its broker does not know it (it restarted)."""

    lease_id: LeaseId
    rollout_id: RolloutRef = ""
    exec_id: Annotated[str, Meta(max_length=200)] = ""


class SandboxHeartbeatReply(WireMessage, frozen=True, tag="sandbox.heartbeat_reply"):
    expires_at: float = 0.0
    error_kind: SandboxErrorKind = ""
    error: str = ""
    exec_known: bool = False  # the request's exec_id is running here, or ended a moment ago


class SandboxReleaseRequest(WireMessage, frozen=True, tag="sandbox.release_request"):
    lease_id: LeaseId
    rollout_id: RolloutRef = ""


class SandboxReleaseReply(WireMessage, frozen=True, tag="sandbox.release_reply"):
    released: bool = False
    error_kind: SandboxErrorKind = ""
    error: str = ""


class SandboxLoadReported(WireMessage, frozen=True, tag="sandbox.load"):
    """A broker's load, every ``sandbox.pool_interval_s`` (core NATS: the next report makes good
    a lost one). Brokers read each other's to place leases (``rollmesh.sandbox.placement``)."""

    broker: str
    leases: int = 0  # active leases
    live_sandboxes: int = 0  # leased, warm and being created
    max_sandboxes: int = 0
    warm: dict[str, int] = {}  # ready warm sandboxes per profile
    running_execs: int = 0
    node: str = ""  # where it runs (for people; placement does not read it)


class SandboxLeaseRecord(WireMessage, frozen=True, tag="sandbox.lease_record"):
    """A broker's lease, durable: the value of its key in the sandbox-lease KV bucket, written
    when it is granted (and as its expiry moves), deleted when it ends. A restarted broker reads
    its own (``broker``) and re-adopts each lease whose sandbox its node's supervisor still holds.
    ``expires_at`` may lag the live lease's by up to ``expiry_slack_s``, never more."""

    lease_id: str
    holder: str
    broker: str
    sandbox_id: str
    profile: str
    limits: SandboxLimitsSpec
    network: bool
    ttl_s: float
    expires_at: float
    expiry_slack_s: float = 0.0
    warmable: bool = False
    warm: bool = False


class SandboxSnapshotRecord(WireMessage, frozen=True, tag="sandbox.snapshot_record"):
    """A workspace snapshot in the shared snapshot store, beside its tar: what any broker needs
    to fork it (the terms of the lease it was taken from) and to check the tar it reads
    (``size``, ``sha256``). Written after the tar, so a record found names a complete tar."""

    snapshot_id: str
    size: int
    sha256: str
    profile: str
    limits: SandboxLimitsSpec
    network: bool
    warmable: bool = False
    source_lease: str = ""
