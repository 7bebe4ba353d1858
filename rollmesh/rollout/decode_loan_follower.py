"""A rollout worker's side of decode loans: its router follows the decode workers the GPU
scheduler lends idle accelerators to.

Knows the router's ``DecodeLoanRoster``, the loan events and the ``Publisher`` port; not NATS (the
shell delivers the events) and Ray only through the injected ``find_worker`` (a loan's grant id
names its worker). At start the scheduler's status lists the loans made before this worker existed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollmesh.inference.decode_loans import DecodeLoanRoster
from rollmesh.inference.router import InferenceRouter
from rollmesh.messages import GpuGranted, GpuReleased, SchedulerStatusRequest
from rollmesh.messages.subjects import GPU_GRANTED, GPU_RELEASED, SCHED_STATUS
from rollmesh.ports import MessageContext, Publisher, RequestFailedError, Subscription

# How long a worker waits at start for the scheduler's status before it assumes nothing is lent.
STATUS_TIMEOUT_S = 5.0


class RolloutDecodeLoanFollower:
    """Keeps ``router`` in step with the scheduler's decode loans; ``find_worker(name)`` is a
    lent worker's actor handle (ValueError when it is gone)."""

    def __init__(self, router: InferenceRouter, publisher: Publisher, find_worker: Callable[[str], Any]) -> None:
        self.router = router
        self.publisher = publisher
        self.roster = DecodeLoanRoster(router, find_worker)

    def subscriptions(self) -> list[Subscription]:
        return [Subscription(GPU_GRANTED, self.handle_granted, "core"),
                Subscription(GPU_RELEASED, self.handle_released, "core")]

    async def start(self) -> None:
        try:
            status = await self.publisher.request(SCHED_STATUS, SchedulerStatusRequest(), STATUS_TIMEOUT_S)
        except RequestFailedError:
            return  # no scheduler answering: nothing lent
        await self.roster.reconcile(status.decode_loan_workers)  # type: ignore[attr-defined]

    async def handle_granted(self, message: GpuGranted, context: MessageContext) -> None:
        await self.roster.granted(message)

    async def handle_released(self, message: GpuReleased, context: MessageContext) -> None:
        self.roster.released(message)
