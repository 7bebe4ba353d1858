"""The broker's lease table: which sandbox each lease holds, until when, and for which holder.

Knows the sandbox protocol and the transfer state of a lease; nothing of the bus. A lease is
found by its id or by its holder's idempotency token; an expired lease is still found (so the
caller can say "lease_expired" rather than "unknown_lease") until it is removed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from rollmesh.sandbox.lease_terms import LeaseTerms
from rollmesh.sandbox.sandbox_protocol import Sandbox
from rollmesh.sandbox.transfers import LeaseTransfers


@dataclass(slots=True)
class Lease:
    lease_id: str
    holder: str
    terms: LeaseTerms
    sandbox: Sandbox
    expires_at: float
    warm: bool = False  # it came from the warm pool
    running_execs: int = 0
    died: bool = False  # its sandbox died under it
    transfers: LeaseTransfers = field(default_factory=LeaseTransfers)

    def extend(self, now: float) -> None:
        """A heartbeat, or any request on the lease: it lives a TTL from now (never shorter)."""
        self.expires_at = max(self.expires_at, now + self.terms.ttl_s)

    def expired(self, now: float) -> bool:
        # A lease running an exec is in use, heartbeat or not; the exec's own timeout bounds it.
        return now >= self.expires_at and self.running_execs == 0


class LeaseTable:
    def __init__(self) -> None:
        self._by_id: dict[str, Lease] = {}
        self._by_holder: dict[str, str] = {}

    def add(self, lease: Lease) -> None:
        self._by_id[lease.lease_id] = lease
        self._by_holder[lease.holder] = lease.lease_id

    def get(self, lease_id: str) -> Lease | None:
        return self._by_id.get(lease_id)

    def of_holder(self, holder: str) -> Lease | None:
        return self._by_id.get(self._by_holder.get(holder, ""))

    def remove(self, lease_id: str) -> Lease | None:
        lease = self._by_id.pop(lease_id, None)
        if lease is not None and self._by_holder.get(lease.holder) == lease_id:
            del self._by_holder[lease.holder]
        return lease

    def expired(self, now: float) -> list[Lease]:
        return [lease for lease in self._by_id.values() if lease.expired(now)]

    def all(self) -> list[Lease]:
        return list(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)


@dataclass(slots=True)
class PendingLease:
    """A lease being granted: the reply every request for it waits on, and until when anyone
    still waits (the latest deadline of those requests; none set: forever). A retry that
    attaches extends it, so a lease is given up only when its last requester has."""

    reply: asyncio.Future[Any]
    wanted_until: float = float("-inf")

    def attach(self, deadline: float) -> None:
        self.wanted_until = max(self.wanted_until, deadline or float("inf"))
