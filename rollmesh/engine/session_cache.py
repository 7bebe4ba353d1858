"""The KV of finished turns, kept per session so the next turn's prompt reuses it.

Knows nothing of torch but the routes it carries along. A multi-turn agent's next prompt is its
previous prompt, the tokens it generated and the tool's output; the KV of all but the last of
those is already in the pool when the turn ends, so the engine parks its blocks here under the
session's id instead of freeing them. While the tool runs nothing touches them; under memory
pressure the least recently parked sessions are evicted first (their blocks go back to the pool,
and their next turn simply prefills in full).

A session is taken out whole by its next turn (``take``): the turn owns those blocks from then on
and overwrites whatever lies past the common prefix, so no block is ever shared and nothing needs
copy-on-write.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class CachedSession:
    token_ids: list[int]  # the tokens whose KV the blocks hold, position by position
    blocks: list[int]
    routes: Any = None  # routed expert rows of those positions (MoE), or None


def common_prefix_length(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    for index in range(limit):
        if a[index] != b[index]:
            return index
    return limit


class SessionCache:
    """Parked sessions in least-recently-parked order."""

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, CachedSession] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def park(self, session_id: str, session: CachedSession) -> list[int]:
        """Keep ``session``; returns the blocks of the one it replaces (the caller frees them)."""
        replaced = self._sessions.pop(session_id, None)
        self._sessions[session_id] = session
        return [] if replaced is None else replaced.blocks

    def take(self, session_id: str | None) -> CachedSession | None:
        """Remove and return the session's parked KV, if it is still here."""
        session = self._sessions.pop(session_id, None) if session_id else None
        if session_id:
            if session is None:
                self.misses += 1
            else:
                self.hits += 1
        return session

    def evict_oldest(self, keep: str | None = None) -> list[int]:
        """Drop the least recently parked session other than ``keep``; its blocks (empty if
        there is none)."""
        for session_id in self._sessions:
            if session_id != keep:
                session = self._sessions.pop(session_id)
                self.evictions += 1
                return session.blocks
        return []

    def blocks_of(self, session_id: str | None) -> int:
        session = self._sessions.get(session_id) if session_id else None
        return 0 if session is None else len(session.blocks)

    def drop_all(self) -> list[int]:
        blocks = [block for session in self._sessions.values() for block in session.blocks]
        self._sessions.clear()
        return blocks

