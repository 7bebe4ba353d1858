"""The mesh's Prometheus metrics and TensorBoard scalars after a short real run.

Uses the session's whole mesh (tests/conftest.py ``mesh``): a GRPO group of two rollouts (a
trainer step), a rollout of an unknown task (a typed failure) and one sandbox exec through the
real broker; ``/metrics`` is scraped before and after and parsed with prometheus_client's own
parser, and the TensorBoard event file is read back record by record.
"""

from __future__ import annotations

import asyncio
import json
import struct
import urllib.request
import uuid
from pathlib import Path

import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboardX.proto import event_pb2

from rollmesh.bus.publisher import BusPublisher
from rollmesh.messages import SchedulerStatus, SchedulerStatusRequest
from rollmesh.messages.subjects import ROLLOUT_COMPLETED, ROLLOUT_FAILED, SCHED_STATUS, TRAINER_STEPPED
from rollmesh.sandbox import SandboxBrokerClient
from rollmesh.telemetry import metrics_catalog as catalog

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WAIT_S = 120.0

# Counters and histograms that this test's work must move; gauges it only needs to see.
MUST_MOVE = [catalog.ROLLOUTS_COMPLETED, catalog.ROLLOUTS_FAILED, catalog.GENERATED_TOKENS,
             catalog.VERSION_LAG, catalog.TRAINER_STEP_DURATION, catalog.TRAINER_STEP_TOKENS,
             catalog.SANDBOX_LEASES_GRANTED, catalog.SANDBOX_EXEC_DURATION, catalog.ROLE_BUSY]
MUST_EXIST = [catalog.ROLLOUTS_IN_FLIGHT, catalog.QUEUE_DEPTH, catalog.WEIGHT_VERSION_ACTIVE,
              catalog.SANDBOX_POOL_SIZE, catalog.SANDBOX_LEASES_ACTIVE, catalog.ACCELERATORS_CAPACITY,
              catalog.ACCELERATORS_ALLOCATED, catalog.ACCELERATOR_ALLOCATED_FRACTION,
              catalog.ACCELERATOR_BUSY_FRACTION, catalog.METRICS_SOURCES,
              # The scheduler's accounting: counters that stay at 0 without simulation jobs.
              catalog.PREEMPTIONS, catalog.PREEMPTION_KILLS, catalog.PREEMPTION_LOST, catalog.RL_QUEUEING]


def scrape(url: str) -> dict[str, list]:
    """Family name -> its samples, as prometheus_client parses the exposition."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers.get_content_type() == "text/plain"
        text = response.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = list(family.samples)
    return families


def moved_amount(families: dict[str, list], spec: catalog.MetricSpec) -> float:
    """A counter's total over its label sets, or a histogram's total count."""
    wanted = f"{spec.name}_count" if spec.kind == "histogram" else spec.exposed_name
    return sum(sample.value for sample in families.get(spec.name, []) if sample.name == wanted)


async def scheduler_status(mesh) -> SchedulerStatus:
    nc = await nats.connect(mesh.info.nats_url)
    try:
        reply = await nc.request(SCHED_STATUS.format(mesh.namespace),
                                 SCHED_STATUS.encode(SchedulerStatusRequest()), timeout=10)
        return SCHED_STATUS.decode_reply(reply.data)
    finally:
        await nc.close()


def tensorboard_scalars(directory: Path) -> dict[str, float]:
    """Every scalar's last value, read from the TFRecord event files (length, crc, event, crc)."""
    scalars: dict[str, float] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, position = path.read_bytes(), 0
        while position + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[position:position + 8])
            body = data[position + 12:position + 12 + length]
            if len(body) < length:
                break  # a record still being written
            position += 12 + length + 4
            for value in event_pb2.Event.FromString(body).summary.value:
                scalars[value.tag] = value.simple_value
    return scalars


