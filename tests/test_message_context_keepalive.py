"""``MessageContext.keep_alive_while``: the one keepalive of a delivery that waits (plain logic).

JetStream's in-progress ack is faked by ``ProgressRecorder``; the awaited work ends only once the
recorder has counted the beats a test wants, so no test depends on timing.
"""

from __future__ import annotations

import asyncio

import pytest

from support.fakes import ProgressRecorder
from support.waiting import WAIT_S
from rollmesh.ports import MessageContext

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

EVERY_S = 0.01


class BeatWaiter(ProgressRecorder):
    """Counts beats; ``wait_beats(n)`` returns once ``n`` came. ``failing`` beats raise first."""

    def __init__(self, failing: int = 0) -> None:
        super().__init__()
        self.failing = failing
        self._changed = asyncio.Event()

    async def __call__(self) -> None:
        await super().__call__()
        self._changed.set()
        if self.calls <= self.failing:
            raise ConnectionError("NATS away for a moment")

    async def wait_beats(self, n: int) -> None:
        while self.calls < n:
            self._changed.clear()
            await self._changed.wait()


def context(progress: ProgressRecorder | None) -> MessageContext:
    return MessageContext(subject="rl.test.x", keepalive_every_s=EVERY_S, _progress=progress)


async def test_keep_alive_while_beats_until_the_work_returns_and_gives_its_result():
    beats = BeatWaiter()

    async def work() -> str:
        await beats.wait_beats(3)
        return "done"

    assert await asyncio.wait_for(context(beats).keep_alive_while(work()), WAIT_S) == "done"


async def test_keep_alive_while_raises_what_a_waited_future_failed_with():
    beats = BeatWaiter()
    failed = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(context(beats).keep_alive_while(failed))
    await beats.wait_beats(2)
    failed.set_exception(RuntimeError("the step failed"))
    with pytest.raises(RuntimeError, match="the step failed"):
        await asyncio.wait_for(waiting, WAIT_S)


async def test_a_cancelled_delivery_leaves_the_shared_future_to_the_others():
    beats = BeatWaiter()
    shared = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(context(beats).keep_alive_while(shared))
    await beats.wait_beats(1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not shared.done(), "another delivery of the same message may still wait on it"


async def test_a_failed_beat_is_logged_and_the_next_beat_tries_again():
    beats = BeatWaiter(failing=2)

    async def work() -> int:
        await beats.wait_beats(4)
        return beats.calls

    assert await asyncio.wait_for(context(beats).keep_alive_while(work()), WAIT_S) >= 4


async def test_without_an_in_progress_ack_the_work_just_runs():
    async def work() -> str:
        return "core message"

    assert await context(None).keep_alive_while(work()) == "core message"


async def test_no_beat_outlives_the_work():
    beats = BeatWaiter()

    async def work() -> None:
        await beats.wait_beats(1)

    await asyncio.wait_for(context(beats).keep_alive_while(work()), WAIT_S)
    assert not [task for task in asyncio.all_tasks() if task.get_name().startswith("keepalive:")]
