"""Several sandbox brokers (``sandbox.brokers``): where leases go, how a lease's requests find its
broker, and what losing a broker costs. Placement and routing are plain logic, tested without a
bus; two brokers (the fake runtime) on the session's real nats-server show the whole path."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from support.fakes import FakeSandboxBackend, ManualClock

from rollmesh.sandbox.broker_logic import SandboxBrokerLogic
from rollmesh.actors.shell import ActorShell
from rollmesh.mesh_address import MeshAddress
from rollmesh.bus.connection import connect_bus
from rollmesh.bus.permissions import role_permissions
from rollmesh.bus.publisher import BusPublisher
from rollmesh.config import RolloutConfig, SandboxConfig, SandboxProfileConfig, TelemetryConfig
from rollmesh.messages import SandboxLeaseReply, SandboxLeaseRequest, SandboxLoadReported
from rollmesh.messages.rollout import INFRA_FAILURE_KINDS
from rollmesh.messages.subjects import ROLLOUT_REQUESTED, SANDBOX_EXEC, broker_subject
from rollmesh.ports import RequestFailedError
from rollmesh.rollout.rollout_sandbox import RolloutSandbox
from rollmesh.rollout.tool_results import failure_kind
from rollmesh.sandbox import SandboxBroker, SandboxBrokerClient, SandboxRequestError
from rollmesh.sandbox.placement import BrokerDirectory, broker_ids, broker_of
from rollmesh.sandbox_brokers import (
    NoSandboxNodeError,
    TooManySandboxNodesError,
    broker_address,
    broker_name,
    credential_broker_ids,
    plan_brokers,
)


def load(broker: str, leases: int = 0, *, warm: int = 0, max_sandboxes: int = 64) -> SandboxLoadReported:
    return SandboxLoadReported(broker=broker, leases=leases, max_sandboxes=max_sandboxes,
                               warm={"default": warm} if warm else {})


def directory(clock: ManualClock, *peers: SandboxLoadReported) -> BrokerDirectory:
    found = BrokerDirectory("0", report_interval_s=1.0, clock=clock)
    for peer in peers:
        found.heard(peer)
    return found


@pytest.mark.unit
def test_a_lease_goes_to_a_broker_with_a_warm_sandbox_of_its_profile_when_this_one_has_none():
    clock = ManualClock()
    brokers = directory(clock, load("1", 9, warm=0), load("2", 20, warm=1))
    assert brokers.choose("default", load("0", 1, warm=0)) == "2"  # warm beats idle
    brokers.placed("2", "default")  # that warm sandbox is taken until broker 2 reports again
    assert brokers.choose("default", load("0", 1, warm=0)) == "0"
    assert brokers.choose("default", load("0", 1, warm=1)) == "0"  # a warm one here stays here
    assert brokers.choose("gpu", load("0", 1, warm=1)) == "0"  # a profile nobody keeps warm


@pytest.mark.unit
def test_a_lease_moves_only_to_a_broker_that_stays_less_loaded_after_taking_it():
    clock = ManualClock()
    brokers = directory(clock, load("1", 4), load("2", 2))
    assert brokers.choose("default", load("0", 3)) == "0"  # broker 2 would hold 3: no better
    assert brokers.choose("default", load("0", 4)) == "2"
    sent = []
    for _ in range(6):  # a burst between reports: counted against where each went
        target = brokers.choose("default", load("0", 6))
        sent.append(target)
        if target != "0":
            brokers.placed(target, "default")
    assert sent == ["2", "2", "1", "2", "0", "0"]  # ties go to the lower id
    brokers.heard(load("2", 2))  # its next report replaces what was counted
    assert brokers.choose("default", load("0", 6)) == "2"


@pytest.mark.unit
def test_silent_unreachable_and_full_brokers_are_left_out_of_placement():
    clock = ManualClock()
    brokers = directory(clock, load("1", 0), load("2", 0), load("3", 8, max_sandboxes=8))
    assert brokers.live() == ["0", "1", "2", "3"]
    brokers.lost("2")  # a forward found nobody
    assert brokers.live() == ["0", "1", "3"] and brokers.choose("default", load("0", 5)) == "1"
    clock.advance(3.5)  # three report intervals without a word from anyone
    assert brokers.live() == ["0"] and brokers.choose("default", load("0", 5)) == "0"
    brokers.heard(load("3", 8, max_sandboxes=8))
    assert brokers.choose("default", load("0", 5)) == "0"  # broker 3 is full


@pytest.mark.unit
def test_ids_a_broker_makes_name_it_and_its_own_subjects_follow():
    make = broker_ids(lambda: "9f0c", "1")
    assert make() == "1.9f0c" and broker_of("1.9f0c") == "1"
    assert broker_of("9f0c") == "" and broker_of("") == "" and broker_of("1.") == ""
    assert broker_subject(SANDBOX_EXEC, "1").format("ns") == "rl.ns.sandbox.b.1.exec"
    assert broker_subject(SANDBOX_EXEC, "1").reply_type is SANDBOX_EXEC.reply_type
    with pytest.raises(ValueError, match="not a sandbox request"):
        broker_subject(ROLLOUT_REQUESTED, "1")
    with pytest.raises(ValueError, match="invalid sandbox broker id"):
        broker_ids(lambda: "x", "a.b")
    # Brokers may hear each other and hand a lease on; rollout workers reach every broker.
    broker, worker = role_permissions("sandbox_broker", "ns"), role_permissions("rollout_worker", "ns")
    assert {"rl.ns.sandbox.load", "rl.ns.sandbox.b.*.lease"} <= set(broker.publish)
    assert {"rl.ns.sandbox.lease", "rl.ns.sandbox.b.*.exec", "rl.ns.sandbox.load"} <= set(broker.subscribe)
    assert {"rl.ns.sandbox.b.*.exec", "rl.ns.sandbox.b.*.fork"} <= set(worker.publish)
    assert "rl.ns.sandbox.load" not in worker.publish


@pytest.mark.unit
def test_each_of_several_brokers_is_handed_only_its_own_credentials_whose_rights_are_its_own():
    from rollmesh.mesh_address import MeshAddress
    from rollmesh.bus.errors import BusSecurityError
    from rollmesh.bus.security import BusCredentials
    from rollmesh.config import NatsCredentialsConfig

    # Made before Ray lists the nodes: none for one broker, N for a number, the bound for per_node.
    assert credential_broker_ids(SandboxConfig()) == []
    assert credential_broker_ids(SandboxConfig(brokers=3)) == ["0", "1", "2"]
    assert credential_broker_ids(SandboxConfig(brokers="per_node", max_brokers=2)) == ["0", "1"]
    roles = ("mesh", "sandbox_broker", "sandbox_broker_0", "sandbox_broker_1")
    mesh = MeshAddress(namespace="ns", nats_url="nats://x", run_dir="/run", credentials={
        role: BusCredentials(role, "ns", NatsCredentialsConfig(nkey_seed_file=f"/{role}.nk")) for role in roles})
    own = broker_address(mesh, "1").credentials_for("sandbox_broker")
    assert own is not None and own.role == "sandbox_broker_1" and own.inbox_prefix == "_INBOX.ns.sandbox_broker_1"
    assert list(broker_address(mesh, "1").credentials) == ["sandbox_broker"]
    assert broker_address(mesh, "").credentials_for("sandbox_broker").role == "sandbox_broker"  # one broker
    with pytest.raises(BusSecurityError, match="sandbox_broker_2"):  # others have theirs, this one none
        broker_address(mesh, "2")
    shared_only = MeshAddress(namespace="ns", nats_url="nats://x", run_dir="/run", credentials={"sandbox_broker": own})
    assert broker_address(shared_only, "2").credentials == {"sandbox_broker": own}  # a cluster's shared user
    # Broker 1 answers the shared lease subject and its own subjects, writes its own lease keys.
    rights = role_permissions("sandbox_broker_1", "ns")
    assert "rl.ns.sandbox.b.1.exec" in rights.subscribe and "rl.ns.sandbox.lease" in rights.subscribe
    assert not [s for s in rights.subscribe if s.startswith("rl.ns.sandbox.b.") and ".b.1." not in s]
    assert "rl.ns.sandbox.exec" not in rights.subscribe and "rl.ns.sandbox.b.*.lease" in rights.publish
    assert f"$KV.RL_ns_SANDBOX_LEASES.{broker_name(1)}.>" in rights.publish
    assert f"$KV.RL_ns_SANDBOX_LEASES.{broker_name(0)}.>" in role_permissions("sandbox_broker_0", "ns").publish
    assert "$KV.RL_ns_SANDBOX_LEASES.>" not in rights.publish and rights.allow_responses


def node(node_id: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 2.0, **resources}}


@pytest.mark.unit
def test_per_node_brokers_go_to_every_live_node_offering_the_sandbox_resources():
    nodes = [node("c"), node("a", rollmesh_sandbox=1.0), node("b", False, rollmesh_sandbox=1.0),
             node("d", rollmesh_sandbox=2.0)]
    slots = plan_brokers("per_node", nodes, {"rollmesh_sandbox": 1.0})
    assert [(s.name, s.broker_id, s.node_id) for s in slots] == [
        ("sandbox-broker", "0", "a"), ("sandbox-broker-1", "1", "d")]
    assert [s.node_id for s in plan_brokers("per_node", nodes, {})] == ["a", "c", "d"]
    with pytest.raises(NoSandboxNodeError, match="rollmesh_gpu") as none:
        plan_brokers("per_node", nodes, {"rollmesh_gpu": 1.0})
    assert none.value.nodes == 3
    with pytest.raises(TooManySandboxNodesError, match="max_brokers = 1"):
        plan_brokers("per_node", nodes, {"rollmesh_sandbox": 1.0}, max_brokers=1)
    # A number: placed by Ray; one broker runs as it always did, without an id.
    assert [(s.broker_id, s.node_id) for s in plan_brokers(2, nodes, {})] == [("0", ""), ("1", "")]
    assert [(s.name, s.broker_id) for s in plan_brokers(1, nodes, {})] == [("sandbox-broker", "")]


class RecordingRequester:
    """Fakes the bus's request (an edge): records each subject; requests to a broker in ``down``
    find no responder, the others get an empty success reply (a lease: "0.new"). ``timeouts``:
    how long each would have waited."""

    def __init__(self, down: set[str] = frozenset()) -> None:
        self.subjects: list[str] = []
        self.timeouts: list[float] = []
        self.down = down

    async def request(self, subject, message, timeout_s):
        concrete = subject.format("ns")
        self.subjects.append(concrete)
        self.timeouts.append(timeout_s)
        if any(f".b.{broker}." in concrete for broker in self.down):
            raise RequestFailedError(f"no responders on {concrete}")
        return subject.reply_type(lease_id="0.new") if subject.reply_type is SandboxLeaseReply else subject.reply_type()

    async def publish(self, subject, message):
        raise AssertionError("the client only requests")


@pytest.mark.unit
async def test_a_leases_requests_go_to_the_broker_its_id_names():
    requester = RecordingRequester(down={"1"})
    client = SandboxBrokerClient(requester)
    await client.exec("2.abc", ["true"])
    await client.heartbeat("2.abc")
    await client.fork("2.snap", "holder", 1)
    await client.exec("abc", ["true"])  # an id without a broker: the shared subjects
    await client.lease("holder")
    assert requester.subjects == ["rl.ns.sandbox.b.2.exec", "rl.ns.sandbox.b.2.heartbeat",
                                  "rl.ns.sandbox.b.2.fork", "rl.ns.sandbox.exec", "rl.ns.sandbox.lease"]
    # A resumed holder asks its old lease's broker first; that broker gone, the brokers place it.
    requester.subjects.clear()
    assert (await client.lease("holder", held_lease="1.old")).lease_id == "0.new"
    assert requester.subjects == ["rl.ns.sandbox.b.1.lease", "rl.ns.sandbox.lease"]
    async def no_wait(seconds: float) -> None:
        pass

    hasty = SandboxBrokerClient(requester, timeout_s=0.05, sleep=no_wait)  # gives up at once
    with pytest.raises(SandboxRequestError) as lost:
        await hasty.exec("1.old", ["true"], timeout_s=0.05)
    assert lost.value.kind == "unreachable"
    assert failure_kind(lost.value) in INFRA_FAILURE_KINDS  # the rollout retries, typed


@pytest.mark.unit
async def test_a_resumed_holders_old_broker_is_asked_no_longer_than_the_client_timeout():
    # It may be lost with its node and still subscribed until NATS misses its pings: a rollout
    # waiting rollout.sandbox_lease_wait_s there would wait minutes before trying the others.
    requester = RecordingRequester(down={"1"})
    client = SandboxBrokerClient(requester, timeout_s=30.0)
    assert (await client.lease("holder", held_lease="1.old", wait_s=300.0)).lease_id == "0.new"
    assert list(zip(requester.subjects, requester.timeouts)) == [("rl.ns.sandbox.b.1.lease", 30.0),
                                                                 ("rl.ns.sandbox.lease", 300.0)]


class ForwardingPublisher:
    """Fakes the bus (an edge) for a broker's forwards: records each request's subject and
    answers it with ``answer`` (a reply, or an exception to raise); ``timeouts``: how long each
    would have waited."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.subjects: list[str] = []
        self.timeouts: list[float] = []

    async def request(self, subject, message, timeout_s):
        self.subjects.append(subject.format("ns"))
        self.timeouts.append(timeout_s)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    async def publish(self, subject, message):
        pass