async def until(check, what: str, timeout_s: float = WAIT_S):
    """Poll ``check()`` (blocking calls run off the loop) until it returns something truthy."""
    async def poll():
        while not (result := await asyncio.to_thread(check)):
            await asyncio.sleep(0.5)
        return result

    try:
        return await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def run_a_little_work(mesh) -> None:
    """A trainer step's group, a typed failure and one sandbox exec; returns when all ended (a
    sampled rollout of the random test model may itself fail, e.g. as ``tokenization_error``)."""
    nc = await nats.connect(mesh.info.nats_url)
    try:
        prefix = "metrics-" + uuid.uuid4().hex[:6]
        ids = [f"{prefix}-{index}" for index in range(2)]
        failing = f"{prefix}-unknown"
        ended: dict[str, str] = {}
        stepped = asyncio.Event()
        all_ended = asyncio.Event()

        async def on_result(msg) -> None:
            body = json.loads(msg.data)
            if body["rollout_id"].startswith(prefix):
                ended[body["rollout_id"]] = body["type"]
                if len(ended) == 3:
                    all_ended.set()

        async def on_step(msg) -> None:
            stepped.set()

        for subject in (ROLLOUT_COMPLETED, ROLLOUT_FAILED):
            await nc.subscribe(subject.format(mesh.namespace), cb=on_result)
        await nc.subscribe(TRAINER_STEPPED.format(mesh.namespace), cb=on_step)
        js = nc.jetstream()
        for rollout_id in ids:
            await js.publish(f"rl.{mesh.namespace}.rollout.requested", json.dumps({
                "rollout_id": rollout_id, "task": "molar_mass", "task_input": {"formula": "H2O"},
                "group_id": f"{prefix}-g", "purpose": "train",
                "sampling": {"temperature": 1.0, "max_new_tokens": 16}}).encode())
        await js.publish(f"rl.{mesh.namespace}.rollout.requested", json.dumps({
            "rollout_id": failing, "task": "no_such_task", "purpose": "eval"}).encode())

        broker = SandboxBrokerClient(BusPublisher(nc, js, mesh.namespace), timeout_s=30.0)
        lease = await broker.lease(f"{prefix}-tool", ttl_s=60.0)
        reply = await broker.exec(lease.lease_id, ["true"])
        assert reply.result == "exit", reply
        await broker.release(lease.lease_id)

        await asyncio.wait_for(all_ended.wait(), WAIT_S)
        assert ended[failing] == "rollout.failed", ended
        await asyncio.wait_for(stepped.wait(), WAIT_S)
    finally:
        await nc.close()


async def test_mesh_metrics_exist_move_and_reach_tensorboard(mesh) -> None:
    url = mesh.info.metrics_url
    assert url.startswith("http://") and url.endswith("/metrics"), mesh.info
    # The hub serves from the start; the actors' first snapshots arrive within a report interval.
    before = await until(lambda: (f := scrape(url)) and catalog.METRICS_SOURCES.name in f and f,
                         "the first snapshots")

    await run_a_little_work(mesh)

    def all_moved():
        after = scrape(url)
        if all(moved_amount(after, spec) > moved_amount(before, spec) for spec in MUST_MOVE):
            return after
        return None

    after = await until(all_moved, "every counter and histogram to move")
    for spec in MUST_EXIST:
        assert after.get(spec.name), f"{spec.name} is missing from {sorted(after)}"

    # Typed reasons, per-worker versions, every queue: the label sets the docs promise.
    failed = {s.labels["kind"] for s in after[catalog.ROLLOUTS_FAILED.name]}
    assert "unknown_task" in failed
    workers = {s.labels["worker"] for s in after[catalog.WEIGHT_VERSION_ACTIVE.name]}
    assert {"prefill-0", "decode-0"} <= workers
    queues = {s.labels["queue"] for s in after[catalog.QUEUE_DEPTH.name]}
    assert {"rollout_requests", "decode", "trainer"} <= queues
    results = {s.labels["result"] for s in after[catalog.SANDBOX_EXEC_DURATION.name]}
    assert "exit" in results
    # The roles that computed in this work report it; the scheduler counts what they hold as
    # busy only in that proportion, so its busy time falls below its allocated time.
    busy_roles = {s.labels["role"] for s in after[catalog.ROLE_BUSY.name] if s.value > 0}
    assert {"prefill", "decode", "trainer"} <= busy_roles, busy_roles
    status = await scheduler_status(mesh)
    # Every role holding accelerators reports (a shared accelerator's fractions are held by one).
    assert set(status.roles) <= set(status.roles_busy), (status.roles, status.roles_busy)
    assert all(0.0 <= fraction <= 1.0 for fraction in status.roles_busy.values())
    assert status.busy_utilization < status.allocated_utilization, status
    # No unbounded ids in labels: no rollout id, lease id or group id anywhere.
    for samples in after.values():
        for sample in samples:
            assert not any("metrics-" in value for value in sample.labels.values()), sample

    tensorboard = Path(mesh.info.run_dir) / "tensorboard"
    # The hub's counters and histograms reach TensorBoard: some write holds at least the scrape's
    # totals of completed rollouts and of trainer steps (both moved in the work; the mesh is
    # shared, so other tests' rollouts count too).
    reached = {
        f"{catalog.ROLLOUTS_COMPLETED.name}/total": moved_amount(after, catalog.ROLLOUTS_COMPLETED),
        f"{catalog.TRAINER_STEP_DURATION.name}/count": moved_amount(after, catalog.TRAINER_STEP_DURATION),
    }

    def tensorboard_reached():
        scalars = tensorboard_scalars(tensorboard)
        return all(scalars.get(tag, 0) >= total for tag, total in reached.items()) and scalars

    scalars = await until(tensorboard_reached, f"TensorBoard scalars reaching {reached}")
    assert any(tag.startswith(catalog.GENERATED_TOKENS.name) for tag in scalars)
