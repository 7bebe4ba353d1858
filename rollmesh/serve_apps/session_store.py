"""Where chat sessions live between turns: one store per Serve app, shared by all its replicas.

Plain logic: imports neither ray nor nats, knows no HTTP. ``SessionStore`` holds each session's
record (``SessionRecord``: its messages, its tokens up to the last prompt, the last generated turn
kept apart) and hands a session to one turn at a time: ``begin`` leases it (a second turn while one
is in flight is told ``"busy"``), ``commit`` stores the turn's result and frees it, ``release``
frees it unchanged (the turn failed). Answers are returned, never raised, so they cross a Ray
actor boundary unwrapped.

Bounds. A session not touched for ``ttl_s`` seconds is dropped (a lease older than that too: its
replica died mid-turn). At most ``max_sessions`` are kept: a new one then evicts the least
recently touched idle one, and with every one busy it is refused (``"full"``).

In a deployment this class runs as one named Ray actor (``session_actor``), so every replica
sees the same sessions and a replica that restarts finds them still there; replicas call it
through the ``SessionStoreClient`` seam. ``LocalSessionStore`` is the same calls in-process.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rollmesh.messages.token_trace import TokenTrace


@dataclass
class PendingTurn:
    """A session's last generated turn, exactly as sampled, and the assistant message parsed from
    it in the form the template renders. It joins the trajectory when the next turn's messages
    come (so a truncated turn is refused then, by the trajectory itself)."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    message: dict[str, Any]
    constrained: list[bool]              # per token: sampled under a grammar (empty: none was)


@dataclass
class SessionRecord:
    """One session as stored between its turns."""

    session_id: str
    settings: str                        # canonical JSON of what renders it (tools, template kwargs)
    render_tools: list[dict] | None      # the tools its first prompt was rendered with
    template_kwargs: dict[str, Any]      # the chat template's extra arguments
    messages: list[dict[str, Any]]       # the conversation in OpenAI form, the last answer included
    template_messages: list[dict[str, Any]]  # the trajectory's messages, up to the last prompt
    trace: TokenTrace                    # its tokens up to and including the last prompt
    constrained: list[int]               # positions in trace sampled under a grammar
    pending: PendingTurn                 # the last generated turn
    prompt_len: int                      # tokens of the first prompt
    turns: int
    created_at: float = 0.0
    updated_at: float = 0.0


BeginStatus = Literal["new", "existing", "busy", "full"]


@dataclass(frozen=True)
class SessionLease:
    """``begin``'s answer: ``record`` (None for a new session) and the lease to commit with."""

    status: BeginStatus
    lease_id: str = ""
    record: SessionRecord | None = None


@dataclass
class _Entry:
    record: SessionRecord | None
    lease_id: str = ""
    touched_at: float = 0.0


@dataclass
class SessionStoreStats:
    sessions: int = 0
    busy: int = 0
    expired: int = 0
    evicted: int = 0
    refused_full: int = 0


class SessionStore:
    """Sessions by id, least recently touched first."""

    def __init__(self, *, ttl_s: float, max_sessions: int, clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0 or max_sessions < 1:
            raise ValueError(f"ttl_s must be > 0 and max_sessions >= 1 (got {ttl_s}, {max_sessions})")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._stats = SessionStoreStats()

    def begin(self, session_id: str) -> SessionLease:
        """Lease the session for one turn."""
        now = self._expire()
        entry = self._entries.get(session_id)
        if entry is not None and entry.lease_id:
            return SessionLease("busy")
        if entry is None:
            if len(self._entries) >= self.max_sessions and not self._evict_one():
                self._stats.refused_full += 1
                return SessionLease("full")
            entry = self._entries[session_id] = _Entry(record=None)
        entry.lease_id = uuid.uuid4().hex
        self._touch(session_id, entry, now)
        return SessionLease("new" if entry.record is None else "existing", entry.lease_id, entry.record)

    def commit(self, session_id: str, lease_id: str, record: SessionRecord) -> bool:
        """Store the turn's record and free the session; False when the lease was lost (the
        session was deleted or expired during the turn): nothing is stored then."""
        now = self._expire()
        entry = self._entries.get(session_id)
        if entry is None or entry.lease_id != lease_id:
            return False
        record.created_at = entry.record.created_at if entry.record else now
        record.updated_at = now
        entry.record, entry.lease_id = record, ""
        self._touch(session_id, entry, now)
        return True

    def release(self, session_id: str, lease_id: str) -> None:
        """Free the session unchanged (its turn failed); a new session that never got a record goes."""
        entry = self._entries.get(session_id)
        if entry is None or entry.lease_id != lease_id:
            return
        if entry.record is None:
            del self._entries[session_id]
        else:
            entry.lease_id = ""

    def get(self, session_id: str) -> SessionRecord | None:
        """The session's last committed record (also while a turn is in flight)."""
        self._expire()
        entry = self._entries.get(session_id)
        return entry.record if entry is not None else None

    def delete(self, session_id: str) -> bool:
        """Forget the session (an in-flight turn's commit then fails); False when there was none."""
        self._expire()
        entry = self._entries.pop(session_id, None)
        return entry is not None and entry.record is not None

    def stats(self) -> SessionStoreStats:
        self._stats.sessions = len(self._entries)
        self._stats.busy = sum(1 for entry in self._entries.values() if entry.lease_id)
        return SessionStoreStats(**vars(self._stats))

    def _touch(self, session_id: str, entry: _Entry, now: float) -> None:
        entry.touched_at = now
        self._entries.move_to_end(session_id)

    def _expire(self) -> float:
        now = self.clock()
        while self._entries:
            session_id, entry = next(iter(self._entries.items()))
            if now - entry.touched_at <= self.ttl_s:
                break
            del self._entries[session_id]
            self._stats.expired += 1
        return now

    def _evict_one(self) -> bool:
        for session_id, entry in self._entries.items():
            if not entry.lease_id:
                del self._entries[session_id]
                self._stats.evicted += 1
                return True
        return False


class SessionStoreClient(Protocol):
    """The store as a replica calls it (awaited: it lives in another process)."""

    async def begin(self, session_id: str) -> SessionLease: ...

    async def commit(self, session_id: str, lease_id: str, record: SessionRecord) -> bool: ...

    async def release(self, session_id: str, lease_id: str) -> None: ...

    async def get(self, session_id: str) -> SessionRecord | None: ...

    async def delete(self, session_id: str) -> bool: ...


@dataclass
class LocalSessionStore:
    """A ``SessionStore`` in this process, called as a replica calls the shared one."""

    store: SessionStore

    async def begin(self, session_id: str) -> SessionLease:
        return self.store.begin(session_id)

    async def commit(self, session_id: str, lease_id: str, record: SessionRecord) -> bool:
        return self.store.commit(session_id, lease_id, record)

    async def release(self, session_id: str, lease_id: str) -> None:
        self.store.release(session_id, lease_id)

    async def get(self, session_id: str) -> SessionRecord | None:
        return self.store.get(session_id)

    async def delete(self, session_id: str) -> bool:
        return self.store.delete(session_id)
