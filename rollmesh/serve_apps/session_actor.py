"""The one chat-session store of a Serve app, as a named Ray actor that every replica finds.

Knows Ray (actor names, namespaces, lifetimes) and ``session_store``; nothing of HTTP or chat.
Why a Ray actor and not a NATS JetStream KV bucket: the Serve app always runs on Ray but has no
NATS connection of its own (``rollmesh serve`` and RayService deployments need none), a session's
record grows with its tokens past NATS's default 1 MiB message limit (a 128K-token trace is a few
MiB), and one actor running one call at a time makes a turn's lease atomic without a compare-and-
set loop. The actor is detached, so it outlives any replica (a restarted replica finds the
sessions where they were) and is stopped with the app (``stop_session_store``); what it does not
survive is its own death or the Ray cluster's: the call that finds it dead is a retryable 503
``sessions_unavailable``, a new store is started, and the sessions are gone (a later turn with the
same id starts a new session on the history it sends).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError

from rollmesh.serve_apps.errors import EngineUnavailableError
from rollmesh.serve_apps.session_store import SessionLease, SessionRecord, SessionStore

T = TypeVar("T")

SESSION_STORE_NAME = "rollmesh-chat-sessions"


def session_store_actor(*, namespace: str, ttl_s: float, max_sessions: int) -> ActorSessionStore:
    """The app's store: the named actor if it runs (another replica made it), else a new one."""
    def find_or_start() -> Any:
        return ray.remote(SessionStore).options(
            name=SESSION_STORE_NAME, namespace=namespace, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_concurrency=1,
        ).remote(ttl_s=ttl_s, max_sessions=max_sessions)

    return ActorSessionStore(find_or_start(), find_or_start)


def stop_session_store(namespace: str) -> None:
    """Kill the app's store (its sessions go with it); nothing when it is not running."""
    try:
        ray.kill(ray.get_actor(SESSION_STORE_NAME, namespace=namespace))
    except ValueError:
        return


@dataclass
class ActorSessionStore:
    """The shared store as replicas call it (``SessionStoreClient``): a ``SessionStore`` running
    as a Ray actor (``handle``). Ray runs one call at a time on it, which is what makes ``begin``
    a lease. A dead store is a retryable 503 ``sessions_unavailable``; the next call goes to the
    store ``restart`` finds or starts."""

    handle: Any
    restart: Callable[[], Any]

    async def begin(self, session_id: str) -> SessionLease:
        return await self._call(self.handle.begin.remote(session_id))

    async def commit(self, session_id: str, lease_id: str, record: SessionRecord) -> bool:
        return await self._call(self.handle.commit.remote(session_id, lease_id, record))

    async def release(self, session_id: str, lease_id: str) -> None:
        await self._call(self.handle.release.remote(session_id, lease_id))

    async def get(self, session_id: str) -> SessionRecord | None:
        return await self._call(self.handle.get.remote(session_id))

    async def delete(self, session_id: str) -> bool:
        return await self._call(self.handle.delete.remote(session_id))

    async def _call(self, ref: Awaitable[T]) -> T:
        try:
            return await ref
        except RayActorError as exc:
            self.handle = self.restart()
            raise EngineUnavailableError(f"the chat session store died (its sessions are lost): {exc}",
                                         code="sessions_unavailable", retry_after_s=1) from exc
