"""Lease requests under overload: creation slower than the requester waits (the warm pool empty on
a loaded host). A request carries its deadline; the broker makes no sandbox for one nobody waits
for, gives back a lease granted too late, and keeps one a retry (same holder) still waits for.

Plain logic against the fake runtime on a manual clock: each creation advances the clock by its
latency, so "too late" is decided by the clock the test moves, never by how fast this host is.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
from support.fakes import FakeSandboxBackend, ManualClock

from rollmesh.config import RolloutConfig, SandboxConfig, SandboxProfileConfig
from rollmesh.messages import Subject, WireMessage
from rollmesh.messages.sandbox import SandboxLeaseRequest
from rollmesh.rollout.agent_loop import MAX_RETRY_DELAY_S, infra_retry_delay_s
from rollmesh.rollout.rollout_sandbox import RolloutSandbox
from rollmesh.sandbox import SandboxBroker, SandboxBrokerClient
from rollmesh.sandbox.in_process import InProcessRequester

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

CREATE_S = 20.0  # a cold sandbox's creation on a loaded host
WAIT_S = 30.0  # how long a lease request waits for its reply (the client's timeout)


def slow_broker(tmp_path: Path, **config: object) -> tuple[SandboxBroker, FakeSandboxBackend, ManualClock]:
    """One creation at a time, each CREATE_S long, no warm pool."""
    clock = ManualClock()
    backend = FakeSandboxBackend(clock=clock, create_s=CREATE_S)
    ids = (f"id{n}" for n in itertools.count())
    profiles = {"default": SandboxProfileConfig(warm_min=0, warm_max=0)}
    broker = SandboxBroker(SandboxConfig(profiles=profiles, max_concurrent_creates=1, **config), backend,
                           snapshot_dir=tmp_path / "snap", clock=clock, new_id=lambda: next(ids))
    return broker, backend, clock


class RecordingRequester(InProcessRequester):
    """Straight into the broker, keeping every request sent."""

    def __init__(self, broker: SandboxBroker) -> None:
        super().__init__(broker)
        self.sent: list[WireMessage] = []

    async def request(self, subject: Subject, message: WireMessage, timeout_s: float) -> WireMessage:
        self.sent.append(message)
        return await super().request(subject, message, timeout_s)


async def test_creations_slower_than_the_client_waits_make_no_sandbox_for_a_request_given_up(tmp_path):
    # Six rollouts ask at once, each waiting WAIT_S; creations run one at a time, CREATE_S each:
    # only the first can be served in time. Without deadlines the broker made all six, one
    # after another (six sandboxes for the one lease a client received; five leases held by
    # nobody until their TTL, 2 min in the demo, each retry queueing behind them).
    broker, backend, clock = slow_broker(tmp_path)
    backend.create_gate = asyncio.Event()
    asking = [asyncio.create_task(broker.lease(SandboxLeaseRequest(holder=f"rollout-{n}", deadline=clock() + WAIT_S)))
              for n in range(6)]
    while backend.creates_waiting == 0:  # every request is in; the first creation has its slot
        await asyncio.sleep(0)
    backend.create_gate.set()
    replies = await asyncio.gather(*asking)
    assert [bool(reply.lease_id) for reply in replies] == [True] + [False] * 5
    assert {reply.error_kind for reply in replies[1:]} == {"capacity"}
    # The second started its creation while its client still waited (at 20 s of 30) and was
    # ready too late (40 s): destroyed at once, never leased. The other four were never started.
    assert len(backend.created) == 2 and backend.created[1].destroyed
    assert len(backend.live()) == 1 and broker.stats().active_leases == 1
    assert broker.counts["leases_abandoned"] == 5 and broker.counts["sandboxes_ready_too_late"] == 1


async def test_a_retry_that_waits_on_a_pending_lease_keeps_it_past_the_first_requests_deadline(tmp_path):
    broker, backend, clock = slow_broker(tmp_path)
    backend.create_gate = asyncio.Event()
    first = asyncio.create_task(broker.lease(SandboxLeaseRequest(holder="r", deadline=clock() + 10)))
    while backend.creates_waiting == 0:
        await asyncio.sleep(0)
    retry = asyncio.create_task(broker.lease(SandboxLeaseRequest(holder="r", deadline=clock() + 10 + WAIT_S)))
    await asyncio.sleep(0)  # the retry attaches to the pending grant
    backend.create_gate.set()  # ready at +20 s: past the first request's deadline, not the retry's
    replies = await asyncio.gather(first, retry)
    assert {reply.error_kind for reply in replies} == {""}
    assert replies[0].lease_id == replies[1].lease_id
    assert len(backend.created) == 1 and not backend.created[0].destroyed


async def test_a_lease_request_that_arrives_past_its_deadline_is_answered_without_a_sandbox(tmp_path):
    broker, backend, clock = slow_broker(tmp_path)
    reply = await broker.lease(SandboxLeaseRequest(holder="late", deadline=clock() - 1))
    assert reply.error_kind == "capacity" and reply.lease_id == "" and "deadline" in reply.error
    assert backend.created == [] and broker.counts["lease_requests_dropped"] == 1


async def test_a_lease_request_without_a_deadline_waits_for_its_sandbox_however_long(tmp_path):
    # Old clients send none: they are served as before.
    broker, backend, clock = slow_broker(tmp_path)
    replies = [await broker.lease(SandboxLeaseRequest(holder=f"r{n}")) for n in range(3)]
    assert all(reply.lease_id for reply in replies) and len(backend.live()) == 3


async def test_a_retry_finds_the_lease_granted_in_time_whatever_its_own_deadline(tmp_path):
    # A retry whose lease was granted in time gets it again, whatever the clock says since.
    broker, backend, clock = slow_broker(tmp_path)
    first = await broker.lease(SandboxLeaseRequest(holder="r", deadline=clock() + WAIT_S))
    clock.advance(WAIT_S)
    again = await broker.lease(SandboxLeaseRequest(holder="r", deadline=clock() - 1))
    assert first.lease_id == again.lease_id != "" and len(backend.created) == 1


async def test_a_rollouts_lease_request_waits_rollout_sandbox_lease_wait_s_and_says_so(tmp_path):
    broker, _, clock = slow_broker(tmp_path)
    requester = RecordingRequester(broker)
    client = SandboxBrokerClient(requester, clock=clock)
    config = RolloutConfig(sandbox_lease_wait_s=45.0)
    await RolloutSandbox(client, config).lease("rollout-1", held="", snapshot_id="", turn=0)
    (sent,) = requester.sent
    assert isinstance(sent, SandboxLeaseRequest) and sent.deadline == clock.now - CREATE_S + 45.0
    assert RolloutConfig().sandbox_lease_wait_s > SandboxBrokerClient(requester).timeout_s


def test_infra_retry_pauses_double_and_are_spread_by_up_to_half():
    assert [infra_retry_delay_s(failures, 1.0, 0.999999) for failures in (1, 2, 3)] == pytest.approx([1, 2, 4])
    assert infra_retry_delay_s(2, 1.0, 0.0) == 1.0  # half of 2 s at the lowest draw
    assert infra_retry_delay_s(20, 1.0, 0.0) == MAX_RETRY_DELAY_S / 2
    spread = {infra_retry_delay_s(1, 4.0, draw) for draw in (0.0, 0.25, 0.5, 0.75)}
    assert spread == {2.0, 2.5, 3.0, 3.5}  # rollouts failed together come back apart
