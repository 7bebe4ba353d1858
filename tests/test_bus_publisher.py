"""BusPublisher: durable JetStream publish with dedup ids and trace headers; request errors."""

from __future__ import annotations

import asyncio
import base64

import pytest
from opentelemetry import trace

from rollmesh.bus.connection import flush_to_server
from rollmesh.bus.errors import NoRespondersError, RequestTimeoutError
from rollmesh.bus.publisher import BusPublisher
from rollmesh.bus.streams import dead_letter_stream, ensure_streams, rollout_requests_stream
from rollmesh.messages import DeadLettered, RolloutProgressed, RolloutRequested, SandboxExecRequest
from rollmesh.messages.subjects import (
    DEAD_LETTERED,
    ROLLOUT_PROGRESSED,
    ROLLOUT_REQUESTED,
    SANDBOX_EXEC,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
async def publisher(nats_client, namespace):
    js = nats_client.jetstream()
    await ensure_streams(js, namespace)
    return BusPublisher(nats_client, js, namespace)


async def test_stream_subject_is_durable_on_return_deduplicated_and_traced(
        publisher, nats_client, namespace, trace_file):
    js = nats_client.jetstream()
    request = RolloutRequested(rollout_id="r-1", task="toy")
    with trace.get_tracer("test").start_as_current_span("caller") as caller:
        first = await publisher.publish(ROLLOUT_REQUESTED, request)
    info = await js.stream_info(rollout_requests_stream(namespace))
    assert info.state.messages == 1  # stored before publish() returned
    assert (first.stream, first.seq, first.duplicate) == (rollout_requests_stream(namespace), 1, None)

    again = await publisher.publish(ROLLOUT_REQUESTED, request)  # same rollout_id: dropped by the server
    info = await js.stream_info(rollout_requests_stream(namespace))
    assert info.state.messages == 1
    assert again.duplicate  # the ack says so

    stored = await js.get_msg(rollout_requests_stream(namespace), seq=1)
    assert stored.headers["Nats-Msg-Id"] == "rollout.requested:r-1"
    trace_id = f"{caller.get_span_context().trace_id:032x}"
    assert stored.headers["traceparent"].split("-")[1] == trace_id
    assert ROLLOUT_REQUESTED.decode(stored.data) == request


async def test_core_subject_goes_over_core_nats(publisher, nats_client, namespace):
    sub = await nats_client.subscribe(ROLLOUT_PROGRESSED.format(namespace))
    event = RolloutProgressed(rollout_id="r", turn=1, num_tokens=3, weight_version=0)
    assert await publisher.publish(ROLLOUT_PROGRESSED, event) is None  # no stream, no ack
    msg = await sub.next_msg(timeout=5)
    assert ROLLOUT_PROGRESSED.decode(msg.data) == event


async def test_request_errors_are_typed(publisher, nats_client, namespace):
    request = SandboxExecRequest(lease_id="l", argv=["true"])
    with pytest.raises(NoRespondersError):
        await publisher.request(SANDBOX_EXEC, request, timeout_s=5)
    silent = await nats_client.subscribe(SANDBOX_EXEC.format(namespace))  # never answers
    await flush_to_server(nats_client)
    with pytest.raises(RequestTimeoutError) as info:
        await publisher.request(SANDBOX_EXEC, request, timeout_s=0.2)
    assert info.value.subject == SANDBOX_EXEC.format(namespace)
    await silent.unsubscribe()


async def test_dead_letter_keeps_a_bounded_payload_head(publisher, nats_client, namespace):
    js = nats_client.jetstream()
    payload = bytes(range(256)) * 8
    letter = await publisher.publish_dead_letter(
        subject="rl.x.y", consumer="c", reason="bad", payload=payload
    )
    assert letter.payload_size == len(payload)
    assert base64.b64decode(letter.payload_b64) == payload[:1024]
    stored = await asyncio.wait_for(js.get_msg(dead_letter_stream(namespace), seq=1), 5)
    assert DEAD_LETTERED.decode(stored.data) == letter
    assert isinstance(letter, DeadLettered)
