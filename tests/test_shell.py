"""ActorShell around a toy logic class, against the session's real nats-server."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import time
from collections.abc import Awaitable, Callable

import pytest
from opentelemetry import trace

from rollmesh.actors.shell import ActorShell
from rollmesh.mesh_address import MeshAddress
from rollmesh.ports import MessageContext, Publisher, Subscription
from rollmesh.bus.streams import rollout_requests_stream
from rollmesh.config import NatsConfig, TelemetryConfig
from rollmesh.telemetry.logging import setup_logging
from rollmesh.messages import (
    DeadLettered,
    RolloutProgressed,
    RolloutRequested,
    SandboxExecReply,
    SandboxExecRequest,
)
from rollmesh.messages.subjects import (
    DEAD_LETTERED,
    ROLLOUT_PROGRESSED,
    ROLLOUT_REQUESTED,
    SANDBOX_EXEC,
)

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
# The redelivery and the dead letter take longer on a loaded machine.
LOGGED_WAIT_S = float(os.environ.get("ROLLMESH_TEST_WAIT_S", "60"))


class ToyLogic:
    """Serves one subject per mode; its behaviour is steered by the message contents."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.requested: asyncio.Queue[tuple[RolloutRequested, MessageContext]] = asyncio.Queue()
        self.progressed: asyncio.Queue[tuple[RolloutProgressed, MessageContext]] = asyncio.Queue()
        self.entered: asyncio.Queue[str] = asyncio.Queue()
        self.gate = asyncio.Event()
        self.started = self.stopped = False

    def subscriptions(self) -> list[Subscription]:
        return [
            Subscription(SANDBOX_EXEC, self.on_exec, "request"),
            Subscription(ROLLOUT_REQUESTED, self.on_requested, "jetstream", max_concurrent=2,
                         retry_delay_s=0.05, ack_wait_s=10),
            Subscription(ROLLOUT_PROGRESSED, self.on_progressed, "core"),
        ]

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def stats(self) -> dict[str, int]:
        return {"requested": self.requested.qsize()}

    async def on_exec(self, request: SandboxExecRequest, ctx: MessageContext) -> SandboxExecReply:
        if request.argv[0] == "boom":
            raise RuntimeError("exec exploded")
        return SandboxExecReply(result="exit", exit_code=0, stdout=" ".join(request.argv).encode())

    async def on_requested(self, request: RolloutRequested, ctx: MessageContext) -> None:
        self.entered.put_nowait(request.rollout_id)
        if request.task == "fail-once" and ctx.delivery_attempt == 1:
            raise RuntimeError("transient")
        if request.task == "always-fail":
            raise RuntimeError("permanent")
        if request.task == "gated":
            await ctx.in_progress()
            await self.gate.wait()
        self.requested.put_nowait((request, ctx))

    async def on_progressed(self, event: RolloutProgressed, ctx: MessageContext) -> None:
        self.progressed.put_nowait((event, ctx))


async def _serve(nats_server, namespace, run_dir, name="toy-0", **shell_kwargs):
    mesh = MeshAddress(nats_url=nats_server.url, namespace=namespace, run_dir=str(run_dir),
                       telemetry=TelemetryConfig(exporter="jsonl"), nats=NatsConfig(max_deliver=3))
    shell = ActorShell(name, mesh, **shell_kwargs)
    logic = ToyLogic(await shell.connect())
    await shell.serve(logic)
    return shell, logic


@pytest.fixture
async def served(nats_server, namespace, tmp_path, trace_file):
    shell, logic = await _serve(nats_server, namespace, tmp_path)
    yield shell, logic
    await shell.stop()


async def _get(queue: asyncio.Queue):
    return await asyncio.wait_for(queue.get(), WAIT_S)


