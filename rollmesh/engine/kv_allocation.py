"""KV blocks for the decode engine's admissions: a session's parked prefix taken back, new blocks
from the pool, parked sessions evicted (oldest first) when the pool is short, a finished turn's
blocks parked under its session.

Knows the block pool (``kv_pages``) and the parked sessions (``session_cache``); not the model,
sequences or sampling. Memory policy (``decode``): a request reserves the blocks of its whole
budget when it is admitted, so a running sequence never runs out of KV and is never preempted;
parked sessions give their blocks up only when an admission needs them.
"""

from __future__ import annotations

from typing import Any

from rollmesh.engine.errors import CapacityError
from rollmesh.engine.kv_pages import KvBlockPool, OutOfBlocksError
from rollmesh.engine.session_cache import CachedSession, SessionCache, common_prefix_length


class KvAllocator:
    """Hands out ``pool``'s blocks, taking them from ``sessions`` when it must."""

    def __init__(self, pool: KvBlockPool, sessions: SessionCache, *, max_batch: int) -> None:
        self.pool = pool
        self.sessions = sessions
        self._max_batch = max_batch  # for CapacityError

    def reuse(self, session_id: str | None, input_ids: list[int]) -> tuple[int, list[int], Any]:
        """(reused tokens, the blocks holding them, the session's routes) from the session's
        parked KV, which is taken; blocks past the common prefix go back to the pool."""
        session = self.sessions.take(session_id)
        if session is None:
            return 0, [], None
        # At least the last prompt token is recomputed: its logits start the generation.
        reused = min(common_prefix_length(session.token_ids, input_ids), len(input_ids) - 1)
        keep = self.pool.blocks_for(reused)
        self.pool.free(session.blocks[keep:])
        self.sessions.reused_tokens += reused
        return reused, session.blocks[:keep], session.routes

    def allocate(self, count: int, request_id: str) -> list[int]:
        if not self.make_room(count):
            raise CapacityError(self._max_batch, request_id=request_id)
        try:
            return self.pool.allocate(count)
        except OutOfBlocksError as exc:  # make_room said yes; kept for a clear error anyway
            raise CapacityError(self._max_batch, request_id=request_id) from exc

    def make_room(self, blocks: int, keep: str | None = None) -> bool:
        """True when ``blocks`` are free, after evicting parked sessions other than ``keep``."""
        while self.pool.num_free() < blocks:
            evicted = self.sessions.evict_oldest(keep=keep)
            if not evicted:
                break
            self.pool.free(evicted)
        return self.pool.num_free() >= blocks

    def park(self, session_id: str, tokens: list[int], blocks: list[int], routes: Any) -> None:
        """Keep the blocks holding ``tokens``' KV under the session (freeing the rest of
        ``blocks`` and the session's previous turn, if still parked)."""
        keep = self.pool.blocks_for(len(tokens))
        self.pool.free(blocks[keep:])
        replaced = self.sessions.park(session_id, CachedSession(tokens, blocks[:keep], routes))
        self.pool.free(replaced)

    def drop_sessions(self) -> int:
        """Free every parked session's KV; blocks freed."""
        blocks = self.sessions.drop_all()
        self.pool.free(blocks)
        return len(blocks)
