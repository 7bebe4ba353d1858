"""A 3-node JetStream cluster with replicas=3: everything is replicated, and killing one node
mid-run loses no accepted request and writes no effect twice.

Real processes only: three nats-servers from the shipped deploy/nats-cluster/ configs
(tests/support/nats_cluster.py), the project's ActorShell consuming, BusPublisher publishing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import nats.errors
import nats.js.errors
import pytest

from support.nats_cluster import DEPLOY_DIR, LocalNatsCluster
from test_cli import restore_logging_config  # noqa: F401  (autouse: the shell sets up logging)
from rollmesh.actors.shell import ActorShell
from rollmesh.mesh_address import MeshAddress
from rollmesh.bus.connection import connect_bus
from rollmesh.bus.embedded_server import find_nats_server_binary
from rollmesh.bus.errors import PublishError
from rollmesh.bus.publisher import BusPublisher
from rollmesh.bus.streams import (
    StreamLimits,
    dead_letter_stream,
    ensure_streams,
    rollout_requests_stream,
    rollout_state_bucket,
)
from rollmesh.config import NatsConfig, TelemetryConfig
from rollmesh.messages import RolloutRequested
from rollmesh.messages.subjects import ROLLOUT_REQUESTED
from rollmesh.ports import MessageContext, Subscription

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROLLOUTS = 200
# Short, so a message whose ack died with the node comes back within the test's time.
ACK_WAIT_S = 3.0
# Time one rollout's handler works before writing its effect (8 run at once).
WORK_S = 0.05
# Long enough for a leader election (nats-server's raft election timeout is several seconds).
OUTAGE_DEADLINE_S = 45.0


@pytest.fixture
def cluster(tmp_path) -> Iterator[LocalNatsCluster]:
    with LocalNatsCluster(tmp_path / "cluster") as running:
        yield running


@pytest.mark.parametrize("node", ["nats-1.conf", "nats-2.conf", "nats-3.conf"])
def test_shipped_cluster_node_config_is_valid(node):
    checked = subprocess.run([str(find_nats_server_binary()), "-t", "-c", str(DEPLOY_DIR / node)],
                             capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


async def test_streams_and_kv_bucket_get_three_replicas_on_a_cluster(cluster, namespace):
    nc = await connect_bus(cluster.url, name="replica-check", connect_timeout_s=5)
    try:
        js = nc.jetstream()
        limits = StreamLimits(replicas=3)
        # Every actor ensures the streams as it starts, all at once: that must converge here too.
        await asyncio.wait_for(asyncio.gather(*(ensure_streams(js, namespace, limits)
                                                for _ in range(3))), 30)
        names = await asyncio.wait_for(ensure_streams(js, namespace, limits), 30)
        node_names = {node.name for node in cluster.nodes}
        for name in [*names, f"KV_{rollout_state_bucket(namespace)}"]:
            info = await asyncio.wait_for(js.stream_info(name), 10)
            assert info.config.num_replicas == 3, name
            assert info.cluster is not None and info.cluster.leader in node_names, name
            followers = {peer.name for peer in info.cluster.replicas or []}
            assert followers == node_names - {info.cluster.leader}, name
    finally:
        await nc.close()


class RecordingLogic:
    """Consumes rollout requests as a worker does; its one effect is a KV key per rollout.

    The key is written with ``create`` (only if absent), so a redelivery after an ack lost with the
    dead node finds the effect already there and writes nothing: at-least-once delivery, one
    effect per rollout. The write rides out the failover itself: a handler that raised instead
    would burn its delivery attempts in the seconds of an election (each nak comes back after
    ``retry_delay_s``) and be dead-lettered after ``max_deliver``.
    """

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.running = 0  # handlers in flight right now
        self.deliveries: Counter[str] = Counter()
        self.effects: Counter[str] = Counter()  # creates this process saw succeed
        self.found_done: Counter[str] = Counter()  # deliveries that found the effect written
        self.failures: list[str] = []
        self.outage_errors: list[str] = []  # write attempts retried during the failover
        self.effect_times: list[float] = []

    def subscriptions(self) -> list[Subscription]:
        return [Subscription(ROLLOUT_REQUESTED, self.on_requested, "jetstream", max_concurrent=8,
                             ack_wait_s=ACK_WAIT_S, retry_delay_s=0.2)]

    @property
    def done(self) -> set[str]:
        return set(self.effects) | set(self.found_done)

    async def on_requested(self, request: RolloutRequested, ctx: MessageContext) -> None:
        rollout_id = request.rollout_id
        self.deliveries[rollout_id] += 1
        self.running += 1
        try:
            # The rollout's own work, so several are in flight when the node dies.
            await asyncio.sleep(WORK_S)
            await _ride_out_outage(lambda: self.kv.create(
                rollout_id, f"delivery {ctx.delivery_attempt}".encode()), self.outage_errors)
        except nats.js.errors.KeyWrongLastSequenceError:
            self.found_done[rollout_id] += 1
            return
        except Exception as exc:  # the outage: the dispatcher naks and JetStream redelivers
            self.failures.append(repr(exc))
            raise
        finally:
            self.running -= 1
        self.effects[rollout_id] += 1
        self.effect_times.append(time.monotonic())


class CountingJetStream:
    """Passes JetStream calls through; counts publish attempts, their failures and duplicate acks
    (so the test sees retries whether BusPublisher or the test's own loop makes them)."""

    def __init__(self, js: Any) -> None:
        self._js = js
        self.attempts = 0
        self.failures: list[str] = []
        self.duplicates = 0
        self.ack_times: list[float] = []

    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        self.attempts += 1
        try:
            ack = await self._js.publish(*args, **kwargs)
        except Exception as exc:
            self.failures.append(repr(exc))
            raise
        self.duplicates += bool(ack.duplicate)
        self.ack_times.append(time.monotonic())
        return ack

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)


