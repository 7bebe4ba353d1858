"""JetStream layout: ensure_streams creates, updates, and is safe to call concurrently."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import RetentionPolicy, StorageType

from rollmesh.bus.streams import (
    checkpoints_stream,
    scheduling_stream,
    StreamLimits,
    dead_letter_stream,
    ensure_streams,
    rollout_requests_stream,
    rollout_results_stream,
    rollout_state_bucket,
    stream_for,
    weights_stream,
)
from rollmesh.messages.subjects import (
    DEAD_LETTERED,
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_PROGRESSED,
    ROLLOUT_REQUESTED,
    SANDBOX_EXEC,
    WEIGHTS_PUBLISHED,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.unit
def test_stream_names_are_valid_and_cover_the_durable_subjects():
    ns = "ab-c_1"
    assert rollout_requests_stream(ns) == "RL_ab-c_1_ROLLOUT_REQUESTS"
    assert stream_for(ROLLOUT_REQUESTED, ns) == rollout_requests_stream(ns)
    assert stream_for(ROLLOUT_COMPLETED, ns) == stream_for(ROLLOUT_FAILED, ns)
    assert stream_for(WEIGHTS_PUBLISHED, ns) == weights_stream(ns)
    assert stream_for(DEAD_LETTERED, ns) == dead_letter_stream(ns)
    assert stream_for(ROLLOUT_PROGRESSED, ns) is None
    assert stream_for(SANDBOX_EXEC, ns) is None
    with pytest.raises(ValueError):
        rollout_requests_stream("a.b")


@pytest.mark.integration
async def test_ensure_streams_twice_and_concurrently_converges(nats_client, namespace):
    js = nats_client.jetstream()
    # A fresh namespace: the concurrent calls race on creation itself.
    await asyncio.wait_for(asyncio.gather(*(ensure_streams(js, namespace) for _ in range(3))), 20)
    names = await asyncio.wait_for(ensure_streams(js, namespace), 10)
    assert set(names) == {rollout_requests_stream(namespace), rollout_results_stream(namespace),
                          weights_stream(namespace), checkpoints_stream(namespace),
                          scheduling_stream(namespace),
                          dead_letter_stream(namespace)}

    requests = await js.stream_info(rollout_requests_stream(namespace))
    assert requests.config.retention == RetentionPolicy.WORK_QUEUE
    assert requests.config.storage == StorageType.FILE
    results = await js.stream_info(rollout_results_stream(namespace))
    assert results.config.retention == RetentionPolicy.LIMITS
    assert set(results.config.subjects) == {ROLLOUT_COMPLETED.format(namespace),
                                            ROLLOUT_FAILED.format(namespace)}
    kv = await js.key_value(rollout_state_bucket(namespace))
    await kv.put("r1", b"state")
    assert (await kv.get("r1")).value == b"state"


@pytest.mark.integration
async def test_ensure_streams_updates_a_stream_whose_limits_changed(nats_client, namespace):
    js = nats_client.jetstream()
    await ensure_streams(js, namespace, StreamLimits(weights_keep_last=16))
    await ensure_streams(js, namespace, StreamLimits(weights_keep_last=4))
    info = await js.stream_info(weights_stream(namespace))
    assert info.config.max_msgs == 4
