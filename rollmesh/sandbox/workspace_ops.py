"""What runs inside a leased sandbox: exec (with streamed output), uploads, downloads, snapshots.

Knows the sandbox messages, the runtime seam and a ``Publisher`` for output chunks; nothing of
NATS, Ray or which leases exist (the broker hands it a live lease). Every outcome is a reply:
an exec that ran reports its ``result``; one that could not run at all gets ``error_kind``.

End-to-end checksums, each file hashed once at each end: the client sends the sha256 of the whole
file and the sandbox's guest hashes what it stored; they must be equal (corruption anywhere on the
way in). Downloads carry the guest's sha256 of what it read, and the client checks the bytes it
received against it. Snapshots, which stay in the broker, are also checked here.

The bulk path: an upload asking for it (``bulk``), or a download above
``sandbox.bulk_threshold_bytes`` whose client can take it, is answered with a one-time ticket
while a bulk server listens (``bulk_endpoint``; ``bulk_server.py`` serves the stream and calls
``store_bulk`` / ``read_bulk`` here; ``store_handed_off`` when the sandbox's supervisor takes
the client's socket itself). Without one, uploads get no ticket and go over NATS.
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import structlog
from opentelemetry import propagate, trace

from rollmesh.config import SandboxConfig
from rollmesh.messages.sandbox import (
    SandboxBulkTicket,
    SandboxDownloadReply,
    SandboxDownloadRequest,
    SandboxErrorKind,
    SandboxExecReply,
    SandboxExecRequest,
    SandboxOutputProduced,
    SandboxSnapshotReply,
    SandboxUploadReply,
    SandboxUploadRequest,
)
from rollmesh.messages.sandbox_bulk import SandboxBulkDone, SandboxBulkHello
from rollmesh.messages.subjects import SANDBOX_OUTPUT
from rollmesh.ports import Publisher
from rollmesh.telemetry import conventions
from rollmesh.sandbox.errors import (
    BulkStreamError,
    ChecksumMismatchError,
    RequestRefusedError,
    SandboxCapacityError,
    SandboxDiedError,
    TransferError,
    UnsafeArchiveError,
    WorkspacePathError,
)
from rollmesh.sandbox import guest_wire as wire
from rollmesh.sandbox.bulk_handoff import HandOffTarget
from rollmesh.sandbox.bulk_stream import PayloadPieces
from rollmesh.sandbox.bulk_tokens import BulkGrant, BulkTokens
from rollmesh.sandbox.leases import Lease
from rollmesh.sandbox.sandbox_protocol import ExecOutcome, OutputCallback, OutputStream, Sandbox
from rollmesh.sandbox.snapshots import SnapshotStore
from rollmesh.sandbox.transfers import Download

log = structlog.get_logger(__name__)
_tracer = trace.get_tracer("rollmesh.sandbox")

# An output chunk on the bus is at most this long (a chatty tool must not make huge messages).
OUTPUT_CHUNK_BYTES = 256 * 1024
# A handed-off upload may take this long plus a second per MiB before its supervisor cuts it
# off (the bulk server's IO_TIMEOUT_S; the server waits a little longer for the outcome).
HAND_OFF_TIMEOUT_S = 60.0


def failure_of(exc: BaseException) -> tuple[SandboxErrorKind, str]:
    """The reply's error_kind for an exception out of the runtime, and its text."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SandboxDiedError):
        return "sandbox_died", text
    if isinstance(exc, SandboxCapacityError):
        return "capacity", str(exc)
    if isinstance(exc, RequestRefusedError):
        return "invalid_request", str(exc)
    if isinstance(exc, (WorkspacePathError, UnsafeArchiveError)):
        return "path_error", str(exc)
    if isinstance(exc, ChecksumMismatchError) or (isinstance(exc, TransferError) and "sha256" in exc.reason):
        return "checksum_mismatch", str(exc)  # the runtime's own end-to-end check failed
    if isinstance(exc, TransferError):
        return "transfer_error", str(exc)
    return "infra_error", text


def with_trace_context(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus the current span's ``TRACEPARENT``/``TRACESTATE`` (the OpenTelemetry carrier
    for child processes), unless the caller set them; unchanged when nothing is being traced."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    for key, value in carrier.items():
        env.setdefault(key.upper(), value)
    return env


