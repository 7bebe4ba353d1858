"""MetricsReporter: sends this process's metric snapshot every ``interval_s``, and once at stop.

Knows asyncio and ``rollmesh.telemetry.metrics``; the sending (a core NATS publish, untraced: a
span per snapshot would drown the traces) is injected by the actor shell. A failed send is
logged and the next snapshot, cumulative, makes up for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from rollmesh.messages.metrics import MetricsReported
from rollmesh.telemetry.metrics import collect_report

_log = structlog.get_logger("rollmesh.telemetry.metrics_reporter")

Send = Callable[[MetricsReported], Awaitable[None]]


class MetricsReporter:
    def __init__(self, send: Send, *, interval_s: float,
                 collect: Callable[[], MetricsReported | None] = collect_report) -> None:
        self.send = send
        self.interval_s = interval_s
        self.collect = collect
        self.sent = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="metrics-reporter")

    async def stop(self) -> None:
        """Stop the timer and send the last snapshot (what happened since the previous one)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self.report_once()

    async def report_once(self) -> None:
        report = self.collect()
        if report is None:
            return
        try:
            await self.send(report)
            self.sent += 1
        except Exception as exc:  # the bus is down or closing: the next snapshot covers it
            _log.debug("metrics_report_not_sent", error=repr(exc))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.report_once()
