"""``MeshAddress``: where a mesh is (``mesh.json``, which users' scripts read) and how to get in
(each role's credentials, never written), and ``connect``, the one way into the mesh's NATS.

The file tests are plain logic; the connect tests use the session's (open) nats-server. Against a
server that checks credentials: tests/test_security_nats.py, tests/test_security_mesh.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from rollmesh.bus.connection import flush_to_server
from rollmesh.bus.errors import BusConnectError, BusSecurityError
from rollmesh.bus.security import BusCredentials
from rollmesh.config import NatsConfig, NatsCredentialsConfig, NatsTlsConfig, TelemetryConfig
from rollmesh.mesh_address import (
    MESH_FILE,
    MeshAddress,
    MeshNotFoundError,
    latest_run_dir,
    new_run_dir,
    read_mesh_address,
    write_mesh_address,
)

pytestmark = pytest.mark.timeout(60)

# mesh.json's keys in their order, as rollmesh has always written them.
MESH_JSON_KEYS = ["nats_url", "namespace", "run_dir", "serve_url", "ray_namespace", "ray_address", "pid",
                  "started_at", "metrics_url", "dashboard_url", "ray_auth_token_file"]


def credentials(role: str, namespace: str = "ns", **source: str) -> BusCredentials:
    return BusCredentials(role, namespace, NatsCredentialsConfig(**(source or {"nkey_seed_file": f"/keys/{role}.nk"})))


# --- mesh.json ---------------------------------------------------------------------------------

@pytest.mark.unit
def test_mesh_address_written_to_a_run_dir_reads_back_equal(tmp_path):
    run_dir = new_run_dir(tmp_path)
    address = MeshAddress(nats_url="nats://127.0.0.1:4222", namespace="ns", run_dir=str(run_dir), pid=42)
    assert write_mesh_address(address) == run_dir / MESH_FILE
    assert read_mesh_address(run_dir, run_root=tmp_path) == address
    assert [p.name for p in run_dir.iterdir()] == [MESH_FILE]  # no temporary file left behind


@pytest.mark.unit
def test_mesh_json_keeps_its_keys_and_values_and_never_holds_how_to_get_in(tmp_path, monkeypatch):
    monkeypatch.setenv("MESH_TEST_PASSWORD", "hunter2")
    address = MeshAddress(
        nats_url="tls://127.0.0.1:4222", namespace="ns", run_dir=str(tmp_path), serve_url="http://127.0.0.1:8000",
        ray_namespace="rollmesh-ns", ray_address="127.0.0.1:6379", pid=42, started_at=1700000000.5,
        metrics_url="http://127.0.0.1:9100/metrics", dashboard_url="http://127.0.0.1:8000/dashboard",
        ray_auth_token_file=str(tmp_path / "ray_token"),
        credentials={"mesh": credentials("mesh"),
                     "client": credentials("client", user="alice", password_env="MESH_TEST_PASSWORD")},
        nats_tls=NatsTlsConfig(enabled=True, ca_file="/pki/ca.pem"), nats=NatsConfig(replicas=3),
        telemetry=TelemetryConfig(exporter="jsonl"))
    text = write_mesh_address(address).read_text()
    written = json.loads(text)
    assert list(written) == MESH_JSON_KEYS
    assert written == {key: getattr(address, key) for key in MESH_JSON_KEYS}
    for never_written in ("/keys/mesh.nk", "alice", "MESH_TEST_PASSWORD", "hunter2", "/pki/ca.pem", "jsonl"):
        assert never_written not in text
    # Read back, it says where the mesh is; how to get in is the reader's to add.
    assert read_mesh_address(tmp_path, run_root=tmp_path.parent) == MeshAddress(
        **{key: getattr(address, key) for key in MESH_JSON_KEYS})


@pytest.mark.unit
def test_an_older_mesh_json_still_reads(tmp_path):
    # Written before metrics_url, dashboard_url and ray_auth_token_file; a newer one's extra key too.
    (tmp_path / MESH_FILE).write_text(json.dumps({
        "nats_url": "nats://127.0.0.1:4222", "namespace": "old", "run_dir": str(tmp_path),
        "serve_url": "", "ray_namespace": "rollmesh-old", "ray_address": "", "pid": 7, "started_at": 1.5,
        "from_a_newer_rollmesh": True}))
    address = read_mesh_address(tmp_path, run_root=tmp_path.parent)
    assert (address.namespace, address.pid, address.ray_namespace) == ("old", 7, "rollmesh-old")
    assert address.metrics_url == address.dashboard_url == address.ray_auth_token_file == ""
    assert not address.secured


@pytest.mark.unit
def test_read_mesh_address_without_a_run_dir_finds_the_latest_run(tmp_path):
    for name in ("20250101-000000-aaaaaa", "20250102-000000-bbbbbb"):
        (tmp_path / name).mkdir()
        write_mesh_address(MeshAddress(nats_url="nats://x:1", namespace=name, run_dir=str(tmp_path / name)))
    (tmp_path / "zz-not-a-dir").write_text("")
    assert latest_run_dir(tmp_path) == tmp_path / "20250102-000000-bbbbbb"
    assert read_mesh_address(None, run_root=tmp_path).namespace == "20250102-000000-bbbbbb"


@pytest.mark.unit
def test_new_run_dirs_are_fresh_and_sort_by_start_time(tmp_path):
    first, second = new_run_dir(tmp_path), new_run_dir(tmp_path)
    assert first != second and first.is_dir() and second.is_dir()
    assert first.name[:15] <= second.name[:15]


@pytest.mark.unit
def test_no_runs_or_no_mesh_file_is_mesh_not_found(tmp_path):
    with pytest.raises(MeshNotFoundError, match="rollmesh up"):
        read_mesh_address(None, run_root=tmp_path / "nothing")
    run_dir = new_run_dir(tmp_path)
    with pytest.raises(MeshNotFoundError) as raised:
        read_mesh_address(run_dir, run_root=tmp_path)
    assert raised.value.run_dir == str(run_dir)


@pytest.mark.unit
def test_an_address_needs_its_fields_named():
    # MeshContext took (namespace, nats_url, ...), mesh.json's order is (nats_url, namespace, ...):
    # positional arguments would swap them silently.
    with pytest.raises(TypeError):
        MeshAddress("ns", "nats://x:1", "/run")  # type: ignore[misc]


# --- credentials -------------------------------------------------------------------------------

@pytest.mark.unit
def test_an_open_nats_needs_no_credentials_for_any_role():
    open_mesh = MeshAddress(nats_url="nats://x:1", namespace="ns", run_dir="/run")
    assert open_mesh.credentials_for("decode") is None and open_mesh.credentials_for("client") is None
    assert not open_mesh.secured


@pytest.mark.unit
def test_an_actor_role_connects_with_its_nats_roles_credentials_and_is_handed_only_those():
    mesh = MeshAddress(nats_url="nats://x:1", namespace="ns", run_dir="/run", credentials={
        role: credentials(role) for role in ("mesh", "inference", "trainer", "client")})
    assert mesh.credentials_for("decode").role == "inference"  # an actor role: its NATS role's
    assert mesh.credentials_for("client").role == "client"  # a NATS role: its own
    decode = mesh.only("inference")
    assert list(decode.credentials) == ["inference"] and decode.nats_url == mesh.nats_url
    with pytest.raises(BusSecurityError) as raised:
        decode.credentials_for("trainer")
    assert raised.value.role == "trainer"


# --- connect -----------------------------------------------------------------------------------

@pytest.mark.integration
async def test_connect_reaches_an_open_nats_without_credentials(nats_server, namespace, tmp_path):
    mesh = MeshAddress(nats_url=nats_server.url, namespace=namespace, run_dir=str(tmp_path))
    nc = await mesh.connect("mesh-address-test", role="client")
    try:
        assert nc.is_connected
    finally:
        await nc.close()


@pytest.mark.integration
async def test_connect_with_credentials_answers_on_its_roles_inbox(nats_server, namespace, tmp_path, monkeypatch):
    # The session's server checks no credentials, but the connection is made with them: its
    # requests' replies come back on the role's inbox (what a secured server's permissions allow).
    monkeypatch.setenv("MESH_TEST_PASSWORD", "pw")
    mesh = MeshAddress(nats_url=nats_server.url, namespace=namespace, run_dir=str(tmp_path), credentials={
        "client": credentials("client", namespace, user="alice", password_env="MESH_TEST_PASSWORD")})
    server_side = await MeshAddress(nats_url=nats_server.url, namespace=namespace,
                                    run_dir=str(tmp_path)).connect("responder", role="mesh")
    nc = await mesh.connect("mesh-address-client", role="client")
    try:
        reply_subjects: list[str] = []

        async def answer(msg) -> None:
            reply_subjects.append(msg.reply)
            await msg.respond(b"ok")

        await server_side.subscribe(f"test.{namespace}.ask", cb=answer)
        await flush_to_server(server_side)
        assert (await nc.request(f"test.{namespace}.ask", b"", timeout=10)).data == b"ok"
        assert reply_subjects[0].startswith(f"_INBOX.{namespace}.client.")
    finally:
        await nc.close()
        await server_side.close()


@pytest.mark.integration
async def test_connect_as_a_role_it_holds_no_credentials_for_is_refused_before_dialling(tmp_path):
    mesh = MeshAddress(nats_url="nats://127.0.0.1:1", namespace="ns", run_dir=str(tmp_path),
                       credentials={"client": credentials("client")})
    with pytest.raises(BusSecurityError) as raised:
        await mesh.connect("wrong-role", role="mesh")
    assert raised.value.role == "mesh"


@pytest.mark.integration
async def test_connect_to_a_bus_that_is_not_up_fails_or_with_retry_reports_and_keeps_trying(tmp_path):
    mesh = MeshAddress(nats_url="nats://127.0.0.1:1", namespace="ns", run_dir=str(tmp_path),
                       nats=NatsConfig(connect_timeout_s=0.2))
    with pytest.raises(BusConnectError):
        await mesh.connect("no-retry", role="client")
    reports: list[Exception] = []
    tried_twice = asyncio.Event()

    def unreachable(exc: Exception) -> None:
        reports.append(exc)
        if len(reports) == 2:
            tried_twice.set()

    retrying = asyncio.create_task(mesh.connect("retrying", role="client", retry_every_s=0.05,
                                                on_unreachable=unreachable))
    try:
        await asyncio.wait_for(tried_twice.wait(), timeout=30)
        assert not retrying.done()  # still trying: a Serve replica may start before its mesh
        assert all(isinstance(exc, BusConnectError) for exc in reports)
    finally:
        retrying.cancel()
        await asyncio.gather(retrying, return_exceptions=True)


@pytest.mark.integration
async def test_the_dashboards_old_connect_to_mesh_warns_and_connects_through_the_address(
        nats_server, namespace, tmp_path) -> None:
    from rollmesh.dashboard.feed import connect_to_mesh

    mesh = MeshAddress(nats_url=nats_server.url, namespace=namespace, run_dir=str(tmp_path))
    with pytest.warns(DeprecationWarning, match="use MeshAddress.connect") as warned:
        nc = await connect_to_mesh(mesh, name="old-dashboard-caller")
    try:
        assert nc.is_connected
        assert warned[0].filename == __file__
    finally:
        await nc.close()