@pytest.mark.unit
async def test_a_forwarded_lease_waits_on_the_other_broker_as_long_as_its_requester_does(tmp_path):
    # Given up sooner, the lease would be made here as well while the other broker still makes
    # it: two sandboxes for one rollout. A request without a deadline waits a sandbox start.
    clock = ManualClock()
    config = SandboxConfig(profiles={"default": SandboxProfileConfig(warm_min=0, warm_max=0)})
    broker = SandboxBroker(config, FakeSandboxBackend(), snapshot_dir=tmp_path, clock=clock,
                           new_id=broker_ids(lambda: uuid.uuid4().hex, "0"))
    publisher = ForwardingPublisher(SandboxLeaseReply(lease_id="1.abc", broker="1"))
    service = SandboxBrokerLogic(broker, broker_id="0", publisher=publisher)
    for index in range(4):
        await service._lease_here(SandboxLeaseRequest(holder=f"held-{index}"))
    service.directory.heard(SandboxLoadReported(broker="1", max_sandboxes=1024))  # idle
    await service._placed_lease(SandboxLeaseRequest(holder="patient", deadline=clock() + 300.0), None)
    await service._placed_lease(SandboxLeaseRequest(holder="old-client"), None)
    assert publisher.subjects == ["rl.ns.sandbox.b.1.lease"] * 2
    assert publisher.timeouts == [300.0, config.start_timeout_s]


