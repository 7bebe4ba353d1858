"""TaskSet: the owner of an actor's background tasks (no fire-and-forget).

Knows asyncio and structlog only. A long-lived shell cannot sit inside one ``async with
asyncio.TaskGroup()`` block across its start() and stop() calls, so it keeps this tracked set
instead: every task is registered, a task that dies with an exception is logged (never silently
dropped), and ``close`` cancels whatever is left and waits for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

_log = structlog.get_logger("rollmesh.bus.task_set")


class TaskSet:
    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]:
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self.owner}: task set is closed; cannot spawn {name}")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.owner}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._on_done)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout_s: float) -> bool:
        """Wait for the current tasks to finish by themselves; True when all did in time."""
        pending = set(self._tasks)
        if not pending:
            return True
        _, still_running = await asyncio.wait(pending, timeout=timeout_s)
        return not still_running

    async def close(self) -> None:
        """Refuse new tasks, cancel the running ones and wait until they have all ended."""
        self._closed = True
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            _log.error("background_task_failed", owner=self.owner, task=task.get_name(),
                       error=repr(exc), exc_info=exc)
