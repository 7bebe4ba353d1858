"""MeshStores on the session's real nats-server: the stores an actor hands its logic, built on one
connection, without reaching through the publisher for a JetStream context."""

from __future__ import annotations

import pytest

from rollmesh.bus.mesh_stores import MeshStores
from rollmesh.bus.publisher import BusPublisher
from rollmesh.bus.streams import ensure_streams
from rollmesh.messages import RolloutRequested, RolloutState, WeightsPublished
from rollmesh.messages.subjects import WEIGHTS_PUBLISHED

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def weights(version: int) -> WeightsPublished:
    return WeightsPublished(version=version, path=f"/w/v{version}", sha256="0" * 64, num_bytes=1)


async def test_latest_weights_is_the_newest_published_version_or_none(nats_client, namespace: str) -> None:
    js = nats_client.jetstream()
    await ensure_streams(js, namespace)
    stores = MeshStores(js, namespace)
    assert await stores.latest_weights() is None
    publisher = BusPublisher(nats_client, js, namespace)
    for version in (1, 2):
        await publisher.publish(WEIGHTS_PUBLISHED, weights(version))
    assert await stores.latest_weights() == weights(2)


async def test_the_rollout_state_store_keeps_a_state_across_store_instances(nats_client, namespace: str) -> None:
    js = nats_client.jetstream()
    await ensure_streams(js, namespace)
    state = RolloutState(rollout_id="r-1", request=RolloutRequested(rollout_id="r-1", task="toy"))
    await MeshStores(js, namespace).rollout_states().save(state)
    assert await MeshStores(js, namespace).rollout_states().load("r-1") == state
