"""rollmesh on a two-node Ray cluster and a 3-node NATS JetStream cluster, all on one machine.

Real processes only: ``ray start --head`` and ``ray start --address=...`` with different declared
resources (each its own raylet, temp dir and ports, on loopback), the three nats-servers of
``deploy/nats-cluster/`` (tests/support/nats_cluster.py), and ``rollmesh up`` with ``deploy/two-node.toml``,
a config that differs from the single-machine one only in addresses and resources. The pytest
process has its own local Ray (tests/conftest.py; one Ray per process), so this cluster is driven
from subprocesses only, and actors are found on nodes through the process tree (every actor
process descends from its node's raylet, which descends from its ``ray start --block``).

The worker node's rollout worker holds a request that cannot finish there (tests/
support/cluster_test_tasks.py); the test kills that node (SIGKILL of its whole process group, as a machine
loss) and checks that every request still ends exactly once, the held one redelivered to the
head's worker, and that the lost worker is started again when a node with room for it joins.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy

from support.nats_cluster import LocalNatsCluster, free_ports
from support.cluster_test_tasks import HOLD_DIR_ENV
from rollmesh.bus.outage import is_transient
from rollmesh.bus.streams import rollout_results_stream
from rollmesh.config import DEFAULT_CONFIG_PATH, ConfigError, load_config
from rollmesh.launcher import with_role_resources

pytestmark = [pytest.mark.timeout(900)]

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
TWO_NODE_CONFIG = REPO_ROOT / "deploy" / "two-node.toml"
RAY = str(Path(sys.executable).with_name("ray"))
ROLLMESH = [sys.executable, "-m", "rollmesh.cli"]

# What each node declares (the comments of deploy/two-node.toml): the head hosts every role but
# one rollout worker; the worker node has room for the other rollout worker only.
HEAD_RESOURCES = {"rollmesh_gpu": 2, "rollmesh_head": 1, "rollmesh_rollout": 1}
WORKER_RESOURCES = {"rollmesh_rollout": 1}
# The only fields in which the cluster config may differ from the single-machine defaults.
ADDRESSES = {"nats.url", "ray.address"}
RESOURCES = {"nats.replicas", "ray.role_resources", "rollout.num_workers"}

ROLLOUTS = 6
# Generous: on a 2-core machine shared with other Ray work, two nodes' actors took over 240 s to
# start once (a demo ran beside the suite); a hung start still fails, only later.
READY_TIMEOUT_S = float(os.environ.get("ROLLMESH_TEST_CLUSTER_READY_TIMEOUT_S", "480"))
RESULTS_TIMEOUT_S = 240.0
# Short timers (as the session mesh of tests/conftest.py has), so the dead node's request comes
# back within seconds; with the test task, the only overrides beyond the file.
TEST_ENV = {
    "ROLLMESH_NATS__ROLLOUT_ACK_WAIT_S": "6.0",
    "ROLLMESH_ROLLOUT__WORK_HEARTBEAT_S": "1.5",
    "ROLLMESH_RAY__SUPERVISE_INTERVAL_S": "0.5",
    # One rollout at a time per worker, so both workers get some of the requests.
    "ROLLMESH_ROLLOUT__MAX_CONCURRENT": "1",
    "ROLLMESH_ROLLOUT__TASKS": '["rollmesh.rollout.molar_mass:MolarMassTask", '
                               '"support.cluster_test_tasks:NodeHeldMolarMassTask"]',
    "ROLLMESH_TELEMETRY__EXPORTER": '"none"',
}


@pytest.mark.unit
def test_cluster_config_differs_from_one_machine_only_in_addresses_and_resources():
    one_machine = _flatten(msgspec.to_builtins(load_config(DEFAULT_CONFIG_PATH, environ={})))
    cluster = _flatten(msgspec.to_builtins(load_config(TWO_NODE_CONFIG, environ={})))
    differing = {key for key in one_machine.keys() | cluster.keys()
                 if one_machine.get(key) != cluster.get(key)}
    assert differing - ADDRESSES - RESOURCES == set(), differing
    assert ADDRESSES <= differing  # it is a cluster config: it names the cluster


@pytest.mark.unit
def test_role_resources_add_to_a_roles_accelerator_grant():
    assert with_role_resources({"num_gpus": 1}, {"rollmesh_decode": 1}) == {
        "num_gpus": 1, "resources": {"rollmesh_decode": 1}}
    assert with_role_resources({"resources": {"rollmesh_gpu": 1}}, {"rollmesh_head": 0.01}) == {
        "resources": {"rollmesh_gpu": 1, "rollmesh_head": 0.01}}
    assert with_role_resources({}, {}) == {}


@pytest.mark.unit
@pytest.mark.parametrize(("placement", "message"), [
    ({"rollouts": {"rollmesh_rollout": 1}}, "unknown roles ['rollouts']"),
    ({"trainer": {"GPU": 1}}, "Ray's own resources"),
    ({"trainer": {"rollmesh_trainer": 0}}, "Expected `float` > 0.0"),
])
def test_role_resources_refuse_unknown_roles_ray_resources_and_empty_amounts(placement, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        load_config(overrides={"ray.role_resources": placement}, environ={})
    assert caught.value.path.startswith("ray")


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"nats": {"url": x}} -> {"nats.url": x}; role_resources stays one value (a placement)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in ("ray.role_resources", "sandbox.profiles",
                                                      "scheduler.grants", "security.credentials"):
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


# -- the cluster -----------------------------------------------------------------------------

class RayNode:
    """One ``ray start --block`` in its own process group: stopping the group stops the node."""

    def __init__(self, name: str, args: list[str], *, temp_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = temp_dir.parent / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [RAY, "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
                 f"--temp-dir={temp_dir}", *args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env=env)

    def wait_started(self, timeout_s: float = 120.0) -> None:
        """``ray start`` says "Ray runtime started" once its processes are up."""
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in self.log():
            assert self.process.poll() is None, f"{self.name} exited:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.name} not started:\n{self.log()[-3000:]}"
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole node at once (raylet, its workers, and on the head the GCS)."""
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.process.pid, signal.SIGKILL)  # stragglers of the group, if any
        if self.process.poll() is None:
            self.process.wait(timeout=30)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _node_ports(*, head: bool, worker_ports: tuple[int, int]) -> list[str]:
    """Every port a node listens on, free ones, so this cluster never meets another Ray here."""
    names = ["node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
             "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port"]
    if head:
        names += ["ray-client-server-port", "dashboard-port"]
    low, high = worker_ports
    return ([f"--{name}={port}" for name, port in zip(names, free_ports(len(names)))]
            + [f"--min-worker-port={low}", f"--max-worker-port={high}"])


