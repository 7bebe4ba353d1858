"""The whole mesh with ``security.enabled``: every actor connects as its own NATS role over mutual
TLS to the embedded server, a client completes a rollout, and the HTTPS Serve app wants its key.

Certificates come from ``trustme``; the per-role nkeys are the ones the launcher generates into the
run directory. Uses the session's local Ray (tests/conftest.py); the mesh gets its own embedded,
secured nats-server rather than the session's open one.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio
import trustme

from conftest import REPO_ROOT
from rollmesh.bus.connection import connect_bus
from rollmesh.bus.errors import BusConnectError
from rollmesh.bus.security import BusCredentials
from rollmesh.bus.tls import client_tls_context
from rollmesh.config import NatsCredentialsConfig, NatsTlsConfig
from test_serve_app import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

API_KEY = "sk-secured-" + uuid.uuid4().hex


@dataclass
class SecuredMesh:
    mesh: object
    info: object
    client_tls: NatsTlsConfig
    ca_file: str

    @property
    def run_dir(self) -> Path:
        return Path(self.info.run_dir)

    def client_credentials(self) -> BusCredentials:
        seed = self.run_dir / "security" / "client.nk"
        return BusCredentials("client", self.info.namespace, NatsCredentialsConfig(nkey_seed_file=str(seed)))


@pytest_asyncio.fixture(scope="module")
async def secured_mesh(ray_session: None) -> AsyncIterator[SecuredMesh]:
    from rollmesh.config import load_config
    from rollmesh.launcher import Mesh
    from rollmesh.mesh_address import new_run_dir

    run_dir = new_run_dir(REPO_ROOT / ".rollmesh" / "test-runs")
    pki = run_dir / "pki"
    pki.mkdir()
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(pki / "ca.pem"))
    for name, identity in (("server", "127.0.0.1"), ("mesh", "rollmesh-mesh@example.org")):
        issued = ca.issue_cert(identity)
        issued.cert_chain_pems[0].write_to_path(str(pki / f"{name}.pem"))
        issued.private_key_pem.write_to_path(str(pki / f"{name}.key"))
    nats_tls = NatsTlsConfig(enabled=True, ca_file=str(pki / "ca.pem"), cert_file=str(pki / "mesh.pem"),
                             key_file=str(pki / "mesh.key"), server_cert_file=str(pki / "server.pem"),
                             server_key_file=str(pki / "server.key"), verify=True)
    api_key_file = run_dir / "api-key"
    api_key_file.write_text(API_KEY)
    config = load_config(environ={}, overrides={
        "namespace": "secmesh" + uuid.uuid4().hex[:8],
        "security.enabled": True,
        "security.nats_tls": {field: getattr(nats_tls, field) for field in nats_tls.__struct_fields__},
        "serve.enabled": True, "serve.port": free_port(), "serve.api_key_file": str(api_key_file),
        "serve.tls_cert_file": str(pki / "server.pem"), "serve.tls_key_file": str(pki / "server.key"),
        "trainer.n_samples_per_prompt": 2, "trainer.groups_per_step": 1,
        # No declared accelerators: the session's mesh may hold them all.
        "scheduler.total_gpus": 0, "scheduler.grants": {},
    })
    mesh = Mesh(config, run_dir=run_dir)
    info = await mesh.start()
    try:
        yield SecuredMesh(mesh, info, nats_tls, str(pki / "ca.pem"))
    finally:
        await mesh.stop()


async def test_a_rollout_completes_with_every_role_on_its_own_credentials_over_mutual_tls(
    secured_mesh: SecuredMesh,
) -> None:
    namespace = secured_mesh.info.namespace
    nc = await connect_bus(secured_mesh.info.nats_url, name="secured-client",
                           credentials=secured_mesh.client_credentials(),
                           tls=client_tls_context(secured_mesh.client_tls))
    results: dict[str, dict] = {}
    arrived = asyncio.Event()

    async def on_result(msg) -> None:
        body = json.loads(msg.data)
        results[body["rollout_id"]] = body
        arrived.set()

    rollout_id = "secured-" + uuid.uuid4().hex[:8]
    try:
        for event in ("completed", "failed"):
            await nc.subscribe(f"rl.{namespace}.rollout.{event}", cb=on_result)
        request = {"rollout_id": rollout_id, "task": "molar_mass", "task_input": {"formula": "H2O"},
                   "sampling": {"temperature": 1.0, "max_new_tokens": 24}}
        await nc.jetstream().publish(f"rl.{namespace}.rollout.requested", json.dumps(request).encode(),
                                     timeout=10)
        await asyncio.wait_for(arrived.wait(), 120)
    finally:
        await nc.close()
    assert results[rollout_id]["type"] == "rollout.completed", results[rollout_id]


async def test_the_secured_mesh_refuses_a_client_without_credentials(secured_mesh: SecuredMesh) -> None:
    with pytest.raises(BusConnectError):
        await asyncio.wait_for(connect_bus(secured_mesh.info.nats_url, name="anonymous", connect_timeout_s=2,
                                           tls=client_tls_context(secured_mesh.client_tls)), 20)


def test_the_https_api_wants_its_key_in_the_openai_error_shape(secured_mesh: SecuredMesh) -> None:
    url = secured_mesh.info.serve_url
    assert url.startswith("https://")
    with httpx.Client(base_url=url, verify=ssl.create_default_context(cafile=secured_mesh.ca_file), timeout=60) as http:
        missing = http.get("/v1/models")
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        right = http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    for refused in (missing, wrong):
        assert refused.status_code == 401
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert API_KEY not in refused.text
    assert right.status_code == 200 and right.json()["data"]


def test_the_official_openai_client_works_with_the_key_over_https(secured_mesh: SecuredMesh) -> None:
    with httpx.Client(verify=ssl.create_default_context(cafile=secured_mesh.ca_file), timeout=60) as http:
        client = openai.OpenAI(base_url=f"{secured_mesh.info.serve_url}/v1", api_key=API_KEY,
                               http_client=http, max_retries=0)
        completion = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=4, temperature=0.0,
            messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{secured_mesh.info.serve_url}/v1", api_key="sk-wrong",
                          http_client=http, max_retries=0).models.list()
    assert completion.choices[0].message.content is not None


def test_the_dashboard_follows_the_secured_bus_on_its_own_watch_only_role(secured_mesh: SecuredMesh) -> None:
    assert secured_mesh.info.dashboard_url.startswith(secured_mesh.info.serve_url)
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=secured_mesh.info.serve_url, timeout=30,
                      verify=ssl.create_default_context(cafile=secured_mesh.ca_file)) as http:
        while True:
            state = http.get("/dashboard/state", headers={"Authorization": f"Bearer {API_KEY}"})
            assert state.status_code == 200, state.text
            if state.json()["feed"] == "connected":
                break
            assert time.monotonic() < deadline, f"the dashboard's feed is {state.json()['feed']!r}"
            time.sleep(0.5)


def test_no_secret_reaches_a_log_trace_or_file_of_the_run(secured_mesh: SecuredMesh) -> None:
    """Every NATS seed, the API key and the TLS private keys, searched for in everything the run
    wrote (logs, traces, config, nats-server's files) and in the Ray workers' logs, after the
    tests above ran rollouts, refused clients and answered 401s."""
    import ray

    run_dir = secured_mesh.run_dir
    secrets = {API_KEY} | {path.read_text().strip() for path in (run_dir / "security").glob("*.nk")}
    secrets |= {"".join(path.read_text().splitlines()[1:-1]) for path in (run_dir / "pki").glob("*.key")}
    secrets |= {line for path in (run_dir / "pki").glob("*.key") for line in path.read_text().splitlines()[1:-1]}
    assert len([s for s in secrets if s.startswith("SU")]) >= 9  # a user seed per NATS role
    holders = {run_dir / "security", run_dir / "pki", run_dir / "api-key"}  # where they are kept
    searched = [path for path in run_dir.rglob("*") if path.is_file()
                and not any(path == holder or holder in path.parents for holder in holders)]
    logs_dir = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    searched += [path for path in logs_dir.rglob("*") if path.is_file() and path.suffix in (".log", ".out", ".err")]
    assert any(path.name.startswith("worker-") for path in searched)  # the actors' own output
    for path in searched:
        text = path.read_bytes().decode("utf-8", "replace")
        for secret in secrets:
            assert secret not in text, f"a secret appears in {path}"
