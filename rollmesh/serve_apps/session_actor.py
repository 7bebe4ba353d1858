"""The one chat-session store of a Serve app, as a named Ray actor that every replica finds.

Knows Ray (actor names, namespaces, lifetimes) and ``session_store``; nothing of HTTP or chat.
Why a Ray actor and not a NATS JetStream KV bucket: the Serve app always runs on Ray but has no
NATS connection of its own (``rollmesh serve`` and RayService deployments need none), a session's
record grows with its tokens past NATS's default 1 MiB message limit (a 128K-token trace is a few
MiB), and one actor running one call at a time makes a turn's lease atomic without a compare-and-
set loop. The actor is detached, so it outlives any replica (a restarted replica finds the
sessions where they were) and is stopped with the app (``stop_session_store``); what it does not
survive is its own death or the Ray cluster's: then sessions are gone, and their next turns get a
404 ``session_not_found``.
"""

from __future__ import annotations

from collections.abc import Awaitable
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
    handle = ray.remote(SessionStore).options(
        name=SESSION_STORE_NAME, namespace=namespace, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_concurrency=1,
    ).remote(ttl_s=ttl_s, max_sessions=max_sessions)
    return ActorSessionStore(handle)


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
    a lease. A dead store is a 503 ``sessions_unavailable``."""

    handle: Any

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

    @staticmethod
    async def _call(ref: Awaitable[T]) -> T:
        try:
            return await ref
        except RayActorError as exc:
            raise EngineUnavailableError(f"the chat session store is unavailable: {exc}",
                                         code="sessions_unavailable") from exc
