"""The sandbox broker served over the session's real nats-server (the runtime is the fake one):
lease, streamed exec, a transfer larger than one message, heartbeat and release, bad bytes,
reaping by the broker's own timer, and a lease whose client stopped waiting."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import pytest
from support.fakes import FakeSandboxBackend

from rollmesh.sandbox.broker_logic import SandboxBrokerLogic
from rollmesh.actors.shell import ActorShell
from rollmesh.mesh_address import MeshAddress
from rollmesh.bus.connection import connect_bus, flush_to_server
from rollmesh.bus.publisher import BusPublisher
from rollmesh.config import SandboxConfig, SandboxProfileConfig, TelemetryConfig
from rollmesh.messages.subjects import SANDBOX_EXEC, SANDBOX_LEASE, SANDBOX_OUTPUT
from rollmesh.sandbox import SandboxBroker, SandboxBrokerClient, SandboxRequestError
from rollmesh.sandbox.sandbox_protocol import ExecOutcome

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

WAIT_S = 10.0


@pytest.fixture
async def served(nats_server, namespace, tmp_path, trace_file):
    """A broker with one warm sandbox and fast timers, served by an ActorShell; and a client."""
    backend = FakeSandboxBackend()
    config = SandboxConfig(profiles={"default": SandboxProfileConfig(warm_min=1)},
                           reap_interval_s=0.05, pool_interval_s=0.05)
    shell = ActorShell("sandbox-broker-test", MeshAddress(nats_url=nats_server.url, namespace=namespace,
                                                          run_dir=str(tmp_path), telemetry=TelemetryConfig(exporter="jsonl")))
    publisher = await shell.connect()
    broker = SandboxBroker(config, backend, snapshot_dir=tmp_path / "snapshots", publisher=publisher)
    await shell.serve(SandboxBrokerLogic(broker))
    nc = await connect_bus(nats_server.url, name="sandbox-client", connect_timeout_s=5)
    client = SandboxBrokerClient(BusPublisher(nc, nc.jetstream(), namespace), timeout_s=WAIT_S)
    yield broker, backend, client, nc
    await nc.close()
    await shell.stop()
    assert backend.live() == []  # stopping the broker destroyed every sandbox


async def _until(check, timeout_s: float = WAIT_S) -> None:
    """For broker state that no event announces (a timer's effect)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_lease_exec_streamed_transfer_heartbeat_and_release_over_nats(served, namespace):
    broker, backend, client, nc = served
    await _until(lambda: broker.stats().warm_sandboxes.get("default") == 1)
    lease = await client.lease("rollout-1", ttl_s=30.0)
    assert lease.warm and lease.limits.memory_mb == 2048

    chunks = []

    async def on_chunk(msg) -> None:
        chunks.append(SANDBOX_OUTPUT.decode(msg.data))

    subscription = await nc.subscribe(SANDBOX_OUTPUT.format(namespace), cb=on_chunk)
    backend.outcomes.append(ExecOutcome("exit", 3, None, False, b"line 1\nline 2\n", b"oops\n", 0.2))
    reply = await client.exec(lease.lease_id, shell="make", exec_id="e-7", stream_output=True)
    await flush_to_server(nc)
    await subscription.unsubscribe()
    assert (reply.result, reply.exit_code, reply.stdout, reply.stderr) == ("exit", 3, b"line 1\nline 2\n", b"oops\n")
    assert [(c.exec_id, c.stream, c.data) for c in chunks] == [
        ("e-7", "stdout", b"line 1\n"), ("e-7", "stdout", b"line 2\n"), ("e-7", "stderr", b"oops\n")]

    big = os.urandom(6 * 1024 * 1024)  # above sandbox.bulk_threshold_bytes: over the bulk stream
    assert (await client.upload(lease.lease_id, "data/big.bin", big)).complete
    assert await client.download(lease.lease_id, "data/big.bin") == big
    assert (broker.counts["bulk_uploads"], broker.counts["bulk_downloads"]) == (1, 1)
    # Without the bulk stream, larger than one chunk: goes up and down over NATS in two.
    over_nats = SandboxBrokerClient(BusPublisher(nc, nc.jetstream(), namespace), timeout_s=WAIT_S,
                                    bulk_threshold_bytes=None)
    assert (await over_nats.upload(lease.lease_id, "data/big2.bin", big)).complete
    assert await over_nats.download(lease.lease_id, "data/big2.bin") == big
    assert broker.counts["uploads"] == 2 and broker.counts["bulk_uploads"] == 1

    assert await client.heartbeat(lease.lease_id) > time.time() + 29
    await client.release(lease.lease_id)
    with pytest.raises(SandboxRequestError) as gone:
        await client.exec(lease.lease_id, ["true"])
    assert gone.value.kind == "unknown_lease"
    assert backend.created[0].destroyed


async def test_undecodable_requests_get_a_typed_reply_and_the_broker_keeps_serving(served, namespace):
    broker, _, client, nc = served
    for subject in (SANDBOX_LEASE, SANDBOX_EXEC):
        raw = await nc.request(subject.format(namespace), b"\x93not msgpack", timeout=WAIT_S)
        assert subject.decode_reply(raw.data).error_kind == "invalid_request"
    assert (await client.lease("still-serving")).lease_id


async def test_a_holder_that_stops_heartbeating_loses_its_sandbox_to_the_reaper(served):
    broker, backend, client, _ = served
    lease = await client.lease("dies-silently", ttl_s=0.2)
    await _until(lambda: broker.stats().active_leases == 0)
    assert broker.stats().counts["leases_expired"] == 1
    assert sum(sandbox.destroyed for sandbox in backend.created) == 1
    with pytest.raises(SandboxRequestError) as reaped:
        await client.heartbeat(lease.lease_id)
    assert reaped.value.kind == "unknown_lease"


async def test_a_lease_whose_client_gave_up_waiting_is_not_left_held_for_nobody(served):
    # Creation slower than the client waits (a loaded host): the client's request times out,
    # the broker's creation goes on and ends past the request's deadline; nobody holds the lease.
    broker, backend, client, _ = served
    await _until(lambda: broker.stats().warm_sandboxes.get("default") == 1)
    backend.create_gate = asyncio.Event()
    assert (await client.lease("takes-the-warm-one")).warm
    with pytest.raises(SandboxRequestError) as gave_up:
        await client.lease("waits-too-little", wait_s=1.0)
    assert gave_up.value.kind == "unreachable"
    backend.create_gate.set()
    await _until(lambda: broker.counts["leases_abandoned"] + broker.counts["lease_requests_dropped"] == 1)
    assert not broker.holds("waits-too-little") and broker.stats().active_leases == 1
    assert (await client.lease("waits-too-little")).lease_id  # its retry, waiting long enough, gets one


@pytest.fixture
async def bwrap_served(nats_server, namespace, tmp_path, trace_file):
    """The broker over NATS with the real bubblewrap runtime (skipped where bwrap cannot run)."""
    from rollmesh.sandbox.bwrap_backend import BwrapBackend
    from rollmesh.sandbox.errors import BackendUnavailableError

    try:
        backend = BwrapBackend()
        await asyncio.to_thread(backend.self_test)
    except BackendUnavailableError as exc:
        pytest.skip(f"bubblewrap unusable here: {exc}")
    config = SandboxConfig(profiles={"default": SandboxProfileConfig(warm_min=1, warm_max=2)},
                           reap_interval_s=0.05, pool_interval_s=0.05)
    shell = ActorShell("sandbox-broker-bwrap", MeshAddress(nats_url=nats_server.url, namespace=namespace,
                                                           run_dir=str(tmp_path), telemetry=TelemetryConfig(exporter="jsonl")))
    publisher = await shell.connect()
    broker = SandboxBroker(config, backend, snapshot_dir=tmp_path / "snapshots", publisher=publisher)
    await shell.serve(SandboxBrokerLogic(broker))
    nc = await connect_bus(nats_server.url, name="sandbox-client", connect_timeout_s=5)
    yield broker, SandboxBrokerClient(BusPublisher(nc, nc.jetstream(), namespace), timeout_s=WAIT_S)
    await nc.close()
    await shell.stop()
    assert broker.stats().active_leases == 0


async def test_the_real_runtime_behind_the_broker_types_results_and_moves_snapshots(bwrap_served):
    broker, client = bwrap_served
    await _until(lambda: broker.stats().warm_sandboxes.get("default") == 1)
    lease = await client.lease("rollout-real", ttl_s=30.0)
    assert lease.warm and lease.backend == "bwrap" and lease.isolated

    ran = await client.exec(lease.lease_id, shell="echo out; echo err >&2; exit 7")
    assert (ran.result, ran.exit_code, ran.stdout, ran.stderr) == ("exit", 7, b"out\n", b"err\n")
    slow = await client.exec(lease.lease_id, ["sleep", "30"], timeout_s=0.3)
    assert (slow.result, slow.exit_code) == ("timeout", None)

    data = os.urandom(5 * 1024 * 1024 + 7)  # two chunks
    assert (await client.upload(lease.lease_id, "in/data.bin", data)).complete
    checked = await client.exec(lease.lease_id, ["sha256sum", "in/data.bin"])
    assert checked.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    assert await client.download(lease.lease_id, "in/data.bin") == data

    snapshot = await client.snapshot(lease.lease_id)
    (fork,) = await client.fork(snapshot.snapshot_id, "branch", 1)
    await client.exec(lease.lease_id, ["rm", "in/data.bin"])  # the fork keeps its own copy
    in_fork = await client.exec(fork.lease_id, ["wc", "-c", "in/data.bin"])
    assert in_fork.stdout.split()[0] == str(len(data)).encode()

    escaped = await client.exec(fork.lease_id, shell="cat /workspace/../etc/shadow; ls /root")
    assert escaped.result == "exit" and escaped.exit_code != 0
    with pytest.raises(SandboxRequestError) as outside:
        await client.upload(fork.lease_id, "../escape", b"x")
    assert outside.value.kind == "path_error"

    for lease_id in (lease.lease_id, fork.lease_id):
        await client.release(lease_id)
