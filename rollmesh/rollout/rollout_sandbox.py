"""A rollout's sandbox lease: taken, kept alive while its turns run, snapshotted, given back.

Knows the sandbox broker's client and the rollout config; nothing of NATS, Ray or the agent
loop's turns. The rollout id is the lease's idempotency token, so a redelivered rollout gets the
sandbox its earlier attempt held while that lease lives; once it is gone, a fork of the rollout's
last workspace snapshot (an infrastructure failure when that cannot be had); a rollout without one,
a fresh sandbox. Every request names the rollout (``rollout_id``), so
its spans and log lines do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import structlog

from rollmesh.config import RolloutConfig
from rollmesh.rollout.errors import RolloutError
from rollmesh.rollout.tool_results import failure_kind
from rollmesh.sandbox.broker_client import SandboxBrokerClient
from rollmesh.sandbox.errors import SandboxRequestError

_log = structlog.get_logger("rollmesh.rollout")

T = TypeVar("T")


class RolloutSandbox:
    def __init__(self, sandbox: SandboxBrokerClient, config: RolloutConfig) -> None:
        self.sandbox = sandbox
        self.config = config

    async def lease(self, rollout_id: str, *, held: str, snapshot_id: str, turn: int) -> str:
        """The rollout's lease id. ``held``/``snapshot_id``: the lease and the workspace snapshot
        its saved state names (empty for a new rollout); ``turn`` names where a failure happened."""
        try:
            reply = await self.sandbox.lease(
                rollout_id, profile=self.config.sandbox_profile,
                ttl_s=self.config.sandbox_lease_ttl_s, capacity_retries=self.config.sandbox_capacity_retries,
                rollout_id=rollout_id, held_lease=held, wait_s=self.config.sandbox_lease_wait_s)
        except SandboxRequestError as exc:
            raise RolloutError("sandbox_error", f"no sandbox lease: {exc}", turns=turn) from exc
        if held and reply.lease_id != held and snapshot_id:
            return await self._restore(rollout_id, snapshot_id, fresh_lease=reply.lease_id, turn=turn)
        return reply.lease_id

    async def _restore(self, rollout_id: str, snapshot_id: str, *, fresh_lease: str, turn: int) -> str:
        """A lease on a fork of ``snapshot_id``, made by the fresh lease's broker (the snapshot's
        own may be lost with its node; every broker reads the shared snapshot store), the fresh
        lease given back. A snapshot that cannot be forked is an infrastructure failure
        (``sandbox_error``): going on with an empty workspace would silently lose the files the
        saved turns made (rollouts without ``rollout.snapshot_workspace`` name no snapshot)."""
        try:
            (forked,) = await self.sandbox.fork(snapshot_id, rollout_id, 1, ttl_s=self.config.sandbox_lease_ttl_s,
                                                rollout_id=rollout_id, near_lease=fresh_lease)
        except (SandboxRequestError, ValueError) as exc:
            _log.warning("workspace_snapshot_lost", rollout_id=rollout_id, snapshot_id=snapshot_id, error=str(exc))
            await self.release(fresh_lease, rollout_id)
            raise RolloutError("sandbox_error", f"workspace snapshot {snapshot_id!r} could not be restored: {exc}",
                               turns=turn) from exc
        await self.release(fresh_lease, rollout_id)
        return forked.lease_id

    async def snapshot(self, lease_id: str, rollout_id: str) -> str:
        """A snapshot of the workspace now, or "" when the broker could not take one (the rollout
        goes on; only a lost sandbox would then lose its files)."""
        try:
            return (await self.sandbox.snapshot(lease_id, rollout_id=rollout_id)).snapshot_id
        except SandboxRequestError as exc:
            _log.warning("workspace_snapshot_failed", rollout_id=rollout_id, error=str(exc))
            return ""

    async def while_leased(self, lease_id: str, rollout_id: str, work: Awaitable[T]) -> T:
        """Run ``work`` while heartbeating the lease; a lost lease ends the work (RolloutError)."""
        working = asyncio.ensure_future(work)
        heartbeat = asyncio.create_task(self._heartbeat(lease_id, rollout_id), name=f"heartbeat-{lease_id}")
        try:
            await asyncio.wait({working, heartbeat}, return_when=asyncio.FIRST_COMPLETED)
            if not working.done():
                heartbeat.result()  # it only ends by raising: the lease is lost
            return working.result()
        finally:
            for task in (working, heartbeat):
                task.cancel()
            await asyncio.gather(working, heartbeat, return_exceptions=True)

    async def _heartbeat(self, lease_id: str, rollout_id: str) -> None:
        while True:
            await asyncio.sleep(self.config.sandbox_heartbeat_s)
            try:
                await self.sandbox.heartbeat(lease_id, rollout_id=rollout_id)
            except SandboxRequestError as exc:
                if exc.kind == "unreachable":  # the TTL outlasts a missed beat or two
                    _log.warning("sandbox_heartbeat_missed", lease_id=lease_id, error=str(exc))
                    continue
                raise RolloutError(failure_kind(exc), f"sandbox lease lost: {exc}") from exc

    async def release(self, lease_id: str, rollout_id: str) -> None:
        try:
            await self.sandbox.release(lease_id, rollout_id=rollout_id)
        except SandboxRequestError as exc:  # the broker reaps expired leases; losing a release loses nothing
            _log.warning("sandbox_release_failed", rollout_id=rollout_id, lease_id=lease_id, error=str(exc))
