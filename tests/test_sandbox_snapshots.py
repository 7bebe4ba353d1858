"""Workspace snapshots shared between brokers (``rollmesh.sandbox.snapshots`` with a
``SharedSnapshots`` store, faked here by a dict): a broker forks a snapshot another broker took
(the case of a broker lost with its node) from the shared copy, checked by sha256; the taking
broker's retention rules (count and byte caps, TTL) delete shared copies too; a stopping broker
leaves them. The JetStream object-store implementation runs in tests/test_sandbox_placement.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from support.fakes import FakeSandboxBackend, ManualClock

from rollmesh.config import SandboxConfig, SandboxProfileConfig
from rollmesh.messages.sandbox import SandboxSnapshotRecord
from rollmesh.sandbox import SandboxBroker, SandboxBrokerClient, SandboxRequestError
from rollmesh.sandbox.in_process import InProcessRequester

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class DictSharedSnapshots:
    def __init__(self) -> None:
        self.items: dict[str, tuple[SandboxSnapshotRecord, bytes]] = {}
        self.deleted: list[str] = []

    async def put(self, record: SandboxSnapshotRecord, data: bytes) -> None:
        self.items[record.snapshot_id] = (record, data)

    async def get(self, snapshot_id: str) -> tuple[SandboxSnapshotRecord, bytes] | None:
        return self.items.get(snapshot_id)

    async def delete(self, snapshot_id: str) -> None:
        self.deleted.append(snapshot_id)
        self.items.pop(snapshot_id, None)


def two_brokers(tmp_path: Path, **config: object):
    clock, shared = ManualClock(), DictSharedSnapshots()
    profiles = {"default": SandboxProfileConfig(warm_min=0)}

    def broker(name: str) -> SandboxBroker:
        ids = (f"{name}-{n}" for n in itertools.count())  # no broker in the id: in process
        return SandboxBroker(SandboxConfig(profiles=profiles, **config), FakeSandboxBackend(clock=clock),
                             snapshot_dir=tmp_path / name, clock=clock, new_id=lambda: next(ids),
                             shared_snapshots=shared)

    first, second = broker("a"), broker("b")
    return (SandboxBrokerClient(InProcessRequester(first)), first,
            SandboxBrokerClient(InProcessRequester(second)), second, shared, clock)


async def test_another_broker_forks_a_snapshot_from_its_shared_copy_with_the_lease_terms(tmp_path):
    a, first, b, second, shared, _ = two_brokers(tmp_path)
    lease = (await a.lease("rollout-1", ttl_s=45.0)).lease_id
    await a.upload(lease, "results/step.txt", b"step 3")
    snapshot = await a.snapshot(lease)
    record, _ = shared.items[snapshot.snapshot_id]
    assert (record.sha256, record.size) == (snapshot.sha256, snapshot.size)
    await first.close()  # the broker that took it is gone, its local copy with it

    (forked,) = await b.fork(snapshot.snapshot_id, "rollout-1", 1, ttl_s=30.0)
    assert await b.download(forked.lease_id, "results/step.txt") == b"step 3"
    assert second.counts["forks_from_shared_store"] == 1
    # Read, not kept: another broker's snapshot does not count against this broker's caps.
    assert second.stats().snapshots == 0 and snapshot.snapshot_id in shared.items


async def test_shared_bytes_that_are_not_the_snapshot_are_refused_typed(tmp_path):
    a, _, b, second, shared, _ = two_brokers(tmp_path)
    lease = (await a.lease("rollout-1")).lease_id
    snapshot = await a.snapshot(lease)
    record, data = shared.items[snapshot.snapshot_id]
    shared.items[snapshot.snapshot_id] = (record, data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(SandboxRequestError) as refused:
        await b.fork(snapshot.snapshot_id, "rollout-1", 1)
    assert refused.value.kind == "checksum_mismatch"
    assert second.stats().active_leases == 0


async def test_the_taking_brokers_caps_and_ttl_delete_shared_copies_and_stopping_keeps_them(tmp_path):
    a, first, b, _, shared, clock = two_brokers(tmp_path, max_snapshots=2, snapshot_ttl_s=100.0)
    lease = (await a.lease("rollout-1", ttl_s=1000.0)).lease_id
    taken = [(await a.snapshot(lease)).snapshot_id for _ in range(3)]
    assert shared.deleted == [taken[0]] and set(shared.items) == set(taken[1:])  # the count cap
    with pytest.raises(SandboxRequestError) as gone:
        await b.fork(taken[0], "rollout-1", 1)
    assert gone.value.kind == "unknown_snapshot"

    clock.advance(60.0)
    await a.fork(taken[2], "other", 1)  # used: its TTL starts again
    clock.advance(60.0)
    await first.reap_expired()
    assert shared.deleted == [taken[0], taken[1]] and set(shared.items) == {taken[2]}

    await first.close()
    assert set(shared.items) == {taken[2]}, "a stopping broker leaves its snapshots to the others"