def exec_reply(outcome: ExecOutcome, exec_id: str) -> SandboxExecReply:
    return SandboxExecReply(
        result=outcome.result, exit_code=outcome.exit_code, signal=outcome.signal,
        truncated=outcome.truncated, stdout=outcome.stdout, stderr=outcome.stderr,
        duration_s=outcome.duration_s, cpu_s=outcome.cpu_s, detail=outcome.detail, exec_id=exec_id,
    )


class WorkspaceOps:
    def __init__(self, config: SandboxConfig, snapshots: SnapshotStore, *, publisher: Publisher | None,
                 new_id: Callable[[], str], counts: Counter[str]) -> None:
        self.config = config
        self._snapshots = snapshots
        self._publisher = publisher
        self._new_id = new_id
        self._counts = counts
        self.running_execs = 0
        self.bulk_tokens = BulkTokens(ttl_s=config.bulk_token_ttl_s)
        # Set by the bulk server while it listens (a BulkEndpoint): what tickets advertise.
        self.bulk_endpoint: _Advertiser | None = None

    # -- exec ------------------------------------------------------------------------------

    async def exec(self, lease: Lease, req: SandboxExecRequest, *, now: Callable[[], float]) -> SandboxExecReply:
        exec_id = req.exec_id or self._new_id()
        refusal = self._exec_refusal(lease, req)
        if refusal is not None:
            return SandboxExecReply(error_kind="invalid_request", error=refusal, exec_id=exec_id)
        if self.running_execs >= self.config.max_concurrent_execs:
            self._counts["execs_refused"] += 1
            return SandboxExecReply(
                error_kind="capacity", exec_id=exec_id, retry_after_s=self.config.capacity_retry_after_s,
                error=f"all {self.config.max_concurrent_execs} concurrent execs are running")
        if lease.died:
            return SandboxExecReply(result="sandbox_died", exec_id=exec_id, detail="the sandbox died earlier")
        self.running_execs += 1
        lease.running_execs += 1
        lease.extend(now())
        # The broker's own span: its parent is the exec request's process span, and the tool
        # process gets its traceparent (TRACEPARENT in its environment) to continue the trace.
        # Attributes are built only for a span that records (a sampled-out one drops them).
        with _tracer.start_as_current_span(conventions.SPAN_SANDBOX_EXEC) as span:
            recording = span.is_recording()
            if recording:
                span.set_attributes({conventions.RL_SANDBOX_LEASE_ID: lease.lease_id,
                                     conventions.RL_SANDBOX_EXEC_ID: exec_id})
            try:
                reply = await self._run_exec(lease, req, exec_id)
            finally:
                self.running_execs -= 1
                lease.running_execs -= 1
                lease.extend(now())
            if recording:
                ended = {conventions.RL_SANDBOX_RESULT: reply.result or reply.error_kind}
                if reply.exit_code is not None:
                    ended[conventions.RL_SANDBOX_EXIT_CODE] = reply.exit_code
                span.set_attributes(ended)
                if reply.result != "exit":
                    span.set_status(trace.StatusCode.ERROR, reply.result or reply.error_kind)
        if reply.error_kind:
            return reply
        if reply.result == "sandbox_died":
            lease.died = True
        self._counts["execs"] += 1
        self._counts[f"exec_{reply.result}"] += 1
        return reply

    async def _run_exec(self, lease: Lease, req: SandboxExecRequest, exec_id: str) -> SandboxExecReply:
        try:
            outcome = await lease.sandbox.exec(
                list(req.argv) or None, shell=req.shell or None, stdin=req.stdin,
                timeout_s=req.timeout_s or lease.terms.limits.exec_timeout_s,
                env=with_trace_context(dict(req.env)) or None, cwd=req.cwd or None,
                on_output=self._streamer(lease, exec_id) if req.stream_output else None,
                key=exec_id,
            )
            return exec_reply(outcome, exec_id)
        except Exception as exc:  # noqa: BLE001 - the runtime's failures are results, by contract
            kind, text = failure_of(exc)
            if kind == "path_error":  # a cwd outside the workspace: the caller's mistake
                return SandboxExecReply(error_kind=kind, error=text, exec_id=exec_id)
            result = "sandbox_died" if kind == "sandbox_died" else "infra_error"
            log.warning("sandbox exec failed", lease_id=lease.lease_id, result=result, error=text)
            return SandboxExecReply(result=result, detail=text, exec_id=exec_id)

    def _exec_refusal(self, lease: Lease, req: SandboxExecRequest) -> str | None:
        if bool(req.argv) == bool(req.shell):
            return "give exactly one of argv (a non-empty list) and shell (a command string)"
        most = lease.terms.limits.exec_timeout_s
        if req.timeout_s is not None and req.timeout_s > most:
            return f"timeout_s = {req.timeout_s:g} is above this lease's exec_timeout_s {most:g}"
        return None

    def _streamer(self, lease: Lease, exec_id: str) -> OutputCallback | None:
        publisher = self._publisher
        if publisher is None:
            return None
        offsets: dict[OutputStream, int] = {"stdout": 0, "stderr": 0}
        budget = [lease.terms.limits.max_output_bytes]
        failed = [False]

        async def on_output(stream: OutputStream, data: bytes) -> None:
            data = data[: max(0, budget[0])]
            budget[0] -= len(data)
            for start in range(0, len(data), OUTPUT_CHUNK_BYTES):
                piece = data[start:start + OUTPUT_CHUNK_BYTES]
                chunk = SandboxOutputProduced(lease_id=lease.lease_id, exec_id=exec_id, stream=stream,
                                              offset=offsets[stream], data=piece)
                offsets[stream] += len(piece)
                try:
                    await publisher.publish(SANDBOX_OUTPUT, chunk)
                except Exception as exc:  # noqa: BLE001 - streaming is best effort; the reply has it all
                    if not failed[0]:
                        log.warning("sandbox output publish failed", exec_id=exec_id, error=repr(exc))
                    failed[0] = True

        return on_output

    # -- files -----------------------------------------------------------------------------

    async def upload(self, lease: Lease, req: SandboxUploadRequest) -> SandboxUploadReply:
        if lease.died:
            return SandboxUploadReply(error_kind="sandbox_died", error="the sandbox died")
        if req.size > self.config.max_transfer_bytes:
            return SandboxUploadReply(error_kind="transfer_error",
                                      error=f"{req.size} bytes is above sandbox.max_transfer_bytes "
                                            f"({self.config.max_transfer_bytes})")
        if req.bulk:
            return self._upload_ticket(lease, req)
        if req.upload_id and not req.sha256:
            return SandboxUploadReply(error_kind="invalid_request",
                                      error="a chunked upload must carry the whole file's sha256")
        try:
            assembled = lease.transfers.add_chunk(req)
        except RequestRefusedError as exc:
            return SandboxUploadReply(error_kind="invalid_request", error=str(exc))
        if isinstance(assembled, int):
            return SandboxUploadReply(received=assembled, size=req.size)
        try:
            # Checked end to end, once: the sandbox hashes what it stored and that must be the
            # client's digest (so corruption anywhere on the way in is caught there).
            expected = req.sha256 or None  # None: the sender checks the reply's digest
            if req.kind == "tar":
                stored = await lease.sandbox.put_tar(req.path, assembled, expected_sha256=expected,
                                                     verify=False)
            else:
                stored = await lease.sandbox.put_file(req.path, assembled, mode=req.mode,
                                                      expected_sha256=expected, verify=False)
        except Exception as exc:  # noqa: BLE001
            return self._transfer_failed(lease, SandboxUploadReply, "upload", req.path, exc)
        self._counts["uploads"] += 1
        return SandboxUploadReply(received=len(assembled), complete=True, size=len(assembled),
                                  sha256=stored.sha256)

    async def download(self, lease: Lease, req: SandboxDownloadRequest) -> SandboxDownloadReply:
        if lease.died:
            return SandboxDownloadReply(error_kind="sandbox_died", error="the sandbox died")
        found = lease.transfers.download(req.download_id)
        if found is None:
            if req.offset != 0:
                return SandboxDownloadReply(error_kind="invalid_request",
                                            error=f"download {req.download_id!r} is unknown here: start at offset 0")
            try:
                found = await self._read(lease.sandbox, req.path, req.kind)
            except Exception as exc:  # noqa: BLE001
                return self._transfer_failed(lease, SandboxDownloadReply, "download", req.path, exc)
            if req.bulk and self.bulk_endpoint is not None and len(found.data) > self.config.bulk_threshold_bytes:
                grant = self.bulk_tokens.issue("download", lease, req.path, kind=req.kind, download=found)
                return SandboxDownloadReply(size=len(found.data), sha256=found.sha256,
                                            bulk=self.bulk_endpoint.ticket(grant))
            lease.transfers.keep_download(req.download_id, found)
        size = len(found.data)
        end = min(size, req.offset + min(req.max_bytes, self.config.transfer_chunk_bytes))
        eof = end >= size
        if eof:
            lease.transfers.finish_download(req.download_id)
            self._counts["downloads"] += 1
        return SandboxDownloadReply(data=found.data[req.offset:end], offset=req.offset, size=size,
                                    sha256=found.sha256, eof=eof)

    # -- the bulk path ---------------------------------------------------------------------

    def _upload_ticket(self, lease: Lease, req: SandboxUploadRequest) -> SandboxUploadReply:
        return SandboxUploadReply(size=req.size, bulk=self.upload_ticket(lease))

    def upload_ticket(self, lease: Lease) -> SandboxBulkTicket | None:
        """A ticket for any one upload to this lease (the stream's hello names the file); None
        while no bulk server listens (the client sends over NATS)."""
        if self.bulk_endpoint is None or lease.transfers.closed:
            return None
        grant = self.bulk_tokens.issue("upload", lease, "", size=self.config.max_transfer_bytes)
        return self.bulk_endpoint.ticket(grant)

    async def store_bulk(self, grant: BulkGrant, hello: SandboxBulkHello, pieces: PayloadPieces) -> SandboxBulkDone:
        """Store a bulk upload's bytes as they arrive (a sandbox that takes a stream gets each
        piece at once); the sandbox refuses them unless their sha256 is the client's, and a
        stream that breaks off (``BulkStreamError``, raised) aborts it: nothing lands then."""
        lease = grant.lease
        refusal = _ended(lease)
        if refusal is not None:
            return refusal
        put_stream = getattr(lease.sandbox, "put_stream", None)
        path = hello.path
        try:
            if put_stream is not None:  # the digest may come after the bytes: read when the last piece is
                stored = await put_stream(path, hello.size, pieces, kind=hello.kind, mode=hello.mode,
                                          expected_sha256=lambda: pieces.sha256)
            elif hello.kind == "tar":
                data = await pieces.collect()
                stored = await lease.sandbox.put_tar(path, data, expected_sha256=pieces.sha256,  # type: ignore[arg-type]
                                                     verify=False)
            else:
                data = await pieces.collect()
                stored = await lease.sandbox.put_file(path, data, mode=hello.mode,  # type: ignore[arg-type]
                                                      expected_sha256=pieces.sha256, verify=False)
        except BulkStreamError:
            self._counts["upload_failures"] += 1
            raise
        except Exception as exc:  # noqa: BLE001
            return self._transfer_failed(lease, SandboxBulkDone, "upload", path, exc)
        self._counts["uploads"] += 1
        self._counts["bulk_uploads"] += 1
        return SandboxBulkDone(size=stored.size, sha256=stored.sha256)

    def hand_off_target(self, grant: BulkGrant) -> HandOffTarget | None:
        """Where the lease's sandbox takes a bulk upload's socket itself (its supervisor)."""
        hand_off = getattr(grant.lease.sandbox, "hand_off_target", None)
        return None if hand_off is None else hand_off()

    async def store_handed_off(self, grant: BulkGrant, hello: SandboxBulkHello, target: HandOffTarget,
                               client: socket.socket) -> SandboxBulkDone:
        """``store_bulk`` with the client's socket handed to the sandbox's supervisor, which
        moves the bytes into the sandbox (the guest checks the client's sha256 there); a stream
        that breaks off raises ``BulkStreamError`` and nothing lands."""
        lease = grant.lease
        refusal = _ended(lease)
        if refusal is not None:
            return refusal
        try:
            rel = wire.workspace_relative(hello.path, allow_root=hello.kind == "tar")
        except ValueError as exc:
            return self._transfer_failed(lease, SandboxBulkDone, "upload", hello.path,
                                         WorkspacePathError(f"path {hello.path!r} refused: {exc}", path=hello.path))
        try:
            size, sha256 = await target.upload(client, path=rel, size=hello.size, sha256=hello.sha256,
                                               kind=hello.kind, mode=hello.mode,
                                               timeout_s=HAND_OFF_TIMEOUT_S + hello.size / 2**20)
        except BulkStreamError:
            self._counts["upload_failures"] += 1
            raise
        except Exception as exc:  # noqa: BLE001
            return self._transfer_failed(lease, SandboxBulkDone, "upload", hello.path, exc)
        self._counts["uploads"] += 1
        self._counts["bulk_uploads"] += 1
        self._counts["bulk_handed_off"] += 1
        return SandboxBulkDone(size=size, sha256=sha256)

    def read_bulk(self, grant: BulkGrant) -> tuple[SandboxBulkDone, bytes]:
        """A bulk download's bytes (read from the sandbox when its ticket was issued)."""
        refusal = _ended(grant.lease)
        if refusal is not None or grant.download is None:
            return refusal or SandboxBulkDone(error_kind="invalid_request", error="not a download"), b""
        self._counts["downloads"] += 1
        self._counts["bulk_downloads"] += 1
        return SandboxBulkDone(size=len(grant.download.data), sha256=grant.download.sha256), grant.download.data

    async def _read(self, sandbox: Sandbox, path: str, kind: str, *, verify: bool = False) -> Download:
        """``verify``: hash the bytes here too (snapshots, which stay in the broker); downloads
        are checked by the client against the sandbox's digest, end to end."""
        data, read = await (sandbox.get_tar(path, verify=verify) if kind == "tar"
                            else sandbox.get_file(path, verify=verify))
        if len(data) > self.config.max_transfer_bytes:
            raise TransferError(f"{len(data)} bytes is above sandbox.max_transfer_bytes", path=path)
        return Download(data, read.sha256)

    # -- snapshots -------------------------------------------------------------------------

    async def snapshot(self, lease: Lease, snapshot_id: str) -> SandboxSnapshotReply:
        if lease.died:
            return SandboxSnapshotReply(error_kind="sandbox_died", error="the sandbox died")
        try:
            tar = await self._read(lease.sandbox, ".", "tar", verify=True)
            kept = await self._snapshots.put(snapshot_id, tar.data, sha256=tar.sha256, terms=lease.terms,
                                             source_lease=lease.lease_id)
        except Exception as exc:  # noqa: BLE001
            return self._transfer_failed(lease, SandboxSnapshotReply, "snapshot", ".", exc)
        self._counts["snapshots"] += 1
        return SandboxSnapshotReply(snapshot_id=kept.snapshot_id, size=kept.size, sha256=kept.sha256,
                                    expires_at=kept.expires_at)

    async def restore(self, sandbox: Sandbox, tar: bytes, sha256: str) -> None:
        """Seed a fresh sandbox's workspace with a snapshot (a fork); raises on any failure
        (``ChecksumMismatchError`` when the sandbox did not receive the snapshot's bytes)."""
        await sandbox.put_tar(".", tar, expected_sha256=sha256)

    def _transfer_failed(self, lease: Lease, reply_type: type, what: str, path: str, exc: Exception):
        kind, text = failure_of(exc)
        if kind == "sandbox_died":
            lease.died = True
        self._counts[f"{what}_failures"] += 1
        log.info("sandbox transfer failed", lease_id=lease.lease_id, what=what, path=path, error_kind=kind,
                 error=text)
        return reply_type(error_kind=kind, error=text)


class _Advertiser(Protocol):
    def ticket(self, grant: BulkGrant) -> SandboxBulkTicket: ...


def _ended(lease: Lease) -> SandboxBulkDone | None:
    """Why a bulk transfer may no longer touch its lease's sandbox (None: it may)."""
    if lease.transfers.closed:
        return SandboxBulkDone(error_kind="unknown_lease", error=f"lease {lease.lease_id!r} ended")
    if lease.died or not lease.sandbox.alive():
        lease.died = True
        return SandboxBulkDone(error_kind="sandbox_died", error="the sandbox died")
    return None
