"""Execs by their request id, so a retried request attaches to the running one instead of
starting it again, and a client's probe can ask whether its exec is still known.

Knows asyncio and the exec reply type only; the broker owns one and decides what an exec runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from rollmesh.messages.sandbox import SandboxExecReply

# How long an ended exec is still "known" to a client's probe: its reply is on the way.
ENDED_EXECS_KEEP_S = 60.0

ExecKey = tuple[str, str]  # (lease_id, exec_id)


class ExecRegistry:
    def __init__(self, *, keep_ended_s: float = ENDED_EXECS_KEEP_S) -> None:
        self.keep_ended_s = keep_ended_s
        self._running: dict[ExecKey, asyncio.Future[SandboxExecReply]] = {}
        self._ended: dict[ExecKey, float] = {}  # when each ended (monotonic)

    def running(self, key: ExecKey) -> asyncio.Future[SandboxExecReply] | None:
        return self._running.get(key)

    def start(self, key: ExecKey, run: Callable[[], Awaitable[SandboxExecReply]]) -> asyncio.Future[SandboxExecReply]:
        task = asyncio.ensure_future(run())
        self._running[key] = task
        task.add_done_callback(lambda _: self._end(key))
        return task

    def known(self, key: ExecKey) -> bool:
        """Running, or ended within ``keep_ended_s``."""
        return key in self._running or key in self._ended

    def forget_ended(self) -> None:
        ended_before = time.monotonic() - self.keep_ended_s
        for key in [key for key, at in self._ended.items() if at < ended_before]:
            del self._ended[key]

    def _end(self, key: ExecKey) -> None:
        self._running.pop(key, None)
        self._ended[key] = time.monotonic()
