"""The GPU scheduler role's logic: start grants and lending, and the accelerator metrics.

Knows the scheduling package, the wire messages, the metrics catalog and the ``Publisher`` port;
nothing of Ray or NATS (``rollmesh.actors.gpu_scheduler.GpuSchedulerActor`` builds the lending
service with the Ray adapters of ``ray_jobs`` and serves this). The timers (the core's deadlines,
the utilization report every ``scheduler.report_every_s``) run in one task, cancelled at close.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from rollmesh.config import SchedulerConfig
from rollmesh.messages import GpuGranted, SchedulerStatus
from rollmesh.messages.subjects import GPU_GRANTED
from rollmesh.ports import Publisher, Subscription
from rollmesh.scheduling.grants import GpuScheduler
from rollmesh.scheduling.lending_service import LendingService
from rollmesh.telemetry import metrics, metrics_catalog

RL_ROLES = ("trainer", "prefill", "decode", "resharder")


class GpuSchedulerLogic:
    """The GPU scheduler role's logic: start grants (``GpuScheduler``) plus lending
    (``LendingService``), whose timers it runs from ``start_lending`` to ``close``."""

    def __init__(self, scheduler: GpuScheduler, publisher: Publisher, lending: LendingService,
                 config: SchedulerConfig) -> None:
        self.scheduler = scheduler
        self.publisher = publisher
        self.lending = lending
        self.config = config
        self._timer: asyncio.Task | None = None
        _observe_accelerators(self)

    def subscriptions(self) -> list[Subscription]:
        return self.lending.subscriptions()

    async def grant(self, holders: dict[str, str]) -> list[GpuGranted]:
        granted = self.scheduler.initial_grants(holders)
        for grant in granted:
            await self.publisher.publish(GPU_GRANTED, grant)
        return granted

    async def start_lending(self) -> None:
        await self.lending.start()
        self._timer = asyncio.get_running_loop().create_task(self._run_timers())

    async def _run_timers(self) -> None:
        next_report = time.time() + self.config.report_every_s
        while True:
            wakeup = self.lending.next_wakeup()
            now = time.time()
            delay = min(self.config.tick_s, max(0.0, (wakeup or math.inf) - now), max(0.0, next_report - now))
            await asyncio.sleep(delay)
            await self.lending.tick()
            if time.time() >= next_report:
                await self.lending.report()
                next_report = time.time() + self.config.report_every_s

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        await self.lending.close()

    def stats(self) -> dict[str, Any]:
        return {"grants": [grant.grant_id for grant in self.scheduler.grants()],
                "jobs": self.lending.status().jobs}


class _StatusPerCollection:
    """The scheduler's status, made once per metrics collection rather than once per metric: a
    collection runs the observers back to back, so a status younger than ``FRESH_S`` is reused."""

    FRESH_S = 0.5

    def __init__(self) -> None:
        self._status: SchedulerStatus | None = None
        self._made_at = -math.inf

    def __call__(self, logic: GpuSchedulerLogic) -> SchedulerStatus:
        now = time.monotonic()
        if self._status is None or now - self._made_at > self.FRESH_S:
            self._status, self._made_at = logic.lending.status(), now
        return self._status


def _observe_accelerators(logic: GpuSchedulerLogic) -> None:
    """Capacity, grants by holder and the utilization figures, read at every metrics collection."""
    status = _StatusPerCollection()
    metrics.observe(metrics_catalog.ACCELERATORS_CAPACITY, logic, lambda lg: [(status(lg).capacity, {})])
    metrics.observe(metrics_catalog.ACCELERATORS_ALLOCATED, logic, lambda lg: [  # every RL role, 0 too
        (count, {"holder": holder})
        for holder, count in ({role: 0 for role in RL_ROLES} | status(lg).roles).items()])
    # Fractions, and the cumulative totals of the scheduler's accounting (observable counters).
    for spec, field in ((metrics_catalog.ACCELERATOR_ALLOCATED_FRACTION, "allocated_utilization"),
                        (metrics_catalog.ACCELERATOR_BUSY_FRACTION, "busy_utilization"),
                        (metrics_catalog.PREEMPTIONS, "preemptions"), (metrics_catalog.PREEMPTION_KILLS, "kills"),
                        (metrics_catalog.PREEMPTION_LOST, "lost_accelerator_s"),
                        (metrics_catalog.RL_QUEUEING, "rl_queueing_s")):
        metrics.observe(spec, logic, lambda lg, field=field: [(getattr(status(lg), field), {})])