@pytest.mark.unit
@pytest.mark.parametrize("answer", [
    SandboxLeaseReply(lease_id="1.abc", broker="1"),
    SandboxLeaseReply(error_kind="capacity", error="full"),
    RequestFailedError("no responders"),
], ids=["taken", "full", "gone"])
async def test_a_broker_forwards_a_lease_once_and_serves_it_itself_when_the_other_cannot(answer, tmp_path):
    config = SandboxConfig(profiles={"default": SandboxProfileConfig(warm_min=0, warm_max=0)})
    broker = SandboxBroker(config, FakeSandboxBackend(), snapshot_dir=tmp_path,
                           new_id=broker_ids(lambda: uuid.uuid4().hex, "0"))
    publisher = ForwardingPublisher(answer)
    service = SandboxBrokerLogic(broker, broker_id="0", publisher=publisher)
    for index in range(3):
        await service._lease_here(SandboxLeaseRequest(holder=f"held-{index}"))
    service.directory.heard(SandboxLoadReported(broker="1", max_sandboxes=1024))  # idle
    reply = await service._placed_lease(SandboxLeaseRequest(holder="next"), None)
    assert publisher.subjects == ["rl.ns.sandbox.b.1.lease"]  # forwarded once, to its own subject
    if isinstance(answer, SandboxLeaseReply) and not answer.error_kind:
        assert reply == answer and service.forwarded == 1
    else:
        assert reply.broker == "0" and broker_of(reply.lease_id) == "0" and service.forwarded == 0
        # A broker nobody answered for is left out until it reports again; a full one is not.
        assert ("1" in service.directory.live()) is isinstance(answer, SandboxLeaseReply)
        publisher.subjects.clear()  # its retry stays with the lease, whatever the reports say
        again = await service._placed_lease(SandboxLeaseRequest(holder="next"), None)
        assert again.lease_id == reply.lease_id and publisher.subjects == []
    await broker.close()


