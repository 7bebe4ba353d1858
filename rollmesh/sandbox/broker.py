"""The sandbox broker's plain logic: leases, exec, release and reaping, all held in memory.

Knows the sandbox messages, its config slice and a ``SandboxBackend``; nothing of NATS or Ray
(its actor shell decodes requests, calls these methods and sends the replies). Every failure is
a reply with ``error_kind`` and ``error`` set, never an exception to the caller.

How exec failures map to ``error_kind``: "timeout" and "output_too_large" describe the command
(it was killed; the reply still carries its exit code and the output up to the cap; the wire
reply has no truncated flag, so this is how callers learn the output is cut). "backend_error"
means the sandbox itself failed and the result says nothing about the tool: an infra failure.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from rollmesh.config import SandboxConfig
from rollmesh.messages.sandbox import (
    SandboxExecReply,
    SandboxExecRequest,
    SandboxLeaseReply,
    SandboxLeaseRequest,
    SandboxReleaseReply,
    SandboxReleaseRequest,
)
from rollmesh.sandbox.backend_protocol import SandboxBackend
from rollmesh.sandbox.errors import SandboxError

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Lease:
    lease_id: str
    holder: str
    workdir: Path
    expires_at: float
    network: bool
    writable_root: bool


@dataclass(frozen=True, slots=True)
class SandboxBrokerStats:
    backend: str
    isolated: bool
    active_leases: int
    max_leases: int
    leases_granted: int
    leases_refused: int
    leases_released: int
    leases_expired: int
    execs: int
    exec_timeouts: int
    exec_output_too_large: int
    exec_backend_errors: int


class SandboxBroker:
    """``root_dir`` belongs to the broker: each lease's directory is ``root_dir/<lease_id>``, and
    isolating backends hide ``root_dir`` from tool code (so leases cannot see one another)."""

    def __init__(
        self,
        config: SandboxConfig,
        backend: SandboxBackend,
        *,
        root_dir: Path,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self._config = config
        self._backend = backend
        self._root_dir = Path(root_dir)
        self._clock = clock
        self._new_id = new_id
        self._leases: dict[str, _Lease] = {}
        self._lease_of_holder: dict[str, str] = {}
        self._counts = dict.fromkeys(
            (
                "leases_granted",
                "leases_refused",
                "leases_released",
                "leases_expired",
                "execs",
                "exec_timeouts",
                "exec_output_too_large",
                "exec_backend_errors",
            ),
            0,
        )

    async def lease(self, req: SandboxLeaseRequest) -> SandboxLeaseReply:
        held = self._live_lease_of(req.holder)
        if held is not None:
            # Idempotent by holder: a retried request (the first reply was lost or late, or the
            # rollout was redelivered) gets the same sandbox instead of leaking a second one.
            return self._granted(held)
        if len(self._leases) >= self._config.max_leases:
            await self.reap_expired()  # expired leases that nobody reaped yet must not block new ones
        refusal = self._refusal(req)
        if refusal is not None:
            self._counts["leases_refused"] += 1
            log.info("sandbox lease refused", holder=req.holder, error_kind=refusal.error_kind, error=refusal.error)
            return refusal
        lease_id = self._new_id()
        workdir = self._root_dir / lease_id
        try:
            # 0o700: other local users must not read a rollout's files on the host either.
            self._root_dir.mkdir(parents=True, exist_ok=True)
            workdir.mkdir(mode=0o700)
        except OSError as exc:
            self._counts["leases_refused"] += 1
            return SandboxLeaseReply(error_kind="backend_error", error=f"cannot create the lease directory: {exc}")
        # The request's TTL is honoured as is: rollouts may run for hours and there is no renew.
        lease = _Lease(lease_id, req.holder, workdir, self._clock() + req.ttl_s, req.network, req.writable_root)
        self._leases[lease_id] = lease
        self._lease_of_holder[req.holder] = lease_id
        self._counts["leases_granted"] += 1
        log.debug("sandbox leased", lease_id=lease_id, holder=req.holder, backend=self._backend.name)
        return self._granted(lease)

    def _live_lease_of(self, holder: str) -> _Lease | None:
        lease = self._leases.get(self._lease_of_holder.get(holder, ""))
        return lease if lease is not None and lease.expires_at > self._clock() else None

    def _granted(self, lease: _Lease) -> SandboxLeaseReply:
        return SandboxLeaseReply(
            lease_id=lease.lease_id,
            backend=self._backend.name,
            isolated=self._backend.isolated,
            expires_at=lease.expires_at,
        )

    async def exec(self, req: SandboxExecRequest) -> SandboxExecReply:
        lease = self._leases.get(req.lease_id)
        if lease is None:
            return SandboxExecReply(error_kind="unknown_lease", error=f"no lease {req.lease_id!r}")
        if self._clock() >= lease.expires_at:
            await self._drop(lease)
            self._counts["leases_expired"] += 1
            return SandboxExecReply(error_kind="lease_expired", error=f"lease {req.lease_id!r} has expired")
        self._counts["execs"] += 1
        try:
            result = await self._backend.run(
                list(req.argv),
                stdin=req.stdin,
                timeout_s=req.timeout_s,
                workdir=lease.workdir,
                network=lease.network,
                writable_root=lease.writable_root,
                max_output_bytes=self._config.max_output_bytes,
                memory_limit_mb=self._config.memory_limit_mb,
            )
        except Exception as exc:  # noqa: BLE001 - any backend failure becomes a reply, by contract
            self._counts["exec_backend_errors"] += 1
            kind = "sandbox" if isinstance(exc, SandboxError) else "unexpected"
            log.warning("sandbox exec failed", lease_id=lease.lease_id, failure=kind, error=str(exc))
            return SandboxExecReply(error_kind="backend_error", error=f"{type(exc).__name__}: {exc}")
        error_kind, error = "", ""
        if result.timed_out:
            self._counts["exec_timeouts"] += 1
            error_kind, error = "timeout", f"killed after {req.timeout_s:g} s"
        elif result.truncated:
            self._counts["exec_output_too_large"] += 1
            error_kind = "output_too_large"
            error = f"killed: output passed {self._config.max_output_bytes} bytes"
        return SandboxExecReply(
            exit_code=result.exit_code,
            stdout=result.stdout,
            stderr=result.stderr,
            duration_s=result.duration_s,
            timed_out=result.timed_out,
            error_kind=error_kind,
            error=error,
        )

    async def release(self, req: SandboxReleaseRequest) -> SandboxReleaseReply:
        lease = self._leases.get(req.lease_id)
        if lease is None:
            # Also what a second release gets: releasing is idempotent in effect.
            return SandboxReleaseReply(released=False, error_kind="unknown_lease", error=f"no lease {req.lease_id!r}")
        await self._drop(lease)
        self._counts["leases_released"] += 1
        log.info("sandbox released", lease_id=lease.lease_id, holder=lease.holder)
        return SandboxReleaseReply(released=True)

    async def reap_expired(self) -> int:
        now = self._clock()
        expired = [lease for lease in self._leases.values() if now >= lease.expires_at]
        for lease in expired:
            await self._drop(lease)
            log.info("sandbox lease expired", lease_id=lease.lease_id, holder=lease.holder)
        self._counts["leases_expired"] += len(expired)
        return len(expired)

    def stats(self) -> SandboxBrokerStats:
        return SandboxBrokerStats(
            backend=self._backend.name,
            isolated=self._backend.isolated,
            active_leases=len(self._leases),
            max_leases=self._config.max_leases,
            **self._counts,
        )

    def _refusal(self, req: SandboxLeaseRequest) -> SandboxLeaseReply | None:
        if req.network:
            # SandboxConfig has no field that allows network yet; refuse rather than guess.
            return SandboxLeaseReply(
                error_kind="invalid_request",
                error="network access is not allowed by this broker (no config permits it)",
            )
        if req.writable_root:
            # The only way bwrap 0.8 can make the root writable writes through to the host.
            return SandboxLeaseReply(
                error_kind="invalid_request",
                error="a writable root is not allowed by this broker (no backend gives a private one)",
            )
        if len(self._leases) >= self._config.max_leases:
            return SandboxLeaseReply(
                error_kind="capacity", error=f"all {self._config.max_leases} sandbox leases are taken"
            )
        return None

    async def _drop(self, lease: _Lease) -> None:
        # Forget the lease first, so a concurrent request cannot use a directory being removed.
        self._leases.pop(lease.lease_id, None)
        if self._lease_of_holder.get(lease.holder) == lease.lease_id:
            del self._lease_of_holder[lease.holder]
        await asyncio.to_thread(shutil.rmtree, lease.workdir, ignore_errors=True)
