"""How rollouts and the CLI talk to the sandbox broker: typed calls over request/reply.

Files above ``bulk_threshold_bytes`` move over the broker's bulk stream instead (``bulk_client``:
a ticket over NATS, then a direct socket), still verified by sha256 end to end; where the broker
offers none, or its ticket is of no use here (TLS without ``bulk_tls``, another node with no TCP
offered, a socket that does not open), the same call goes over NATS.

Knows the sandbox messages and the ``Publisher`` port (its ``request``); nothing of NATS or Ray,
so the same client runs over the bus or, in tests and the CLI's in-process mode, straight into a
broker. A reply with ``error_kind`` set, or no reply at all, raises ``SandboxRequestError``
(kind "unreachable" when the broker could not be reached); an exec that ran returns its reply,
whatever its ``result``. Files larger than one chunk move in chunks and are verified by sha256
end to end. A call made for a rollout names it (``rollout_id``): the request carries it, so the
request's span, the broker's span and both sides' log lines name the rollout. With several
brokers, a lease's requests (and a snapshot's forks) go to the broker holding it, which its id
names (``rollmesh.sandbox.placement``); a new lease goes to the shared subject, placed by the
brokers.
A lease request carries its deadline (when this client stops waiting, by its wall clock: hosts of
one cluster keep their clocks in step), so a broker that is behind makes no sandbox for a request
nobody waits for any more.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollmesh.messages import WireMessage
from rollmesh.messages.sandbox import (
    ForkedLease,
    SandboxDownloadRequest,
    SandboxExecReply,
    SandboxExecRequest,
    SandboxForkRequest,
    SandboxHeartbeatRequest,
    SandboxLeaseReply,
    SandboxLeaseRequest,
    SandboxLimitsSpec,
    SandboxReleaseRequest,
    SandboxSnapshotReply,
    SandboxSnapshotRequest,
    SandboxUploadReply,
    SandboxUploadRequest,
    TransferKind,
)
from rollmesh.messages.subjects import (
    SANDBOX_DOWNLOAD,
    SANDBOX_EXEC,
    SANDBOX_FORK,
    SANDBOX_HEARTBEAT,
    SANDBOX_LEASE,
    SANDBOX_RELEASE,
    SANDBOX_SNAPSHOT,
    SANDBOX_UPLOAD,
    Subject,
    broker_subject,
)
from rollmesh.ports import Publisher, RequestFailedError
from rollmesh.sandbox.bulk_client import BulkClient, sha256_hex
from rollmesh.sandbox.errors import SandboxRequestError

if TYPE_CHECKING:
    from rollmesh.sandbox_config import SandboxConfig
from rollmesh.sandbox.placement import broker_of

# Below the embedded NATS server's 8 MiB max payload with room for the message around the data.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
# How long a request may wait on a busy broker beyond the work it asked for.
BROKER_GRACE_S = 30.0
# An exec without its own timeout waits for the default profile's limit (10 min) plus grace.
DEFAULT_EXEC_WAIT_S = 600.0
# An exec request unanswered this long is sent again with its exec_id (attached, never rerun).
EXEC_ATTEMPT_S = 30.0
# ... and while it waits, its broker is probed this often (a dead one is found in about this long).
EXEC_PROBE_S = 2.0
# ... and once it is found gone, a restarted one is waited for this long at most.
EXEC_REATTACH_S = 60.0
# A capacity refusal is retried after its retry hint, but never waits longer than this at once.
MAX_RETRY_WAIT_S = 10.0
# Uploads above this ask for the bulk stream (sandbox.bulk_threshold_bytes' default).
DEFAULT_BULK_THRESHOLD_BYTES = 64 * 1024


class SandboxBrokerClient:
    def __init__(self, requester: Publisher, *, timeout_s: float = BROKER_GRACE_S,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
                 sleep: Callable[[float], Any] = asyncio.sleep,
                 bulk_threshold_bytes: int | None = DEFAULT_BULK_THRESHOLD_BYTES,
                 bulk_tls: ssl.SSLContext | None = None, exec_attempt_s: float = EXEC_ATTEMPT_S,
                 exec_probe_s: float = EXEC_PROBE_S, exec_reattach_s: float = EXEC_REATTACH_S,
                 clock: Callable[[], float] = time.time) -> None:
        """``bulk_threshold_bytes`` None: never use the bulk stream. ``bulk_tls``: the context
        a TLS bulk stream is verified with (the NATS client's). ``exec_attempt_s``: how long an
        exec request waits for its reply before it is sent again (same ``exec_id``);
        ``exec_probe_s``: how often its broker is probed meanwhile; ``exec_reattach_s``: how
        long one found gone is waited for. ``clock``: the wall clock lease deadlines are
        stamped with."""
        self.exec_attempt_s = exec_attempt_s
        self.exec_probe_s = exec_probe_s
        self.exec_reattach_s = exec_reattach_s
        self._requester = requester
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.bulk_threshold_bytes = bulk_threshold_bytes
        self._bulk = BulkClient(self._call, tls=bulk_tls, timeout_s=timeout_s)
        self._new_id = new_id
        self._sleep = sleep
        self._clock = clock

    @classmethod
    def from_config(cls, requester: Publisher, config: SandboxConfig, *, bulk_tls: ssl.SSLContext | None = None,
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> SandboxBrokerClient:
        """A client that sends files above the deployment's ``sandbox.bulk_threshold_bytes`` over
        the bulk stream, as its brokers expect (the rollout workers and ``rollmesh sandbox``)."""
        return cls(requester, chunk_bytes=chunk_bytes, bulk_threshold_bytes=config.bulk_threshold_bytes,
                   bulk_tls=bulk_tls)

    async def lease(self, holder: str, *, profile: str = "default", ttl_s: float | None = None,
                    network: bool = False, limits: SandboxLimitsSpec = SandboxLimitsSpec(),
                    capacity_retries: int = 0, rollout_id: str = "", held_lease: str = "",
                    wait_s: float | None = None) -> SandboxLeaseReply:
        """A lease for ``holder``, placed by the brokers. ``held_lease``: the lease ``holder``
        held before (a resumed rollout's): asked of its broker first, so a lease still alive
        there is found again; placed anew when that broker cannot be reached or has no room.
        ``wait_s``: how long each request waits for its reply (None: ``timeout_s``); it is
        sent as the request's deadline, past which the broker makes no sandbox for it. The
        held lease's broker is asked for no longer than ``timeout_s``: it may be lost with its
        node, which NATS learns only when the connection's pings go unanswered."""
        wait_s = wait_s or self.timeout_s

        def ask(subject: Subject, wait_s: float) -> Any:  # stamped when sent: a retry waits anew
            request = SandboxLeaseRequest(holder=holder, profile=profile, ttl_s=ttl_s, network=network,
                                          limits=limits, rollout_id=rollout_id, deadline=self._clock() + wait_s)
            return self._call(subject, request, "lease", wait_s=wait_s)

        if broker_of(held_lease):
            try:
                held_broker = broker_subject(SANDBOX_LEASE, broker_of(held_lease))
                return await ask(held_broker, min(wait_s, self.timeout_s))
            except SandboxRequestError as exc:
                if exc.kind not in ("unreachable", "capacity", "infra_error"):
                    raise
        return await self._retrying(capacity_retries, lambda: ask(SANDBOX_LEASE, wait_s))

    async def exec(self, lease_id: str, argv: list[str] | None = None, *, shell: str = "",
                   stdin: bytes = b"", timeout_s: float | None = None, env: dict[str, str] | None = None,
                   cwd: str = "", exec_id: str = "", stream_output: bool = False,
                   capacity_retries: int = 0, rollout_id: str = "") -> SandboxExecReply:
        """Run a command; the reply's ``result`` says how it ended. Raises only when it could
        not run at all.

        The request carries ``exec_id`` (the caller's, or a new one). While it waits, the
        lease's broker is probed every ``exec_probe_s`` (a heartbeat); a broker found gone, or
        no reply within ``exec_attempt_s``, sends it again with the same id until the exec's
        own wait is spent: a broker running it, or one restarted over its sandbox, attaches
        the retry to that exec instead of running it twice."""
        request = SandboxExecRequest(lease_id=lease_id, argv=list(argv or []), shell=shell, stdin=stdin,
                                     timeout_s=timeout_s, env=dict(env or {}), cwd=cwd,
                                     exec_id=exec_id or self._new_id(), stream_output=stream_output,
                                     rollout_id=rollout_id)
        wait_s = (timeout_s or DEFAULT_EXEC_WAIT_S) + self.timeout_s
        return await self._retrying(capacity_retries, lambda: self._exec_until(request, wait_s))

    async def _exec_until(self, request: SandboxExecRequest, wait_s: float) -> SandboxExecReply:
        give_up = time.monotonic() + wait_s
        pause = 0.1
        while True:
            attempt_s = max(0.001, min(self.exec_attempt_s, give_up - time.monotonic()))
            try:
                return await self._exec_attempt(request, attempt_s)
            except SandboxRequestError as exc:
                if exc.kind != "unreachable" or time.monotonic() + pause >= give_up:
                    raise
                # A broker gone for good (its node lost) is waited for no longer than a restart
                # takes: its rollout then takes the infrastructure path (another broker).
                give_up = min(give_up, time.monotonic() + self.exec_reattach_s)
            await self._sleep(pause)  # no responders: a restarting broker subscribes in seconds
            pause = min(0.5, pause * 2)

    async def _exec_attempt(self, request: SandboxExecRequest, attempt_s: float) -> SandboxExecReply:
        """One exec request, its broker probed while it waits: a probe that finds no broker
        ends the attempt ("unreachable") instead of waiting out a reply that cannot come."""
        attempt = asyncio.ensure_future(self._call(SANDBOX_EXEC, request, "exec", wait_s=attempt_s))
        probe = SandboxHeartbeatRequest(lease_id=request.lease_id, rollout_id=request.rollout_id,
                                        exec_id=request.exec_id)
        try:
            while True:
                done, _ = await asyncio.wait({attempt}, timeout=self.exec_probe_s)
                if done:
                    return attempt.result()
                try:
                    answer = await self._call(SANDBOX_HEARTBEAT, probe, "heartbeat", wait_s=self.exec_probe_s)
                except SandboxRequestError as exc:
                    if exc.kind == "unreachable":
                        raise
                    continue  # any other answer comes from a live broker: the exec's reply says more
                if not answer.exec_known:  # a restarted broker (the request died with the old one)
                    raise SandboxRequestError("the broker does not know the exec: sent again",
                                              kind="unreachable", operation="exec")
        finally:
            if not attempt.done():
                attempt.cancel()
                await asyncio.gather(attempt, return_exceptions=True)

    async def upload(self, lease_id: str, path: str, data: bytes, *, kind: TransferKind = "file",
                     mode: int = 0o644, rollout_id: str = "") -> SandboxUploadReply:
        """Store ``data`` at ``path`` (kind "tar": extract it into the directory ``path``),
        verified by sha256 end to end (ours of ``data`` against the sandbox's of what it stored)."""
        if self.bulk_threshold_bytes is not None and len(data) > self.bulk_threshold_bytes:
            stored = await self._bulk.upload(lease_id, path, data, kind=kind, mode=mode, rollout_id=rollout_id)
            if stored is not None:
                return stored
        if len(data) <= self.chunk_bytes:
            return await self._upload_one(lease_id, path, data, kind=kind, mode=mode, rollout_id=rollout_id)
        sha256 = hashlib.sha256(data).hexdigest()
        upload_id = self._new_id()
        offset = 0
        while True:
            piece = data[offset:offset + self.chunk_bytes]
            reply = await self._call(SANDBOX_UPLOAD, SandboxUploadRequest(
                lease_id=lease_id, path=path, data=piece, size=len(data), sha256=sha256, kind=kind,
                upload_id=upload_id, offset=offset, mode=mode, rollout_id=rollout_id), "upload")
            if reply.complete:
                return reply
            offset += len(piece)
            if offset >= len(data) or reply.received != offset:
                raise SandboxRequestError(f"the broker holds {reply.received} of {len(data)} bytes "
                                          f"after offset {offset}", kind="transfer_error", operation="upload")

    async def _upload_one(self, lease_id: str, path: str, data: bytes, *, kind: TransferKind,
                          mode: int, rollout_id: str) -> SandboxUploadReply:
        """One message: sent before we hash it, so hashing overlaps the transfer and the store.
        If the sandbox's digest differs, it is sent again with ours, which the sandbox checks
        before it stores anything."""
        sent = asyncio.ensure_future(self._call(SANDBOX_UPLOAD, SandboxUploadRequest(
            lease_id=lease_id, path=path, data=data, size=len(data), sha256="", kind=kind, mode=mode,
            rollout_id=rollout_id), "upload"))
        try:
            sha256 = await sha256_hex(data)
        finally:
            reply = await sent
        if reply.sha256 == sha256:
            return reply
        return await self._call(SANDBOX_UPLOAD, SandboxUploadRequest(
            lease_id=lease_id, path=path, data=data, size=len(data), sha256=sha256, kind=kind, mode=mode,
            rollout_id=rollout_id), "upload")

    async def download(self, lease_id: str, path: str, *, kind: TransferKind = "file",
                       rollout_id: str = "") -> bytes:
        """The file at ``path`` (kind "tar": a tar of the directory), verified by sha256."""
        download_id, parts, offset = self._new_id(), [], 0
        bulk = self.bulk_threshold_bytes is not None
        while True:
            reply = await self._call(SANDBOX_DOWNLOAD, SandboxDownloadRequest(
                lease_id=lease_id, path=path, kind=kind, download_id=download_id, offset=offset,
                max_bytes=self.chunk_bytes, rollout_id=rollout_id, bulk=bulk), "download")
            if reply.bulk is not None:
                data = await self._bulk.download(reply, lease_id, path)
                if data is not None:
                    return data
                download_id, bulk = self._new_id(), False  # a ticket of no use here: over NATS
                continue
            parts.append(reply.data)
            offset += len(reply.data)
            if reply.eof:
                break
            if not reply.data:
                raise SandboxRequestError(f"empty chunk at offset {offset} of {reply.size}",
                                          kind="transfer_error", operation="download")
        data = b"".join(parts)
        if len(data) != reply.size or hashlib.sha256(data).hexdigest() != reply.sha256:
            raise SandboxRequestError(f"{path!r}: the {len(data)} bytes received do not match the "
                                      f"sandbox's size {reply.size} and sha256 {reply.sha256}",
                                      kind="checksum_mismatch", operation="download")
        return data

    async def snapshot(self, lease_id: str, *, rollout_id: str = "") -> SandboxSnapshotReply:
        request = SandboxSnapshotRequest(lease_id=lease_id, rollout_id=rollout_id)
        return await self._call(SANDBOX_SNAPSHOT, request, "snapshot", wait_s=self.timeout_s * 4)

    async def fork(self, snapshot_id: str, holder: str, count: int, *, ttl_s: float | None = None,
                   rollout_id: str = "", near_lease: str = "") -> list[ForkedLease]:
        """``near_lease``: fork on that lease's broker rather than the snapshot's, which may be
        lost (a broker reads a snapshot it does not hold from the shared store)."""
        reply = await self._call(SANDBOX_FORK, SandboxForkRequest(
            snapshot_id=snapshot_id, holder=holder, count=count, ttl_s=ttl_s, rollout_id=rollout_id),
            "fork", wait_s=self.timeout_s * 4, route_by=near_lease)
        return list(reply.leases)

    async def heartbeat(self, lease_id: str, *, rollout_id: str = "") -> float:
        """Extend the lease by its TTL; returns its new expiry."""
        request = SandboxHeartbeatRequest(lease_id=lease_id, rollout_id=rollout_id)
        reply = await self._call(SANDBOX_HEARTBEAT, request, "heartbeat")
        return reply.expires_at

    async def release(self, lease_id: str, *, rollout_id: str = "") -> None:
        self._bulk.forget(lease_id)
        await self._call(SANDBOX_RELEASE, SandboxReleaseRequest(lease_id=lease_id, rollout_id=rollout_id),
                         "release")

    # -- internals -------------------------------------------------------------------------

    async def _call(self, subject: Subject, request: WireMessage, operation: str, *,
                    wait_s: float | None = None, route_by: str = "") -> Any:
        subject = routed_subject(subject, request, by=route_by)
        try:
            reply = await self._requester.request(subject, request, timeout_s=wait_s or self.timeout_s)
        except RequestFailedError as exc:
            raise SandboxRequestError(f"sandbox broker unreachable: {exc}", kind="unreachable",
                                      operation=operation) from exc
        if reply.error_kind:  # type: ignore[attr-defined]
            raise SandboxRequestError(reply.error, kind=reply.error_kind, operation=operation,  # type: ignore[attr-defined]
                                      retry_after_s=getattr(reply, "retry_after_s", 0.0))
        return reply

    async def _retrying(self, retries: int, call: Callable[[], Any]) -> Any:
        for attempt in range(retries + 1):
            try:
                return await call()
            except SandboxRequestError as exc:
                if exc.kind != "capacity" or attempt == retries:
                    raise
                await self._sleep(min(MAX_RETRY_WAIT_S, max(exc.retry_after_s, 0.05) * (attempt + 1)))
        raise AssertionError("unreachable")


def routed_subject(subject: Subject, request: WireMessage, *, by: str = "") -> Subject:
    """Where a request goes: its lease's (or, for a fork, its snapshot's; or ``by``'s) broker's
    own subject when the id names a broker; the shared subject otherwise (a new lease, a broker
    without an id)."""
    broker = broker_of(by or getattr(request, "lease_id", "") or getattr(request, "snapshot_id", ""))
    return broker_subject(subject, broker) if broker else subject