# -- two brokers on the session's nats-server -----------------------------------------------

WAIT_S = 10.0


async def _until(check, timeout_s: float = WAIT_S) -> None:
    """For broker state no event announces (load reports heard)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def two_brokers(nats_server, namespace, tmp_path, trace_file):
    """Brokers "0" and "1" (fake runtimes, no warm pools, fast timers), each in its own shell."""
    config = SandboxConfig(profiles={"default": SandboxProfileConfig(warm_min=0, warm_max=0)},
                           reap_interval_s=0.05, pool_interval_s=0.05)
    shells, services = [], []
    for broker_id in ("0", "1"):
        shell = ActorShell(f"sandbox-broker-{broker_id}", MeshAddress(
            nats_url=nats_server.url, namespace=namespace, run_dir=str(tmp_path), telemetry=TelemetryConfig(exporter="jsonl")))
        publisher = await shell.connect()
        shared = shell.stores.sandbox_snapshots(ttl_s=config.snapshot_ttl_s)
        broker = SandboxBroker(config, FakeSandboxBackend(), snapshot_dir=tmp_path / broker_id,
                               publisher=publisher, new_id=broker_ids(lambda: uuid.uuid4().hex, broker_id),
                               shared_snapshots=shared)
        service = SandboxBrokerLogic(broker, broker_id=broker_id, publisher=publisher)
        await shell.serve(service)
        shells.append(shell)
        services.append(service)
    nc = await connect_bus(nats_server.url, name="sandbox-client", connect_timeout_s=5)
    bus = BusPublisher(nc, nc.jetstream(), namespace)
    yield services, shells, SandboxBrokerClient(bus, timeout_s=WAIT_S), bus
    await nc.close()
    for shell in shells:
        await shell.stop()


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_leases_spread_over_two_brokers_and_losing_one_costs_only_its_leases(two_brokers):
    services, shells, client, bus = two_brokers
    await _until(lambda: all(len(service.directory.live()) == 2 for service in services))  # heard each other
    leases = [await client.lease(f"rollout-{index}", ttl_s=30.0) for index in range(8)]
    held = {broker_id: [lease for lease in leases if broker_of(lease.lease_id) == broker_id] for broker_id in "01"}
    assert all(lease.broker == broker_of(lease.lease_id) for lease in leases)
    assert abs(len(held["0"]) - len(held["1"])) <= 2, {b: len(ls) for b, ls in held.items()}
    assert [service.broker.stats().active_leases for service in services] == [len(held["0"]), len(held["1"])]
    for lease in leases:  # each lease's exec reaches the broker holding it
        assert (await client.exec(lease.lease_id, shell="echo hi")).stdout == b"hi\n"
    await client.upload(held["1"][0].lease_id, "results/turn.txt", b"turn 3")
    snapshot = (await client.snapshot(held["1"][0].lease_id)).snapshot_id
    assert broker_of(snapshot) == "1"

    await shells[1].stop()  # broker 1 is gone, with its sandboxes
    for lease in held["0"]:  # nothing is lost on broker 0
        assert (await client.exec(lease.lease_id, shell="echo still")).stdout == b"still\n"
    # An exec keeps asking for as long as it would wait for its reply (a restarting broker comes
    # back under its id): a short one.
    with pytest.raises(SandboxRequestError) as lost:
        await SandboxBrokerClient(bus, timeout_s=0.5).exec(held["1"][0].lease_id, ["true"], timeout_s=0.5)
    assert lost.value.kind == "unreachable" and failure_kind(lost.value) in INFRA_FAILURE_KINDS
    # The rollout's own path: its old broker is gone, so a lease on the broker left, whatever
    # placement last heard of broker 1, forked from the snapshot broker 1 took (the shared copy).
    rollout = RolloutSandbox(client, RolloutConfig())
    holder = f"rollout-{leases.index(held['1'][0])}"
    resumed = await rollout.lease(holder, held=held["1"][0].lease_id, snapshot_id=snapshot, turn=3)
    assert broker_of(resumed) == "0"
    assert await client.download(resumed, "results/turn.txt") == b"turn 3"
    assert services[0].broker.counts["forks_from_shared_store"] == 1
    fresh = [await client.lease(f"new-{index}", ttl_s=30.0) for index in range(3)]
    assert {lease.broker for lease in fresh} == {"0"}