async def test_killing_a_node_mid_run_loses_no_request_and_writes_no_effect_twice(
        cluster, namespace, tmp_path):
    shell = ActorShell("cluster-worker", MeshAddress(
        nats_url=cluster.url, namespace=namespace, run_dir=str(tmp_path / "run"),
        telemetry=TelemetryConfig(exporter="jsonl"), nats=NatsConfig(url=cluster.url, replicas=3)))
    pub_nc = await connect_bus(cluster.url, name="cluster-publisher", connect_timeout_s=5)
    try:
        await shell.connect()  # ensures the streams with NatsConfig.replicas
        js = shell.nats_client.jetstream()
        logic = RecordingLogic(await js.key_value(rollout_state_bucket(namespace)))
        await shell.serve(logic)

        # The victim is the node the consumer is connected to, made leader of the request stream,
        # its consumer and the KV bucket: one kill then forces a client reconnect and three raft
        # elections at once, with messages in flight and acks lost.
        victim = cluster.index_of_port(shell.nats_client.connected_url.port)
        victim_name = cluster.nodes[victim].name
        requests = rollout_requests_stream(namespace)
        kv_stream = f"KV_{rollout_state_bucket(namespace)}"
        durable = logic.subscriptions()[0].durable_name()
        for api, read_leader in [
            (f"STREAM.LEADER.STEPDOWN.{requests}", lambda: js.stream_info(requests)),
            (f"STREAM.LEADER.STEPDOWN.{kv_stream}", lambda: js.stream_info(kv_stream)),
            (f"CONSUMER.LEADER.STEPDOWN.{requests}.{durable}",
             lambda: js.consumer_info(requests, durable)),
        ]:
            await _move_leader(shell.nats_client, api, read_leader, victim_name)

        counting = CountingJetStream(pub_nc.jetstream())
        publisher = BusPublisher(pub_nc, counting,  # type: ignore[arg-type]
                                 namespace, publish_timeout_s=2.0)
        ids = [f"r{i:04d}" for i in range(ROLLOUTS)]
        at_third, killed = asyncio.Event(), asyncio.Event()
        loop_retries: list[str] = []

        async def publish_all() -> None:
            for i, rollout_id in enumerate(ids):
                if i == ROLLOUTS // 3:
                    at_third.set()
                    await killed.wait()  # publish the rest straight into the failover
                await _publish_until_acked(publisher, rollout_id, loop_retries)

        publishing = asyncio.create_task(publish_all())
        try:
            # A third published and a tenth done: the consumer is mid-stream, handlers in flight.
            await asyncio.wait_for(at_third.wait(), 30)
            await _wait_until(lambda: len(logic.done) >= ROLLOUTS // 10, 30,
                              lambda: f"{ROLLOUTS // 10} rollouts done, got {len(logic.done)}")
            in_flight_at_kill, done_at_kill = logic.running, len(logic.done)
            publisher_on_victim = cluster.index_of_port(pub_nc.connected_url.port) == victim
            cluster.kill(victim)
            killed_at = time.monotonic()
            killed.set()
            await asyncio.wait_for(publishing, OUTAGE_DEADLINE_S)
        finally:
            publishing.cancel()
        published_at = time.monotonic()
        await _wait_until(lambda: logic.done == set(ids), OUTAGE_DEADLINE_S,
                          lambda: f"every rollout done; missing {sorted(set(ids) - logic.done)[:9]}"
                                  f", handler failures {logic.failures[-3:]}")
        all_done_at = time.monotonic()

        # Every accepted request was processed and acked (the work queue is empty) ...
        assert logic.done == set(ids)
        await _wait_until_async(lambda: _stream_messages(js, requests), 0, 20, "requests acked")
        # ... each left exactly one surviving effect: N keys, written by exactly N stored puts ...
        kv = await js.key_value(rollout_state_bucket(namespace))
        revisions = [(await kv.get(rollout_id)).revision for rollout_id in ids]
        assert len(set(revisions)) == ROLLOUTS
        kv_state = (await js.stream_info(kv_stream)).state
        assert (kv_state.messages, kv_state.last_seq) == (ROLLOUTS, ROLLOUTS)
        assert max(logic.effects.values()) == 1
        # ... nothing was dead-lettered, and the survivors still hold three-replica streams.
        assert await _stream_messages(js, dead_letter_stream(namespace)) == 0
        info = await js.stream_info(requests)
        assert info.config.num_replicas == 3 and info.cluster.leader != victim_name
        # The failover was felt by the publisher (else this test proved nothing), and every
        # failed attempt was retried until acked: no id is missing from the stream's history.
        assert counting.failures or loop_retries
        # A resend of a publish that had landed was dropped by dedup: each request stored once.
        assert info.state.last_seq == ROLLOUTS
        # Not asserted (timings are not tests): printed for whoever runs this with -s.
        print(json.dumps({
            "victim": victim_name, "publisher_on_victim": publisher_on_victim,
            "in_flight_at_kill": in_flight_at_kill, "done_at_kill": done_at_kill,
            "first_ack_after_kill_s": _first_after(counting.ack_times, killed_at),
            "first_effect_after_kill_s": _first_after(logic.effect_times, killed_at),
            "publishing_done_after_kill_s": round(published_at - killed_at, 2),
            "all_done_after_kill_s": round(all_done_at - killed_at, 2),
            "publish_attempts": counting.attempts, "publish_failures": _kinds(counting.failures),
            "loop_retries": len(loop_retries), "duplicate_acks": counting.duplicates,
            "deliveries": sum(logic.deliveries.values()),
            "found_done": sum(logic.found_done.values()),
            "effect_write_retries": _kinds(logic.outage_errors),
            "reconnects": [shell.nats_client.stats["reconnects"], pub_nc.stats["reconnects"]],
        }))
    finally:
        await shell.stop()
        await pub_nc.close()


