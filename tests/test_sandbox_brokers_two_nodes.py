"""Sandbox brokers on two Ray nodes on loopback (``sandbox.brokers = "per_node"``), as the cluster
test runs its nodes (tests/test_cluster_two_nodes.py's ``ray start`` helpers): a broker on each
node, leases spread over both, and a node SIGKILLed as a machine loss. Nothing on the other node
is lost; the lost node's leases fail typed, and a rollout holding one resumes on the other broker.

The brokers are spawned by tests/support/cluster_brokers.py, a driver joined to this cluster (the pytest
process has its own Ray); this process talks to them over the session's nats-server only.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from test_cluster_two_nodes import REPO_ROOT, TESTS_DIR, RayNode, _ancestors, _node_ports, _ray_worker_titles
from support.nats_cluster import free_ports

from rollmesh.bus.connection import connect_bus
from rollmesh.bus.publisher import BusPublisher
from rollmesh.config import RolloutConfig
from rollmesh.messages.rollout import INFRA_FAILURE_KINDS
from rollmesh.messages.subjects import SANDBOX_LOAD
from rollmesh.rollout.rollout_sandbox import RolloutSandbox
from rollmesh.rollout.tool_results import failure_kind
from rollmesh.sandbox import SandboxBrokerClient, SandboxRequestError
from rollmesh.sandbox.placement import broker_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SANDBOX_NODE = {"rollmesh_sandbox": 1}
READY_TIMEOUT_S = 180.0
WAIT_S = 30.0


def brokers_on(node: RayNode) -> int:
    return sum(title.startswith("ray::SandboxBrokerActor") and node.process.pid in _ancestors(pid)
               for pid, title in _ray_worker_titles().items())


def lose_machine(node: RayNode) -> None:
    """SIGKILL the node and every process under it at once (its actors live in their own process
    groups and would otherwise only notice their raylet's death later), as a lost machine."""
    under = [int(entry.name) for entry in Path("/proc").iterdir()
             if entry.name.isdigit() and node.process.pid in _ancestors(int(entry.name))]
    node.kill()
    for pid in under:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def two_nodes(tmp_path):
    """A head and a worker node, each offering the sandbox resource."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": f"{TESTS_DIR}:{REPO_ROOT}"}
    with tempfile.TemporaryDirectory(prefix="rmsb-", dir="/tmp") as temp_root:
        (gcs_port,) = free_ports(1)
        address = f"127.0.0.1:{gcs_port}"
        nodes = []
        try:
            head = RayNode("head", ["--head", f"--port={gcs_port}", "--num-cpus=1", "--include-dashboard=false",
                                    f"--resources={json.dumps(SANDBOX_NODE)}",
                                    *_node_ports(head=True, worker_ports=(21100, 21299))],
                           temp_dir=Path(temp_root) / "head", env=env)
            nodes.append(head)
            head.wait_started()
            worker = RayNode("worker", [f"--address={address}", "--num-cpus=1",
                                        f"--resources={json.dumps(SANDBOX_NODE)}",
                                        *_node_ports(head=False, worker_ports=(21300, 21499))],
                             temp_dir=Path(temp_root) / "worker", env=env)
            nodes.append(worker)
            worker.wait_started()
            yield address, head, worker, env
        finally:
            for node in reversed(nodes):
                node.stop()


async def _readline(stream, timeout_s: float) -> str:
    return await asyncio.wait_for(asyncio.to_thread(stream.readline), timeout_s)


async def echo(client: SandboxBrokerClient, lease_id: str, word: str) -> bytes:
    """``echo word`` in the lease's sandbox; its stdout."""
    reply = await asyncio.wait_for(client.exec(lease_id, shell=f"echo {word}", timeout_s=10.0), WAIT_S * 2)
    return reply.stdout


async def test_brokers_on_two_nodes_share_leases_and_a_lost_node_costs_only_its_own(
        two_nodes, nats_server, namespace, tmp_path):
    address, head, worker, env = two_nodes
    log = (tmp_path / "driver.log").open("wb")
    driver = subprocess.Popen(
        [sys.executable, str(TESTS_DIR / "support" / "cluster_brokers.py"), address, nats_server.url, namespace,
         str(tmp_path / "run")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    nc = await connect_bus(nats_server.url, name="two-node-sandbox-client", connect_timeout_s=5)
    try:
        reports: Counter[str] = Counter()
        heard_both = asyncio.Event()

        async def on_report(msg) -> None:
            reports[SANDBOX_LOAD.decode(msg.data).broker] += 1
            if len(reports) == 2 and min(reports.values()) >= 2:  # each has heard the other by now
                heard_both.set()

        await nc.subscribe(SANDBOX_LOAD.format(namespace), cb=on_report)
        line = await _readline(driver.stdout, READY_TIMEOUT_S)
        assert line, (tmp_path / "driver.log").read_text()[-3000:]
        placed = json.loads(line)
        head_broker = next(b for b, node_id in placed["brokers"].items() if node_id == placed["head"])
        (worker_broker,) = set(placed["brokers"]) - {head_broker}
        assert (brokers_on(head), brokers_on(worker)) == (1, 1)  # one broker on every sandbox node
        await asyncio.wait_for(heard_both.wait(), WAIT_S)

        client = SandboxBrokerClient(BusPublisher(nc, nc.jetstream(), namespace), timeout_s=WAIT_S)
        leases = {f"rollout-{index}": await client.lease(f"rollout-{index}", ttl_s=120.0) for index in range(8)}
        on = {broker: {holder: lease.lease_id for holder, lease in leases.items() if lease.broker == broker}
              for broker in (head_broker, worker_broker)}
        assert all(on.values()), {broker: len(held) for broker, held in on.items()}  # both nodes hold leases
        assert all(broker_of(lease.lease_id) == lease.broker for lease in leases.values())
        for lease in leases.values():
            assert await echo(client, lease.lease_id, "hi") == b"hi\n"
        lost_holder, lost_lease = next(iter(on[worker_broker].items()))
        await client.upload(lost_lease, "turn.txt", b"turn 2")
        snapshot = (await client.snapshot(lost_lease)).snapshot_id

        lose_machine(worker)  # the worker node, its broker and its sandboxes, at once
        for lease_id in on[head_broker].values():  # nothing on the head is lost
            assert await echo(client, lease_id, "still") == b"still\n"
        # Every lease of the lost broker fails typed: an infrastructure failure the rollout retries.
        # (An exec first waits out its own time for a broker that may be restarting: a short one.)
        lost_client = SandboxBrokerClient(BusPublisher(nc, nc.jetstream(), namespace), timeout_s=2.0)
        with pytest.raises(SandboxRequestError) as lost:
            await lost_client.exec(lost_lease, ["true"], timeout_s=1.0)
        assert lost.value.kind == "unreachable" and failure_kind(lost.value) in INFRA_FAILURE_KINDS
        for lease_id in on[worker_broker].values():
            with pytest.raises(SandboxRequestError) as lost:
                await lost_client.heartbeat(lease_id)
            assert lost.value.kind == "unreachable"
        # The rollout's retry: its broker is gone, so a lease on the head's, forked from the
        # snapshot the lost broker took (its copy in the JetStream object store).
        resumed = await RolloutSandbox(client, RolloutConfig()).lease(
            lost_holder, held=lost_lease, snapshot_id=snapshot, turn=2)
        assert broker_of(resumed) == head_broker
        assert await client.download(resumed, "turn.txt") == b"turn 2"
        assert await echo(client, resumed, "resumed") == b"resumed\n"
    finally:
        await nc.close()
        driver.stdin.close()
        try:
            driver.wait(timeout=90)
        except subprocess.TimeoutExpired:
            driver.kill()
        log.close()