class TwoNodeCluster:
    def __init__(self, root: Path, temp_root: Path) -> None:
        self.root = root
        self.temp_root = temp_root  # short: Ray's socket paths must fit in 107 bytes
        self.hold_dir = root / "held"
        self.hold_dir.mkdir()
        self.run_dir = root / "run"
        self.nats = LocalNatsCluster(root / "nats")
        self.nodes: list[RayNode] = []
        self.head: RayNode | None = None
        self.address = ""
        self.namespace = "two" + uuid.uuid4().hex[:8]
        # Auth off on this test's own cluster (`ray start`), which the mesh joins: a joined
        # cluster's auth is its operator's (docs/security.md), not what this test is about.
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled",
                    "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(REPO_ROOT)])}
        self.mesh_up = False

    def start(self) -> None:
        self.nats.start()
        (gcs_port,) = free_ports(1)
        self.address = f"127.0.0.1:{gcs_port}"
        self.head = self._node("head", ["--head", f"--port={gcs_port}", "--num-cpus=2",
                                        "--include-dashboard=false",
                                        f"--resources={json.dumps(HEAD_RESOURCES)}",
                                        *_node_ports(head=True, worker_ports=(20100, 20399))])
        self.head.wait_started()
        self.add_worker_node("worker", hold=True, worker_ports=(20400, 20699))

    def add_worker_node(self, name: str, *, hold: bool, worker_ports: tuple[int, int]) -> RayNode:
        env = {HOLD_DIR_ENV: str(self.hold_dir)} if hold else {}
        node = self._node(name, [f"--address={self.address}", "--num-cpus=1",
                                 f"--resources={json.dumps(WORKER_RESOURCES)}",
                                 *_node_ports(head=False, worker_ports=worker_ports)], env)
        node.wait_started()
        return node

    def _node(self, name: str, args: list[str], env: dict[str, str] | None = None) -> RayNode:
        node = RayNode(name, args, temp_dir=self.temp_root / name, env={**self.env, **(env or {})})
        self.nodes.append(node)
        return node

    def rollmesh(self, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        env = {**self.env, **TEST_ENV, "ROLLMESH_NAMESPACE": f'"{self.namespace}"'}
        return subprocess.run([*ROLLMESH, *args], capture_output=True, text=True, env=env,
                              timeout=timeout_s, cwd=self.root)

    def up(self) -> None:
        up = self.rollmesh("--config", str(TWO_NODE_CONFIG), "up", "--ray-address", self.address,
                           "--nats-url", self.nats.url, "--no-serve", "--run-dir", str(self.run_dir),
                           "--timeout", str(READY_TIMEOUT_S), timeout_s=READY_TIMEOUT_S + 60)
        self.mesh_up = up.returncode == 0
        assert self.mesh_up, up.stdout + up.stderr + self.mesh_log()[-4000:]

    def mesh_log(self) -> str:
        path = self.run_dir / "mesh.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def actors_on(self, node: RayNode) -> Counter[str]:
        """The role actor classes whose processes run under ``node``'s ``ray start``."""
        return Counter(title.split(".")[0].removeprefix("ray::")
                       for pid, title in _ray_worker_titles().items()
                       if node.process.pid in _ancestors(pid) and title.split(".")[0].endswith("Actor"))

    def stop(self) -> None:
        try:
            if self.mesh_up:
                self.rollmesh("down", "--run-dir", str(self.run_dir), "--timeout", "60", timeout_s=120)
        finally:
            for node in reversed(self.nodes):
                node.stop()
            self.nats.stop()


def _ray_worker_titles() -> dict[int, str]:
    """pid -> process title of every Ray worker process on the machine ("ray::ClassName...")."""
    titles = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::"):
            titles[int(entry.name)] = title
    return titles


def _ancestors(pid: int) -> set[int]:
    found = set()
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        found.add(pid)
    return found


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[TwoNodeCluster]:
    with tempfile.TemporaryDirectory(prefix="rm2n-", dir="/tmp") as temp_root:
        running = TwoNodeCluster(tmp_path, Path(temp_root))
        try:
            running.start()
            yield running
        finally:
            running.stop()


# -- the test --------------------------------------------------------------------------------

def requests_file(path: Path, namespace: str) -> tuple[Path, list[str]]:
    ids = [f"{namespace}-{index}" for index in range(ROLLOUTS)]
    lines = [json.dumps({"rollout_id": rollout_id, "task": "node_held_molar_mass",
                         "task_input": {"formula": "NaCl", "rollout_id": rollout_id},
                         "sampling": {"temperature": 1.0, "max_new_tokens": 16}, "max_turns": 2})
             for rollout_id in ids]
    path.write_text("\n".join(lines) + "\n")
    return path, ids


def wait_held(hold_dir: Path, timeout_s: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while not (held := sorted(p.name for p in hold_dir.iterdir())):
        assert time.monotonic() < deadline, "the worker node's rollout worker took no request"
        time.sleep(0.1)
    return held


async def fetch_through_elections(pull: Any, *, timeout_s: float, deadline: float) -> list[Any]:
    """Up to 50 messages, or none when ``timeout_s`` passes with nothing to read. The worker node's
    loss can leave the consumer's raft group electing a leader, and its fetches answer 503 until
    one is chosen: that is retried (until ``deadline``) as the mesh's own consumers do."""
    while True:
        try:
            return await pull.fetch(50, timeout=timeout_s)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return []
        except nats.js.errors.APIError as exc:
            if not is_transient(exc) or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)  # backoff between fetches, not synchronization


async def results_of(nats_url: str, namespace: str, ids: list[str]) -> dict[str, list[dict]]:
    """Every result in the results stream for ``ids`` (waits until each has one)."""
    nc = await nats.connect(servers=nats_url.split(","), max_reconnect_attempts=-1,
                            reconnect_time_wait=0.2)
    try:
        js = nc.jetstream()
        pull = await js.pull_subscribe(f"rl.{namespace}.rollout.*", durable="two-node-check",
                                       stream=rollout_results_stream(namespace),
                                       config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        found: dict[str, list[dict]] = {rollout_id: [] for rollout_id in ids}
        deadline = time.monotonic() + RESULTS_TIMEOUT_S
        while any(not answers for answers in found.values()):
            assert time.monotonic() < deadline, f"no result for {[i for i, a in found.items() if not a]}"
            msgs = await fetch_through_elections(pull, timeout_s=1.0, deadline=deadline)
            for msg in msgs:
                body = json.loads(msg.data)
                if body.get("rollout_id") in found:
                    found[body["rollout_id"]].append(body)
                await msg.ack()
        # Anything published twice would be in the stream by now too: read what is left.
        for msg in await fetch_through_elections(pull, timeout_s=2.0,
                                                 deadline=time.monotonic() + RESULTS_TIMEOUT_S):
            body = json.loads(msg.data)
            if body.get("rollout_id") in found:
                found[body["rollout_id"]].append(body)
        return found
    finally:
        await nc.close()


def wait_for(condition, message: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.25)


@pytest.mark.integration
async def test_rollouts_span_two_nodes_and_a_lost_node_loses_no_request(cluster: TwoNodeCluster):
    cluster.up()
    head, worker = cluster.nodes
    # Placement by declared resources: one rollout worker on the worker node, the rest on the head.
    assert cluster.actors_on(worker) == Counter({"RolloutWorkerActor": 1}), cluster.actors_on(worker)
    on_head = cluster.actors_on(head)
    assert on_head["RolloutWorkerActor"] == 1 and on_head["TrainerActor"] == 1, on_head
    assert on_head["DecodeWorkerActor"] == 1 and on_head["SandboxBrokerActor"] == 1, on_head

    path, ids = requests_file(cluster.root / "requests.jsonl", cluster.namespace)
    submit = cluster.rollmesh("submit", "--file", str(path), "--run-dir", str(cluster.run_dir),
                              timeout_s=120)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    held = wait_held(cluster.hold_dir)
    worker.kill()  # mid-run: the worker node holds a request, the head runs the others

    results = await results_of(cluster.nats.url, cluster.namespace, ids)
    for rollout_id, answers in results.items():
        assert len(answers) == 1, f"{rollout_id}: {len(answers)} results"
        assert answers[0]["type"] == "rollout.completed", answers[0]
    # The request the dead node held was redelivered and run again on the head.
    for rollout_id in held:
        assert results[rollout_id][0]["attempts"] >= 2, results[rollout_id]

    # A node with room for it joins: Ray re-creates the lost rollout worker there and the mesh
    # starts its role again.
    replacement = cluster.add_worker_node("replacement", hold=False, worker_ports=(20700, 20999))
    wait_for(lambda: cluster.actors_on(replacement) == Counter({"RolloutWorkerActor": 1}),
             "the lost rollout worker was not re-created on the new node")
    wait_for(lambda: "actor_restarted" in cluster.mesh_log(),
             "the mesh did not start the re-created rollout worker's role",)
