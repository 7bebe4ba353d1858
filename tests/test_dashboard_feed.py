"""The dashboard's feed on a real nats-server: published events reach its state, bad bytes are
counted and the feed keeps going, and a bus that is not there yet is said, then retried.

No Ray here (no broker or workers to poll; those polls are skipped); the feed inside a real mesh's
Serve app is in test_dashboard_browser.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from rollmesh.bus.connection import flush_to_server
from rollmesh.config import DashboardConfig, NatsConfig
from rollmesh.dashboard import DashboardFeed, DashboardState
from rollmesh.mesh_address import MeshAddress
from rollmesh.messages import RolloutProgressed, RolloutRequested, SchedulerStatus
from rollmesh.messages.subjects import (
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_PROGRESSED,
    ROLLOUT_REQUESTED,
    SCHED_UTILIZATION,
)
from rollmesh.messages.rollout import RolloutFailed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def wait_until(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.05)


async def test_the_feed_folds_published_events_and_survives_malformed_ones(
        nats_server, nats_client, namespace: str, tmp_path: Path) -> None:
    mesh = MeshAddress(nats_url=nats_server.url, namespace=namespace, run_dir=str(tmp_path))
    config = DashboardConfig(poll_s=0.5)
    state = DashboardState(config, namespace=namespace)
    feed = DashboardFeed(mesh, state, config=config)
    feed.start()
    try:
        await wait_until(lambda: state.feed == "connected")
        publish = nats_client.publish
        await publish(ROLLOUT_COMPLETED.format(namespace), b"\x00 not json")
        await publish(ROLLOUT_PROGRESSED.format(namespace), b'{"type": "rollout.progressed"}')
        await publish(ROLLOUT_REQUESTED.format(namespace), ROLLOUT_REQUESTED.encode(
            RolloutRequested(rollout_id="r1", task="molar_mass", max_turns=2)))
        await publish(ROLLOUT_PROGRESSED.format(namespace), ROLLOUT_PROGRESSED.encode(
            RolloutProgressed(rollout_id="r1", turn=1, num_tokens=12, weight_version=0,
                              trace_id="ab" * 16)))
        await publish(ROLLOUT_FAILED.format(namespace), ROLLOUT_FAILED.encode(
            RolloutFailed(rollout_id="r2", kind="sandbox_timeout", reason="the tool ran past 10 s")))
        await publish(SCHED_UTILIZATION.format(namespace), SCHED_UTILIZATION.encode(SchedulerStatus(
            capacity=2, roles={"decode": 1}, jobs={}, allocated_utilization=0.5, busy_utilization=0.25,
            preemptions=0, kills=0, lost_accelerator_s=0.0, rl_queueing_s=0.0, reported_at=123.0)))
        await flush_to_server(nats_client)

        await wait_until(lambda: state.snapshot().counts.failed == 1
                         and state.snapshot().accelerators != []
                         and any(r.turn == 1 for r in state.snapshot().in_flight))
        snapshot = state.snapshot()
        assert snapshot.counts.malformed == {ROLLOUT_COMPLETED.template: 1,
                                             ROLLOUT_PROGRESSED.template: 1}
        (running,) = snapshot.in_flight
        assert (running.rollout_id, running.progress, running.trace_id) == ("r1", 0.5, "ab" * 16)
        assert [(f.kind, f.reason) for f in snapshot.failures] == [
            ("sandbox_timeout", "the tool ran past 10 s")]
        assert snapshot.accelerators[0].busy_utilization == 0.25
    finally:
        await feed.close()


async def test_a_feed_whose_bus_is_not_up_says_so_and_keeps_trying(namespace: str, tmp_path: Path) -> None:
    mesh = MeshAddress(nats_url="nats://127.0.0.1:1", namespace=namespace, run_dir=str(tmp_path),
                       nats=NatsConfig(connect_timeout_s=0.5))
    state = DashboardState(DashboardConfig(), namespace=namespace)
    feed = DashboardFeed(mesh, state)
    feed.start()
    try:
        await wait_until(lambda: state.feed.startswith("error:"))
        assert state.snapshot().feed.startswith("error: cannot connect")
    finally:
        await feed.close()
