"""Brings crashed role actors back: Ray restarts the process, this starts the role in it.

Knows Ray only through actor handles' ``.remote`` calls (a role actor's ``ready`` and ``start``);
nothing of roles. Every actor is spawned with ``max_restarts=-1``, so Ray re-creates a killed
actor's process and re-runs its constructor, but a role only serves once ``start()`` connected it
to NATS and subscribed it. The supervisor asks each actor ``ready()`` every ``interval_s``: a
restarted one answers False and is started; one still restarting raises and is asked again at the
next round. What it resumes from (the ledger, the rollout-state KV, the weights stream) is the
role's business.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import structlog

_log = structlog.get_logger("rollmesh.actor_supervisor")

READY_TIMEOUT_S = 10.0
START_TIMEOUT_S = 120.0


class ActorSupervisor:
    def __init__(self, actors: Callable[[], Mapping[str, Any]], *, interval_s: float) -> None:
        self._actors = actors
        self.interval_s = interval_s
        self.restarts: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._watch(), name="actor-supervisor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def check_once(self) -> list[str]:
        """Start every actor that came back from a crash unstarted; returns their names."""
        actors = dict(self._actors())
        answers = await asyncio.gather(*(self._ready(actor) for actor in actors.values()))
        restarted = [name for name, ready in zip(actors, answers) if ready is False]
        for name in restarted:
            try:
                await asyncio.wait_for(_call(actors[name].start), START_TIMEOUT_S)
            except Exception as exc:  # crashed again while starting: the next round retries
                _log.warning("actor_restart_failed", actor=name, error=repr(exc))
                continue
            self.restarts[name] = self.restarts.get(name, 0) + 1
            _log.warning("actor_restarted", actor=name, restarts=self.restarts[name])
        return restarted

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_once()
            except Exception as exc:  # never let one bad round end the watch
                _log.warning("actor_supervision_failed", error=repr(exc))

    @staticmethod
    async def _ready(actor: Any) -> bool | None:
        """True or False from the actor; None while it cannot answer (dead, restarting)."""
        try:
            return bool(await asyncio.wait_for(_call(actor.ready), READY_TIMEOUT_S))
        except Exception:
            return None


async def _call(method: Any) -> Any:
    return await method.remote()