async def _publish_until_acked(publisher: BusPublisher, rollout_id: str,
                               loop_retries: list[str]) -> None:
    """The caller's side of at-least-once: a publish that raised is sent again until the stream
    acks it; the dedup id (the rollout id) makes a resend of a publish that did land harmless."""
    deadline = time.monotonic() + OUTAGE_DEADLINE_S
    backoff = 0.05
    while True:
        try:
            await publisher.publish(ROLLOUT_REQUESTED, RolloutRequested(rollout_id=rollout_id,
                                                                        task="cluster-test"))
            return
        except PublishError as exc:
            loop_retries.append(repr(exc))
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(backoff)  # backoff between attempts, not synchronization
        backoff = min(backoff * 2, 0.5)


# What nats-py raises while a node is gone or a raft group is electing its leader. js.publish turns
# "no responders" into NoStreamResponseError; a JetStream API call answers 503 (ServiceUnavailable).
_OUTAGE_ERRORS = (nats.errors.TimeoutError, nats.errors.NoRespondersError,
                  nats.errors.ConnectionReconnectingError, nats.js.errors.NoStreamResponseError,
                  nats.js.errors.ServiceUnavailableError, TimeoutError)


async def _ride_out_outage(operation: Callable[[], Any], errors_seen: list[str]) -> Any:
    deadline = time.monotonic() + OUTAGE_DEADLINE_S
    backoff = 0.05
    while True:
        try:
            return await operation()
        except _OUTAGE_ERRORS as exc:
            errors_seen.append(repr(exc))
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(backoff)  # backoff between attempts, not synchronization
        backoff = min(backoff * 2, 0.5)


def _first_after(times: list[float], start: float) -> float | None:
    later = [t - start for t in times if t > start]
    return round(min(later), 2) if later else None


def _kinds(errors: list[str]) -> dict[str, int]:
    return dict(Counter(error.split("(")[0] for error in errors))


async def _move_leader(nc: Any, api: str, read_leader: Callable[[], Any], preferred: str) -> None:
    """Ask the current leader to step down in favour of ``preferred``; wait until it has."""
    if await _leader(read_leader) == preferred:
        return
    reply = await nc.request(f"$JS.API.{api}",
                             json.dumps({"placement": {"preferred": preferred}}).encode(),
                             timeout=5)
    assert json.loads(reply.data).get("success"), reply.data
    await _wait_until_async(lambda: _leader(read_leader), preferred, 15, f"{api} leader")


async def _leader(read_leader: Callable[[], Any]) -> str | None:
    return (await read_leader()).cluster.leader


async def _stream_messages(js: Any, stream: str, *, attempts: int = 4) -> int:
    # After a node's loss, a stream whose leader it was answers only once a new leader is
    # elected, which on a loaded 2-core machine can outlast one JetStream API timeout (5 s).
    for _ in range(attempts - 1):
        try:
            return (await js.stream_info(stream)).state.messages
        except nats.errors.TimeoutError:
            continue
    return (await js.stream_info(stream)).state.messages


async def _wait_until(condition: Callable[[], bool], timeout_s: float,
                      what: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what()}"
        await asyncio.sleep(0.02)  # polling interval, not synchronization


async def _wait_until_async(read: Callable[[], Any], expected: Any, timeout_s: float,
                            what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = await asyncio.wait_for(read(), 5)
        except (nats.errors.Error, TimeoutError):  # mid-election: ask again
            value = None
        if value == expected:
            return
        assert time.monotonic() < deadline, f"timed out on {what}: {value!r} != {expected!r}"
        await asyncio.sleep(0.05)  # polling interval, not synchronization
