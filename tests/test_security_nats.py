"""Least-privilege NATS against a real nats-server started with the role permission table.

Each test module starts its own server (the session's is open) with one generated nkey per role,
as the embedded server does under ``security.enabled``; the "mesh" user creates the streams.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import stat
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from support.nats_jwt import OperatorMode

from rollmesh.bus.connection import connect_bus, flush_to_server
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.bus.errors import BusConnectError, BusSecurityError
from rollmesh.bus.permissions import ROLES, ServerUser, render_authorization, role_permissions
from rollmesh.bus.security import BusCredentials, GeneratedCredentials, generate_role_nkeys
from rollmesh.bus.streams import ensure_streams
from rollmesh.bus.sandbox_snapshots import ObjectStoreSandboxSnapshots
from rollmesh.bus.trajectory_store import ObjectStoreTrajectories
from rollmesh.config import NatsCredentialsConfig
from rollmesh.messages import TokenTrace
from rollmesh.messages.sandbox import SandboxLimitsSpec, SandboxSnapshotRecord
from rollmesh.messages.subjects import ALL_SUBJECTS
from rollmesh.ports import StateStoreError

pytestmark = pytest.mark.timeout(60)

NAMESPACE = "sec" + uuid.uuid4().hex[:8]
PASSWORD = "pw-" + uuid.uuid4().hex


@dataclass
class SecuredBus:
    server: EmbeddedNatsServer
    generated: GeneratedCredentials

    def credentials(self, role: str) -> BusCredentials:
        return self.generated.credentials[role]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredBus]:
    run_dir = tmp_path_factory.mktemp("secured-run")
    # Two sandbox brokers with users of their own, as with sandbox.brokers = 2.
    generated = generate_role_nkeys(run_dir, NAMESPACE, sandbox_brokers=("0", "1"))
    # One more client, by user name and password, to cover that kind of credentials too.
    users = [*generated.users, ServerUser("client", user="alice", password=PASSWORD)]
    server = EmbeddedNatsServer(run_dir / "nats", auth_config=render_authorization(users, NAMESPACE))
    server.start()
    yield SecuredBus(server, generated)
    server.stop()


@pytest_asyncio.fixture(scope="module")
async def streams(secured: SecuredBus) -> None:
    nc = await connect_bus(secured.server.url, name="mesh", credentials=secured.credentials("mesh"))
    try:
        await ensure_streams(nc.jetstream(), NAMESPACE)
    finally:
        await nc.close()


class Violations:
    """The errors the server reports on a connection (nats-py's error callback)."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.arrived = asyncio.Event()

    async def record(self, exc: Exception) -> None:
        self.errors.append(str(exc))
        self.arrived.set()


async def connect_as(secured: SecuredBus, role: str, violations: Violations) -> nats.NATS:
    return await nats.connect(secured.server.url, error_cb=violations.record, allow_reconnect=False,
                              **secured.credentials(role).connect_options())


@dataclass
class Seen:
    subjects: list[str]
    sentinel: asyncio.Event


async def watch_everything(nc: nats.NATS, sentinel_subject: str) -> Seen:
    seen = Seen([], asyncio.Event())

    async def on_message(msg) -> None:
        seen.subjects.append(msg.subject)
        if msg.subject == sentinel_subject:
            seen.sentinel.set()

    await nc.subscribe(f"rl.{NAMESPACE}.>", cb=on_message)
    await flush_to_server(nc)
    return seen


@pytest.mark.integration
async def test_a_role_publishing_outside_its_permissions_gets_a_violation_and_nothing_is_delivered(
    secured: SecuredBus,
) -> None:
    watcher = await connect_bus(secured.server.url, name="watcher", credentials=secured.credentials("mesh"))
    violations = Violations()
    inference = await connect_as(secured, "inference", violations)
    forbidden = f"rl.{NAMESPACE}.rollout.completed"
    allowed = f"rl.{NAMESPACE}.weights.activated"
    try:
        seen = await watch_everything(watcher, allowed)
        await inference.publish(forbidden, b"forged result")
        # Messages of one publisher arrive in order: once the allowed one is in, the forbidden one
        # would have been too.
        await inference.publish(allowed, b"x")
        await flush_to_server(inference)
        await asyncio.wait_for(seen.sentinel.wait(), 10)
        await asyncio.wait_for(violations.arrived.wait(), 10)
    finally:
        await inference.close()
        await watcher.close()
    assert seen.subjects == [allowed]
    assert any("permissions violation" in error.lower() and forbidden in error
               for error in violations.errors), violations.errors


@pytest.mark.integration
async def test_a_role_cannot_subscribe_to_another_roles_subjects(secured: SecuredBus) -> None:
    violations = Violations()
    resharder = await connect_as(secured, "resharder", violations)
    try:
        await resharder.subscribe(f"rl.{NAMESPACE}.sandbox.exec")
        await flush_to_server(resharder)
        await asyncio.wait_for(violations.arrived.wait(), 10)
    finally:
        await resharder.close()
    assert any("permissions violation for subscription" in e.lower() for e in violations.errors)


@pytest.mark.integration
async def test_a_sandbox_broker_of_several_serves_its_own_subjects_and_not_another_brokers(
    secured: SecuredBus,
) -> None:
    violations = Violations()
    broker = await connect_as(secured, "sandbox_broker_0", violations)
    worker = await connect_bus(secured.server.url, name="worker", credentials=secured.credentials("rollout_worker"))
    own, other = f"rl.{NAMESPACE}.sandbox.b.0.exec", f"rl.{NAMESPACE}.sandbox.b.1.exec"
    other_leases = f"$KV.RL_{NAMESPACE}_SANDBOX_LEASES.sandbox-broker-1.forged"

    async def serve(msg) -> None:
        await msg.respond(b"ran " + msg.data)

    try:
        await broker.subscribe(own, cb=serve)
        await flush_to_server(broker)
        reply = await worker.request(own, b"true", timeout=10)
        await broker.subscribe(other)
        await broker.publish(other_leases, b"x")  # another broker's lease-table keys
        await flush_to_server(broker)
        while len(violations.errors) < 2:
            violations.arrived.clear()
            await asyncio.wait_for(violations.arrived.wait(), 10)
    finally:
        await broker.close()
        await worker.close()
    assert reply.data == b"ran true"
    assert any("permissions violation for subscription" in e.lower() and other in e for e in violations.errors)
    assert any("permissions violation for publish" in e.lower() and other_leases.lower() in e.lower() for e in violations.errors), \
        violations.errors


@pytest.mark.integration
async def test_a_client_publishes_rollout_requests_and_nothing_else(secured: SecuredBus, streams: None) -> None:
    violations = Violations()
    client = await connect_as(secured, "client", violations)
    watcher = await connect_bus(secured.server.url, name="watcher", credentials=secured.credentials("mesh"))
    request = {"rollout_id": "r-" + uuid.uuid4().hex[:6], "task": "molar_mass"}
    try:
        seen = await watch_everything(watcher, f"rl.{NAMESPACE}.rollout.requested")
        # A durable, acked JetStream publish: the reply comes back through the client's inbox.
        ack = await client.jetstream().publish(f"rl.{NAMESPACE}.rollout.requested",
                                               json.dumps(request).encode(), timeout=5)
        await asyncio.wait_for(seen.sentinel.wait(), 10)
        await client.publish(f"rl.{NAMESPACE}.weights.published", b"forged weights")
        await client.subscribe(f"rl.{NAMESPACE}.sandbox.exec")
        await flush_to_server(client)
        while len(violations.errors) < 2:
            violations.arrived.clear()
            await asyncio.wait_for(violations.arrived.wait(), 10)
    finally:
        await client.close()
        await watcher.close()
    assert ack.stream == f"RL_{NAMESPACE}_ROLLOUT_REQUESTS" and ack.seq >= 1
    assert f"rl.{NAMESPACE}.weights.published" not in seen.subjects
    assert len(violations.errors) == 2


@pytest.mark.integration
async def test_a_long_trajectory_is_stored_by_a_rollout_worker_and_read_not_written_by_the_trainer_and_a_client(
    secured: SecuredBus, streams: None,
) -> None:
    roles = ("rollout_worker", "trainer", "client")
    connections = {role: await connect_bus(secured.server.url, name=role, credentials=secured.credentials(role))
                   for role in roles}
    trace = TokenTrace.forced([index % 250 for index in range(50_000)])  # several object-store chunks
    try:
        ref = await ObjectStoreTrajectories(connections["rollout_worker"].jetstream(), NAMESPACE).save(
            "r-long", "completed", trace)
        for reader in ("trainer", "client"):
            assert await ObjectStoreTrajectories(connections[reader].jetstream(), NAMESPACE).load(ref) == trace
        trainer_store = ObjectStoreTrajectories(connections["trainer"].jetstream(), NAMESPACE, outage_retry_s=0.0)
        with pytest.raises(StateStoreError):
            await trainer_store.save("r-forged", "completed", trace)
    finally:
        for nc in connections.values():
            await nc.close()


@pytest.mark.integration
async def test_any_sandbox_broker_reads_and_deletes_a_snapshot_another_broker_stored(
    secured: SecuredBus,
) -> None:
    roles = ("sandbox_broker_0", "sandbox_broker_1")
    connections = {role: await connect_bus(secured.server.url, name=role, credentials=secured.credentials(role))
                   for role in roles}
    data = bytes(range(256)) * 1200  # several object-store chunks
    record = SandboxSnapshotRecord(snapshot_id="0.snap", size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                                   profile="default", limits=SandboxLimitsSpec(), network=False)
    try:
        taker, other = (ObjectStoreSandboxSnapshots(connections[role].jetstream(), NAMESPACE, ttl_s=600.0)
                        for role in roles)
        await taker.put(record, data)
        assert await other.get("0.snap") == (record, data)  # its broker lost, another forks it
        await other.delete("0.snap")
        assert await taker.get("0.snap") is None
    finally:
        for nc in connections.values():
            await nc.close()


@pytest.mark.integration
async def test_a_client_reads_results_with_user_and_password_from_the_environment(
    secured: SecuredBus, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROLLMESH_TEST_NATS_PASSWORD", PASSWORD)
    credentials = BusCredentials("client", NAMESPACE, NatsCredentialsConfig(
        user="alice", password_env="ROLLMESH_TEST_NATS_PASSWORD"))
    client = await connect_bus(secured.server.url, name="alice", credentials=credentials)
    worker = await connect_bus(secured.server.url, name="worker", credentials=secured.credentials("rollout_worker"))
    got = asyncio.Event()
    try:
        await client.subscribe(f"rl.{NAMESPACE}.rollout.progressed", cb=_setter(got))
        await flush_to_server(client)
        await worker.publish(f"rl.{NAMESPACE}.rollout.progressed", b"{}")
        await flush_to_server(worker)
        await asyncio.wait_for(got.wait(), 10)
    finally:
        await client.close()
        await worker.close()


def _setter(event: asyncio.Event):
    async def on_message(msg) -> None:
        event.set()

    return on_message


@pytest.mark.integration
async def test_a_client_without_credentials_is_refused(secured: SecuredBus) -> None:
    with pytest.raises(BusConnectError, match="(?i)authorization"):
        await asyncio.wait_for(connect_bus(secured.server.url, name="anonymous", connect_timeout_s=2), 20)


@pytest.mark.integration
async def test_a_wrong_password_is_refused_and_never_shown(
    secured: SecuredBus, monkeypatch: pytest.MonkeyPatch,
) -> None:
    wrong = "not-" + PASSWORD
    monkeypatch.setenv("ROLLMESH_TEST_WRONG_PASSWORD", wrong)
    credentials = BusCredentials("client", NAMESPACE, NatsCredentialsConfig(
        user="alice", password_env="ROLLMESH_TEST_WRONG_PASSWORD"))
    with pytest.raises(BusConnectError, match="(?i)authorization") as raised:
        await asyncio.wait_for(connect_bus(secured.server.url, name="alice", connect_timeout_s=2,
                                           credentials=credentials), 20)
    assert wrong not in str(raised.value)


@pytest.mark.integration
def test_generated_keys_are_owner_only(secured: SecuredBus) -> None:
    for credentials in secured.generated.credentials.values():
        path = Path(credentials.source.nkey_seed_file)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text().startswith("SU")  # a user seed
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


@pytest.mark.unit
def test_missing_secrets_are_clear_errors_naming_the_variable_not_a_value() -> None:
    credentials = BusCredentials("trainer", NAMESPACE, NatsCredentialsConfig(
        user="t", password_env="ROLLMESH_NO_SUCH_VARIABLE"))
    with pytest.raises(BusSecurityError, match="ROLLMESH_NO_SUCH_VARIABLE"):
        credentials.connect_options(environ={})
    missing_file = BusCredentials("trainer", NAMESPACE, NatsCredentialsConfig(creds_file="/nonexistent.creds"))
    with pytest.raises(BusSecurityError, match="does not exist"):
        missing_file.connect_options()


@pytest.mark.unit
def test_every_subject_has_a_publisher_and_each_role_its_own_inbox() -> None:
    tables = {role: role_permissions(role, NAMESPACE) for role in ROLES}
    actor_publish = {s for role, t in tables.items() if role != "mesh" for s in t.publish}
    # Published from outside the mesh (other RL runs announce demand), or by the client.
    external = {"rl.{ns}.sched.demand", "rl.{ns}.sched.run_registered", "rl.{ns}.sched.sim_submitted"}
    for subject in ALL_SUBJECTS:
        if subject.template not in external:
            assert subject.format(NAMESPACE) in actor_publish, subject.template
    inboxes = [next(s for s in t.subscribe if s.startswith("_INBOX.")) for t in tables.values()]
    assert len(set(inboxes)) == len(ROLES)
    # Of the mesh's subjects a client publishes rollout requests, and dead letters of what its
    # watcher cannot read (the rest is reading the trajectories object store: JetStream API
    # requests).
    assert [s for s in tables["client"].publish if s.startswith("rl.")] == [
        f"rl.{NAMESPACE}.rollout.requested", f"rl.{NAMESPACE}.dlq"]


@pytest.mark.integration
def test_logged_credentials_are_redacted(secured: SecuredBus) -> None:
    from rollmesh.telemetry.redaction import REDACTED, redact_value

    seed = Path(secured.credentials("trainer").source.nkey_seed_file).read_text().strip()
    logged = redact_value({"error": f"bad seed {seed} for trainer", "nkey_seed": seed,
                           "password": PASSWORD, "url": f"nats://alice:{PASSWORD}@127.0.0.1:4222"})
    assert seed not in str(logged) and PASSWORD not in str(logged)
    assert logged["nkey_seed"] == logged["password"] == REDACTED
    assert repr(secured.credentials("trainer")).count(seed) == 0  # what travels: a path, no secret


@pytest.mark.integration
async def test_a_role_connects_with_a_creds_file_to_an_operator_mode_server_and_keeps_to_its_rights(tmp_path):
    operator = OperatorMode()
    server = EmbeddedNatsServer(tmp_path / "nats", auth_config=operator.server_config())
    server.start()
    creds = operator.write_creds(tmp_path / "client.creds", "client",
                                 role_permissions("client", NAMESPACE).as_jwt_permissions())
    watcher_creds = operator.write_creds(tmp_path / "watcher.creds", "watcher", {})  # no limits
    violations = Violations()
    try:
        credentials = BusCredentials("client", NAMESPACE, NatsCredentialsConfig(creds_file=str(creds)))
        client = await nats.connect(server.url, error_cb=violations.record, allow_reconnect=False,
                                    **credentials.connect_options())
        watcher = await nats.connect(server.url, user_credentials=str(watcher_creds), allow_reconnect=False)
        try:
            seen = await watch_everything(watcher, f"rl.{NAMESPACE}.rollout.requested")
            await client.publish(f"rl.{NAMESPACE}.weights.published", b"forged weights")
            await client.publish(f"rl.{NAMESPACE}.rollout.requested", b"{}")
            await flush_to_server(client)
            await asyncio.wait_for(seen.sentinel.wait(), 10)
            await asyncio.wait_for(violations.arrived.wait(), 10)
        finally:
            await client.close()
            await watcher.close()
        with pytest.raises(BusConnectError):  # no .creds: an operator-mode server knows no one
            await connect_bus(server.url, name="anonymous", connect_timeout_s=2)
    finally:
        server.stop()
    assert f"rl.{NAMESPACE}.weights.published" not in seen.subjects
    assert any("permissions violation" in error.lower() for error in violations.errors), violations.errors
