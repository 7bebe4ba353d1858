"""One-time tokens of the bulk data path: what each grants (which lease, which file, which
direction) until it is used once or lapses.

Knows leases and the standard library; nothing of sockets or messages. A token is 32 random
bytes (``secrets``), usable once, for the lease it was issued for: shown with any other lease
id it is refused and spent, since it was shown to the wrong place.
Each lease holds at most ``MAX_PER_LEASE`` live tokens (a download's token holds its bytes, so
an abandoned one must not pile up); spent tokens are remembered a while so a second use is
told "spent" rather than "unknown".
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from rollmesh.sandbox.errors import BulkTokenError
from rollmesh.sandbox.leases import Lease
from rollmesh.sandbox.transfers import Download

Direction = Literal["upload", "download"]
MAX_PER_LEASE = 4
REMEMBERED_SPENT = 4096


@dataclass(frozen=True, slots=True)
class BulkGrant:
    """What a token lets its bearer do: one upload of at most ``size`` bytes to the lease (the
    stream names the file), or read ``download`` (``path``, already read from the sandbox, with
    the sandbox's sha256)."""

    token: str
    direction: Direction
    lease: Lease
    path: str
    kind: str = "file"
    size: int = 0
    mode: int = 0o644
    download: Download | None = None
    expires_at: float = 0.0


class BulkTokens:
    def __init__(self, *, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._live: OrderedDict[str, BulkGrant] = OrderedDict()  # oldest first
        self._spent: OrderedDict[str, None] = OrderedDict()

    def issue(self, direction: Direction, lease: Lease, path: str, *, kind: str = "file", size: int = 0,
              mode: int = 0o644, download: Download | None = None) -> BulkGrant:
        self.drop_lapsed()
        held = [grant for grant in self._live.values() if grant.lease is lease]
        for oldest in held[: max(0, len(held) - MAX_PER_LEASE + 1)]:
            self._spend(oldest.token)  # abandoned: its bytes must not stay held
        grant = BulkGrant(secrets.token_urlsafe(32), direction, lease, path, kind, size, mode, download,
                          self._clock() + self.ttl_s)
        self._live[grant.token] = grant
        return grant

    def take(self, token: str, lease_id: str) -> BulkGrant:
        """The grant of ``token``, spent now; ``BulkTokenError`` (and the token spent) when it
        is not a live token issued for ``lease_id``."""
        grant = self._live.get(token)
        if grant is None:
            spent = token in self._spent
            raise BulkTokenError(f"bulk token {'already used' if spent else 'unknown'}",
                                 reason="spent" if spent else "unknown", lease_id=lease_id)
        self._spend(token)
        if self._clock() >= grant.expires_at:
            raise BulkTokenError(f"bulk token lapsed ({self.ttl_s:g} s after it was issued)",
                                 reason="expired", lease_id=lease_id)
        if grant.lease.lease_id != lease_id:
            raise BulkTokenError(f"this bulk token belongs to another lease, not {lease_id!r}",
                                 reason="other_lease", lease_id=lease_id)
        return grant

    def __len__(self) -> int:
        return len(self._live)

    def _spend(self, token: str) -> None:
        self._live.pop(token, None)
        self._spent[token] = None
        while len(self._spent) > REMEMBERED_SPENT:
            self._spent.popitem(last=False)

    def drop_lapsed(self) -> int:
        """Forget tokens that lapsed or whose lease ended (a download's holds its bytes);
        returns how many. Issuing does it too; the broker's reaper also calls it."""
        now = self._clock()
        gone = [token for token, grant in self._live.items()
                if grant.expires_at <= now or grant.lease.transfers.closed]
        for token in gone:
            self._spend(token)
        return len(gone)
