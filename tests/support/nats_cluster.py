"""LocalNatsCluster: three nats-server processes forming one JetStream cluster on loopback.

Knows the nats-server binary, the shipped node configs in ``deploy/nats-cluster/`` and the
monitoring endpoint ``/jsz``; knows nothing of rollmesh streams or clients. Each node runs the
shipped config with only its ports (free ones picked at random, so a test never collides with a
cluster started from ``deploy/``) and its store directory rewritten, so the tests exercise the
files users run. Readiness is the cluster's own word: every live node's ``/jsz`` names the same
JetStream meta leader and sees all its peers, polled with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from rollmesh.bus.embedded_server import find_nats_server_binary
from rollmesh.bus.errors import NatsServerStartError

DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy" / "nats-cluster"
NODE_COUNT = 3
# The fixed loopback ports of the shipped configs, per node: client, cluster route, monitoring.
SHIPPED_PORTS = [(4222 + i, 6222 + i, 8222 + i) for i in range(NODE_COUNT)]
_LOOPBACK_PORT = re.compile(r"127\.0\.0\.1:(\d+)")
_STORE_DIR = re.compile(r'^(\s*store_dir:\s*)"[^"]*"', re.MULTILINE)
_TAIL_LINES = 30


@dataclass
class ClusterNode:
    """One node: its name (the config's server_name), ports, files and process."""

    name: str
    client_port: int
    http_port: int
    config_path: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def stderr_path(self) -> Path:
        return self.log_path.with_name("stderr.log")

    def log_tail(self, lines: int = _TAIL_LINES) -> str:
        text = ""
        for path in (self.log_path, self.stderr_path):
            try:
                text += path.read_text(errors="replace")
            except FileNotFoundError:
                pass
        return "\n".join(text.splitlines()[-lines:]) or "(no log yet)"


class LocalNatsCluster:
    """``with LocalNatsCluster(tmp_path) as cluster:`` -> ``cluster.url`` (all three nodes)."""

    def __init__(self, root: Path, *, ready_timeout_s: float = 30.0) -> None:
        self.root = Path(root)
        self.ready_timeout_s = ready_timeout_s
        self.nodes: list[ClusterNode] = []

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> str:
        """Write the three configs, start the nodes, wait for a meta leader; returns ``url``."""
        if self.nodes:
            raise NatsServerStartError("cluster already started")
        binary = find_nats_server_binary()
        fixed = [port for node_ports in SHIPPED_PORTS for port in node_ports]
        new_port = dict(zip(fixed, free_ports(len(fixed))))
        self.nodes = [self._write_node(i, new_port) for i in range(NODE_COUNT)]
        for node in self.nodes:
            # A config error is printed to stderr before the log file is opened.
            with node.stderr_path.open("wb") as stderr:
                node.process = subprocess.Popen(
                    [str(binary), "-c", str(node.config_path), "-l", str(node.log_path)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                )
        try:
            self.wait_meta_leader()
        except BaseException:
            self.stop()
            raise
        return self.url

    def kill(self, index: int) -> None:
        """SIGKILL one node (no flush, no goodbye to its peers) and reap it."""
        node = self.nodes[index]
        if node.process is not None and node.process.poll() is None:
            node.process.send_signal(signal.SIGKILL)
            node.process.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every live node, then SIGKILL any that does not exit in time. Idempotent."""
        live = [n.process for n in self.nodes if n.process is not None and n.process.poll() is None]
        for process in live:
            process.send_signal(signal.SIGTERM)
        for process in live:
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout_s)

    def __enter__(self) -> LocalNatsCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- state -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what ``connect_bus`` takes)."""
        return ",".join(node.url for node in self.nodes)

    def index_of_name(self, server_name: str) -> int:
        return next(i for i, node in enumerate(self.nodes) if node.name == server_name)

    def index_of_port(self, client_port: int) -> int:
        return next(i for i, node in enumerate(self.nodes) if node.client_port == client_port)

    def jsz(self, index: int) -> dict[str, Any]:
        """The node's ``/jsz`` monitoring document (raises OSError while it is not listening)."""
        url = f"http://127.0.0.1:{self.nodes[index].http_port}/jsz"
        with urllib.request.urlopen(url, timeout=2) as response:
            return json.loads(response.read())

    def wait_meta_leader(self, timeout_s: float | None = None) -> str:
        """Block until every live node agrees on a meta leader that sees all peers; its name."""
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        delay = 0.01
        while True:
            leader = self._agreed_meta_leader()
            if leader is not None:
                return leader
            if time.monotonic() > deadline:
                self._fail(f"no JetStream meta leader within {timeout_s or self.ready_timeout_s}s")
            time.sleep(delay)  # polling backoff, not synchronization: /jsz is the signal
            delay = min(delay * 2, 0.2)

    def log_tails(self) -> str:
        return "\n".join(f"--- {node.name} (port {node.client_port}, "
                         f"{'running' if node.running else 'exited'}) ---\n{node.log_tail()}"
                         for node in self.nodes)

    # -- internals -------------------------------------------------------------------------

    def _write_node(self, index: int, new_port: dict[int, int]) -> ClusterNode:
        """The shipped config of node ``index`` with every fixed port and the store replaced."""
        shipped = DEPLOY_DIR / f"nats-{index + 1}.conf"
        store = self.root / f"nats-{index + 1}"
        store.mkdir(parents=True, exist_ok=True)
        # One pass over whole port numbers: a new port may start with the digits of a fixed one.
        text, ports_replaced = _LOOPBACK_PORT.subn(
            lambda m: f"127.0.0.1:{new_port.get(int(m.group(1)), m.group(1))}", shipped.read_text())
        text, stores_replaced = _STORE_DIR.subn(rf'\g<1>"{store}"', text)
        name = re.search(r"^server_name:\s*(\S+)", text, re.MULTILINE)
        unknown = [int(p) for p in _LOOPBACK_PORT.findall(text) if int(p) not in new_port.values()]
        if stores_replaced != 1 or name is None or unknown or ports_replaced < 3 + NODE_COUNT:
            # The shipped file changed shape: fail here rather than run a half-rewritten config.
            raise NatsServerStartError(
                f"cannot rewrite {shipped}: store_dir replaced {stores_replaced}x, "
                f"{ports_replaced} ports replaced, ports not rewritten {unknown}, "
                f"server_name {'found' if name else 'missing'}")
        client, _, http = SHIPPED_PORTS[index]
        config_path = store / "node.conf"
        config_path.write_text(text)
        return ClusterNode(name=name.group(1), client_port=new_port[client],
                           http_port=new_port[http], config_path=config_path,
                           log_path=store / "nats-server.log")

    def _agreed_meta_leader(self) -> str | None:
        for node in self.nodes:
            process = node.process
            # SIGKILL is ours (kill): the survivors must agree without that node.
            if process is not None and process.poll() not in (None, -signal.SIGKILL):
                self._fail(f"{node.name} exited with code {process.returncode}")
        leaders = set()
        for index, node in enumerate(self.nodes):
            if not node.running:
                continue
            try:
                meta = self.jsz(index).get("meta_cluster") or {}
            except (OSError, ValueError):  # not listening yet, or a half-written reply
                return None
            # A leader is only usable once it has heard from every peer (cluster_size counts
            # them); before that a stream with 3 replicas cannot be placed.
            if not meta.get("leader") or meta.get("cluster_size", 0) < NODE_COUNT:
                return None
            leaders.add(meta["leader"])
        if len(leaders) != 1:
            return None
        leader = leaders.pop()
        # Right after a kill the survivors still name the dead leader until they notice.
        return leader if self.nodes[self.index_of_name(leader)].running else None

    def _fail(self, message: str) -> None:
        tails = self.log_tails()
        self.stop()
        raise NatsServerStartError(f"nats cluster: {message}",
                                   binary=str(find_nats_server_binary()), log_tail=tails)


def free_ports(count: int) -> list[int]:
    """Ports the kernel calls free right now (all held open together, so they are distinct)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()