async def _eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = WAIT_S) -> None:
    """For server-side state that no event announces (e.g. an ack removing a message)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.2)


@pytest.mark.integration
async def test_request_reply_and_handler_error_reply(served, nats_client, namespace):
    shell, logic = served
    assert logic.started
    reply = await shell.publisher.request(
        SANDBOX_EXEC, SandboxExecRequest(lease_id="l", argv=["echo", "hi"]), timeout_s=WAIT_S)
    assert reply == SandboxExecReply(result="exit", exit_code=0, stdout=b"echo hi")

    failed = await shell.publisher.request(
        SANDBOX_EXEC, SandboxExecRequest(lease_id="l", argv=["boom"]), timeout_s=WAIT_S)
    assert failed.error_kind == "internal_error" and "exec exploded" in failed.error
    counters = shell.stats()["subjects"][SANDBOX_EXEC.template]
    assert counters == {"received": 2, "handled": 1, "failed": 1, "dead_lettered": 0}


@pytest.mark.integration
async def test_jetstream_message_is_acked_only_after_the_handler_returned(
        served, nats_client, namespace):
    shell, logic = served
    js = nats_client.jetstream()
    stream = rollout_requests_stream(namespace)
    await shell.publisher.publish(ROLLOUT_REQUESTED, RolloutRequested(rollout_id="g", task="gated"))
    assert await _get(logic.entered) == "g"

    consumer = await js.consumer_info(stream, "rollout_requested")
    assert consumer.num_ack_pending == 1
    assert (await js.stream_info(stream)).state.messages == 1  # still there: not acked

    logic.gate.set()
    request, ctx = await _get(logic.requested)
    assert request.rollout_id == "g" and ctx.delivery_attempt == 1

    async def removed() -> bool:  # work queue: the ack removes the message
        return (await js.stream_info(stream)).state.messages == 0
    await _eventually(removed)


@pytest.mark.integration
async def test_jetstream_redelivers_after_handler_raised_then_dead_letters(
        served, nats_client, namespace):
    shell, logic = served
    dlq = await nats_client.subscribe(DEAD_LETTERED.format(namespace))
    await shell.publisher.publish(ROLLOUT_REQUESTED,
                                  RolloutRequested(rollout_id="f1", task="fail-once"))
    request, ctx = await _get(logic.requested)
    assert request.rollout_id == "f1" and ctx.delivery_attempt == 2

    await shell.publisher.publish(ROLLOUT_REQUESTED,
                                  RolloutRequested(rollout_id="f3", task="always-fail"))
    letter = DEAD_LETTERED.decode((await dlq.next_msg(timeout=WAIT_S)).data)
    assert letter.subject == ROLLOUT_REQUESTED.format(namespace)
    assert "delivery 3/3" in letter.reason and "permanent" in letter.reason
    assert ROLLOUT_REQUESTED.decode(base64.b64decode(letter.payload_b64)).rollout_id == "f3"

    def counters() -> dict[str, int]:
        return shell.stats()["subjects"][ROLLOUT_REQUESTED.template]

    async def counted() -> bool:  # the letter can arrive before the shell counts it
        return counters()["dead_lettered"] == 1
    await _eventually(counted)
    assert counters()["failed"] == 4 and counters()["handled"] == 1


@pytest.mark.integration
async def test_malformed_bytes_on_every_subject_are_dead_lettered_and_serving_goes_on(
        served, nats_client, namespace):
    shell, logic = served
    js = nats_client.jetstream()
    dlq = await nats_client.subscribe(DEAD_LETTERED.format(namespace))
    garbage = b"\xff\x00 not a message"
    wrong_type = json.dumps({"type": "rollout.requested", "rollout_id": 5, "task": "t"}).encode()

    await js.publish(ROLLOUT_REQUESTED.format(namespace), garbage)
    await js.publish(ROLLOUT_REQUESTED.format(namespace), wrong_type)
    await nats_client.publish(ROLLOUT_PROGRESSED.format(namespace), garbage)
    error = await nats_client.request(SANDBOX_EXEC.format(namespace), garbage, timeout=WAIT_S)
    error_reply = SANDBOX_EXEC.decode_reply(error.data)
    assert error_reply.error_kind == "invalid_request"  # the caller is not left waiting

    letters: list[DeadLettered] = [
        DEAD_LETTERED.decode((await dlq.next_msg(timeout=WAIT_S)).data) for _ in range(4)
    ]
    assert sorted(letter.subject for letter in letters) == sorted([
        ROLLOUT_REQUESTED.format(namespace), ROLLOUT_REQUESTED.format(namespace),
        ROLLOUT_PROGRESSED.format(namespace), SANDBOX_EXEC.format(namespace),
    ])
    assert all(letter.consumer == "toy-0" and letter.payload_size > 0 for letter in letters)
    assert any("$.rollout_id" in letter.reason for letter in letters)  # msgspec's error path

    # Still serving every subject.
    await shell.publisher.publish(ROLLOUT_REQUESTED, RolloutRequested(rollout_id="ok", task="t"))
    assert (await _get(logic.requested))[0].rollout_id == "ok"
    await shell.publisher.publish(ROLLOUT_PROGRESSED, RolloutProgressed(
        rollout_id="ok", turn=1, num_tokens=1, weight_version=0))
    assert (await _get(logic.progressed))[0].rollout_id == "ok"
    reply = await shell.publisher.request(
        SANDBOX_EXEC, SandboxExecRequest(lease_id="l", argv=["x"]), timeout_s=WAIT_S)
    assert reply.stdout == b"x"

    # Terminated, not redelivered: the work queue is empty once "ok" is acked too.
    stream = rollout_requests_stream(namespace)

    async def drained() -> bool:
        return (await js.stream_info(stream)).state.messages == 0
    await _eventually(drained)
    subjects = shell.stats()["subjects"]  # counted before term, so final once drained
    assert subjects[ROLLOUT_REQUESTED.template]["dead_lettered"] == 2
    assert subjects[ROLLOUT_PROGRESSED.template]["dead_lettered"] == 1
    assert subjects[SANDBOX_EXEC.template]["dead_lettered"] == 1


@pytest.mark.integration
async def test_every_handled_message_ends_in_one_canonical_log_line(nats_server, namespace, tmp_path, trace_file):
    buffer = io.StringIO()
    setup_logging("toy-0", "info", stream=buffer, force=True)
    shell, logic = await _serve(nats_server, namespace, tmp_path)
    try:
        await shell.publisher.request(SANDBOX_EXEC, SandboxExecRequest(lease_id="l", argv=["ok"]), timeout_s=WAIT_S)
        await shell.publisher.request(SANDBOX_EXEC, SandboxExecRequest(lease_id="l", argv=["boom"]), timeout_s=WAIT_S)
        await shell.publisher.publish(ROLLOUT_REQUESTED, RolloutRequested(rollout_id="c1", task="fail-once"))
        await _get(logic.requested)
        await shell.nats_client.publish(ROLLOUT_PROGRESSED.format(namespace), b"\xff not a message")

        def canonical() -> list[dict]:
            return [line for line in map(json.loads, buffer.getvalue().splitlines())
                    if line["event"] == "message_handled"]

        expected = {(SANDBOX_EXEC.template, "handled"), (SANDBOX_EXEC.template, "failed"),
                    (ROLLOUT_REQUESTED.template, "retrying"), (ROLLOUT_REQUESTED.template, "handled"),
                    (ROLLOUT_PROGRESSED.template, "dead_lettered")}

        async def all_logged() -> bool:  # each of the five messages' line, whatever order they come in
            return expected <= {(line["subject_template"], line["outcome"]) for line in canonical()}
        await _eventually(all_logged, timeout_s=LOGGED_WAIT_S)
    finally:
        await shell.stop()
        setup_logging("pytest", "info", force=True)
    lines = [line for line in canonical() if line["subject_template"] in {t for t, _ in expected}]
    assert len(lines) == 5, lines  # one line per message, no more
    by_template = {}
    for line in lines:
        by_template.setdefault(line["subject_template"], []).append(line)
    assert [line["outcome"] for line in by_template[SANDBOX_EXEC.template]] == ["handled", "failed"]
    requested = by_template[ROLLOUT_REQUESTED.template]
    assert [(line["outcome"], line["attempt"]) for line in requested] == [("retrying", 1), ("handled", 2)]
    assert all(line["rollout_id"] == "c1" and line["message_type"] == "rollout.requested" for line in requested)
    assert [line["outcome"] for line in by_template[ROLLOUT_PROGRESSED.template]] == ["dead_lettered"]
    for line in lines:  # one line carries what a reader needs to find the message's trace
        assert line["actor"] == "toy-0" and line["duration_ms"] >= 0
        assert len(line["trace_id"]) == 32 and len(line["span_id"]) == 16


@pytest.mark.integration
async def test_trace_context_flows_from_publisher_to_handler_span(served, trace_file):
    shell, logic = served
    with trace.get_tracer("test").start_as_current_span("client") as client:
        await shell.publisher.publish(ROLLOUT_PROGRESSED, RolloutProgressed(
            rollout_id="tr", turn=1, num_tokens=1, weight_version=7))
    _, ctx = await _get(logic.progressed)
    trace_id = f"{client.get_span_context().trace_id:032x}"
    assert ctx.trace_id == trace_id and "traceparent" in ctx.headers

    await shell.stop()  # flushes spans
    records = [json.loads(line) for line in trace_file.read_text().splitlines()]
    mine = {r["name"]: r for r in records if r["trace_id"] == trace_id}
    consumer = mine[ROLLOUT_PROGRESSED.template]  # named after the template, not the subject
    producer = mine[f"publish {ROLLOUT_PROGRESSED.template}"]
    assert consumer["parent_span_id"] == producer["span_id"]
    assert consumer["attributes"]["messaging.system"] == "nats"
    assert consumer["attributes"]["rollout_id"] == "tr"
    assert consumer["attributes"]["weight_version"] == 7
    assert logic.stopped


@pytest.mark.integration
async def test_stop_hands_an_in_flight_jetstream_message_to_another_replica(
        nats_server, namespace, tmp_path, trace_file):
    first, first_logic = await _serve(nats_server, namespace, tmp_path, "toy-a",
                                      drain_timeout_s=0.05)
    second = None
    try:
        await first.publisher.publish(ROLLOUT_REQUESTED,
                                      RolloutRequested(rollout_id="handoff", task="gated"))
        assert await _get(first_logic.entered) == "handoff"
        await first.stop()  # handler still blocked on the gate: cancelled and nak'ed
        second, second_logic = await _serve(nats_server, namespace, tmp_path, "toy-b")
        second_logic.gate.set()
        request, ctx = await _get(second_logic.requested)
        assert request.rollout_id == "handoff" and ctx.delivery_attempt == 2
    finally:
        await first.stop()
        if second is not None:
            await second.stop()


@pytest.mark.unit
def test_subscription_rejects_inconsistent_declarations():
    async def handler(message, ctx):
        return None

    with pytest.raises(ValueError):
        Subscription(ROLLOUT_PROGRESSED, handler, "request")  # no reply type
    with pytest.raises(ValueError):
        Subscription(ROLLOUT_PROGRESSED, handler, "core", durable="d")
    with pytest.raises(ValueError):
        Subscription(ROLLOUT_REQUESTED, handler, "jetstream", durable="a.b")
    assert Subscription(ROLLOUT_REQUESTED, handler, "jetstream").durable_name() == \
        "rollout_requested"
    assert Subscription(SANDBOX_EXEC, handler, "request").queue_group() == "sandbox_exec"
    assert Subscription(ROLLOUT_PROGRESSED, handler, "core").queue_group() is None
