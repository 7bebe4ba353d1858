"""A mesh started as a user starts it (``rollmesh up``, a subprocess) keeps its local Ray to this
machine: every listening socket of every process of the mesh and its Ray session is on loopback,
Ray requires the token the mesh wrote in its run directory (mode 0600), and the commands that
join that Ray (``convert --backend ray --run-dir``) or stop it (``down``) find what they need there.

The processes are the mesh process and its whole tree (Ray starts the GCS, raylet, agents, the
dashboard and workers beneath it), plus any process whose command line names the Ray session
directory (in case Ray ever detaches one).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from support.nats_cluster import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROLLMESH = [sys.executable, "-m", "rollmesh.cli"]
UP_TIMEOUT_S = 300.0
CLIENT_TIMEOUT_S = 180.0
SESSION_DIR = re.compile(r"(/\S*?/session_\d{4}-\d\d-\d\d_[\w.-]+?)(?=[/\s]|$)")


@dataclass
class RunningMesh:
    run_dir: Path
    info: dict
    env: dict[str, str]
    up: bool = True


def rollmesh(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ROLLMESH, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningMesh]:
    root = tmp_path_factory.mktemp("loopback")
    (serve_port,) = free_ports(1)
    config = root / "mesh.toml"
    config.write_text(f"[serve]\nport = {serve_port}\n")
    # The tests' environment says RAY_AUTH_MODE=disabled (tests/conftest.py): kept, so this also
    # checks that a Ray rollmesh starts has auth on whatever the environment says.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    run_dir = root / "run"
    up = rollmesh(["--config", str(config), "up", "--run-dir", str(run_dir), "--metrics-port", "0",
                   "--timeout", str(UP_TIMEOUT_S)], env, UP_TIMEOUT_S + 60)
    assert up.returncode == 0, up.stdout + up.stderr
    running = RunningMesh(run_dir, json.loads((run_dir / "mesh.json").read_text()), env)
    try:
        yield running
    finally:
        if running.up:
            rollmesh(["down", "--run-dir", str(run_dir), "--timeout", "60"], env, 120)


# -- what listens -----------------------------------------------------------------------------

def mesh_processes(mesh_pid: int) -> list[psutil.Process]:
    """The mesh process, everything beneath it, and any process naming its Ray session dir."""
    root = psutil.Process(mesh_pid)
    tree = {p.pid: p for p in [root, *root.children(recursive=True)]}
    sessions = {match.group(1) for p in tree.values() for match in [SESSION_DIR.search(_cmdline(p))] if match}
    for process in psutil.process_iter():
        if process.pid not in tree and any(session in _cmdline(process) for session in sessions):
            tree[process.pid] = process
    return list(tree.values())


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def kind_of(process: psutil.Process, mesh_pid: int) -> str:
    if process.pid == mesh_pid:
        return "mesh"
    command = _cmdline(process)
    for marker, kind in (("gcs_server", "gcs_server"), ("raylet/raylet", "raylet"), ("nats-server", "nats-server"),
                         ("DashboardAgent", "dashboard_agent"), ("RuntimeEnvAgent", "runtime_env_agent"),
                         ("dashboard/dashboard.py", "dashboard"), ("autoscaler", "monitor"),
                         ("log_monitor", "log_monitor")):
        if marker in command:
            return kind
    if command.startswith("ray::") or "default_worker.py" in command:
        return "worker"
    return "other: " + command[:80]


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback  # 0.0.0.0 and :: are not


def listeners(mesh_pid: int) -> tuple[Counter[str], list[tuple[str, str, int]]]:
    """How many processes of each kind, and every (kind, address, port) listening."""
    kinds: Counter[str] = Counter()
    found = []
    for process in mesh_processes(mesh_pid):
        kind = kind_of(process, mesh_pid)
        try:
            connections = process.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        kinds[kind] += 1
        found += [(kind, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    return kinds, found


def test_every_socket_the_mesh_and_its_ray_listen_on_is_loopback(mesh: RunningMesh) -> None:
    kinds, found = listeners(mesh.info["pid"])
    print("processes:", dict(kinds))
    print("listeners:", dict(Counter((kind, ip) for kind, ip, _ in found)))
    # Not vacuous: the Ray session and the mesh's own servers are all there, and listening.
    assert kinds["gcs_server"] == 1 and kinds["raylet"] == 1 and kinds["worker"] >= 1, kinds
    listening_kinds = {kind for kind, _, _ in found}
    assert {"gcs_server", "raylet", "worker", "nats-server", "mesh"} <= listening_kinds, listening_kinds
    ports = {port for _, _, port in found}
    for url in (mesh.info["nats_url"], mesh.info["serve_url"], mesh.info["metrics_url"]):
        assert int(url.rsplit(":", 1)[1].split("/")[0]) in ports, url  # NATS, Serve's proxy, metrics
    assert [listener for listener in found if not is_loopback(listener[1])] == []


def test_is_loopback_counts_the_wildcard_addresses_as_beyond_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.0.2.2", "::ffff:192.0.2.2"]))


# -- the token --------------------------------------------------------------------------------

def test_the_ray_token_is_in_the_run_dir_for_this_user_only(mesh: RunningMesh) -> None:
    token_file = Path(mesh.info["ray_auth_token_file"])
    assert token_file == (mesh.run_dir / "ray_auth_token").resolve()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert len(token_file.read_text().strip()) >= 32
    assert mesh.info["ray_address"].startswith("127.0.0.1:")


def test_a_ray_client_without_the_token_is_refused(mesh: RunningMesh) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    # A client that sends no token; the switch keeps Ray from swapping 127.0.0.1 for the host's
    # address (rollmesh/local_ray.py), so it dials the GCS that is there.
    env.update(RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    client = f"import ray; ray.init(address={mesh.info['ray_address']!r}, log_to_driver=False); print('JOINED')"
    joined = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True,
                            timeout=CLIENT_TIMEOUT_S, env=env)
    assert joined.returncode != 0 and "JOINED" not in joined.stdout
    assert "InvalidAuthToken" in joined.stderr, joined.stderr[-2000:]


def test_convert_on_the_meshs_ray_finds_its_address_and_token(mesh: RunningMesh, dense_tp2: Path,
                                                              tmp_path: Path) -> None:
    converted = rollmesh(["convert", str(dense_tp2), str(tmp_path / "hf"), "--backend", "ray",
                          "--run-dir", str(mesh.run_dir)], mesh.env, CLIENT_TIMEOUT_S)
    assert converted.returncode == 0, converted.stdout + converted.stderr[-3000:]
    assert f"Ray: the mesh's, at {mesh.info['ray_address']}" in converted.stderr
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()


# -- down (last: it stops the mesh) -----------------------------------------------------------

def test_down_stops_the_mesh_and_every_process_of_its_ray(mesh: RunningMesh) -> None:
    processes = mesh_processes(mesh.info["pid"])
    assert any(kind_of(p, mesh.info["pid"]) == "gcs_server" for p in processes)
    down = rollmesh(["down", "--run-dir", str(mesh.run_dir), "--timeout", "60"], mesh.env, 120)
    mesh.up = False
    assert down.returncode == 0, down.stdout + down.stderr
    assert "mesh stopped" in down.stdout
    assert not (mesh.run_dir / "mesh.json").exists()
    _, alive = psutil.wait_procs(processes, timeout=60)
    assert alive == []
