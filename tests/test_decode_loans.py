"""DecodeLoanRoster: a router's lent decode workers follow the GPU scheduler's loan events and
its status, whatever order they arrive in. Plain logic: the Ray lookup is a dict."""

from __future__ import annotations

import asyncio

import pytest

from rollmesh.inference.decode_loans import DecodeLoanRoster
from rollmesh.inference.router import InferenceRouter
from rollmesh.messages import GpuGranted, GpuReleased
from rollmesh.messages.sim_jobs import DECODE_LOAN_HOLDER

pytestmark = pytest.mark.unit


class Workers:
    """Named actors as ``ray.get_actor`` finds them: ValueError for one that is gone."""

    def __init__(self, *names: str) -> None:
        self.alive = {name: f"handle:{name}" for name in names}

    def find(self, name: str) -> str:
        if name not in self.alive:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return self.alive[name]


def granted(name: str, holder: str = DECODE_LOAN_HOLDER) -> GpuGranted:
    return GpuGranted(grant_id=name, holder=holder, role="decode", count=1.0, resource="GPU")


def released(name: str, holder: str = DECODE_LOAN_HOLDER) -> GpuReleased:
    return GpuReleased(grant_id=name, holder=holder, count=1.0)


def make_roster(workers: Workers) -> tuple[InferenceRouter, DecodeLoanRoster]:
    router = InferenceRouter([], ["own-decode"])
    return router, DecodeLoanRoster(router, workers.find)


async def test_a_granted_loan_joins_the_router_and_its_release_takes_it_out() -> None:
    router, roster = make_roster(Workers("lent-0"))
    await roster.granted(granted("lent-0"))
    assert router.lent_decode_workers() == ["lent-0"]
    assert router.decode_workers[1] == "handle:lent-0"
    roster.released(released("lent-0"))
    assert router.lent_decode_workers() == []
    assert router.decode_worker_for(None)[0] == 0  # nothing new goes to it


async def test_grants_to_other_holders_are_not_decode_workers() -> None:
    router, roster = make_roster(Workers("trainer-0"))
    await roster.granted(granted("trainer-0", holder="trainer"))
    roster.released(released("own-decode", holder="trainer"))
    assert router.lent_decode_workers() == []
    assert router.decode_workers == ["own-decode"]


async def test_a_loan_whose_worker_is_already_gone_is_skipped() -> None:
    router, roster = make_roster(Workers())
    await roster.granted(granted("lent-0"))
    assert router.lent_decode_workers() == []


async def test_reconcile_adds_missed_loans_and_drops_loans_taken_back() -> None:
    router, roster = make_roster(Workers("lent-0", "lent-1", "lent-2"))
    await roster.granted(granted("lent-0"))
    await roster.granted(granted("lent-1"))
    # The status says lent-1 was taken back and lent-2 lent while the events were missed.
    await roster.reconcile(["lent-0", "lent-2"])
    assert router.lent_decode_workers() == ["lent-0", "lent-2"]


async def test_a_release_while_the_worker_is_looked_up_wins() -> None:
    """The lookup runs off the event loop; a release handled meanwhile must not be undone."""
    looking = asyncio.Event()
    resume = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_find(name: str) -> str:
        loop.call_soon_threadsafe(looking.set)
        asyncio.run_coroutine_threadsafe(resume.wait(), loop).result(5)
        return f"handle:{name}"

    router = InferenceRouter([], ["own-decode"])
    roster = DecodeLoanRoster(router, slow_find)
    adding = asyncio.create_task(roster.granted(granted("lent-0")))
    await looking.wait()
    roster.released(released("lent-0"))
    resume.set()
    await adding
    assert router.lent_decode_workers() == []
