"""How a command reaches a mesh found from its run directory: the mesh's own TLS settings and
credentials unless ``--config`` sets them; ``tls://`` in mesh.json; one line for a TLS failure.

Plain logic (``find_mesh`` on run directories written here, messages, the asyncio log filter);
no server. The same against a real secured mesh: tests/test_security_cli.py.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from rollmesh.bus.errors import BusTlsError
from rollmesh.cli import build_parser
from rollmesh.cli.target import (
    find_mesh,
    load_cli_config,
    quiet_asyncio_ssl_warning,
    tls_failure_message,
)
from rollmesh.config import NatsTlsConfig, load_config, save_run_config
from rollmesh.mesh_address import MeshAddress, nats_url_for_clients, write_mesh_address

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

RUN_TLS = NatsTlsConfig(enabled=True, ca_file="/srv/pki/ca.pem", cert_file="/srv/pki/mesh.pem",
                        key_file="/srv/pki/mesh.key", server_cert_file="/srv/pki/server.pem",
                        server_key_file="/srv/pki/server.key", verify=True)


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A secured mesh's run directory as the launcher leaves it: mesh.json, config.json, the
    generated role keys. The working directory is elsewhere, and no ROLLMESH_* variable leaks in."""
    for name in [name for name in os.environ if name.startswith("ROLLMESH_")]:
        monkeypatch.delenv(name)
    run = tmp_path / "runs" / "20300101-000000-abcdef"
    (run / "security").mkdir(parents=True)
    for role in ("client", "mesh"):
        (run / "security" / f"{role}.nk").write_text("SU...not read here\n")
    config = load_config(environ={}, overrides={
        "namespace": "secured", "security.enabled": True, "nats.replicas": 3,
        "security.nats_tls": {field: getattr(RUN_TLS, field) for field in RUN_TLS.__struct_fields__}})
    save_run_config(run, config)
    write_mesh_address(MeshAddress(nats_url="tls://127.0.0.1:4321", namespace="secured", run_dir=str(run), pid=1))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return run


SUBMIT = ["submit", "--task", "molar_mass"]


def target_for(argv: list[str], *, role: str = "client"):
    args = build_parser().parse_args(argv)
    return find_mesh(args, load_cli_config(args), role=role)


def seed_file(target, role: str) -> str:
    """The nkey seed file ``target`` connects as ``role`` with (its only credentials)."""
    assert list(target.credentials) == [role]
    return target.credentials_for(role).source.nkey_seed_file


def test_a_mesh_found_from_its_run_dir_brings_its_tls_and_generated_keys(run_dir: Path) -> None:
    target = target_for([*SUBMIT, "--run-dir", str(run_dir)])
    assert target.nats_url == "tls://127.0.0.1:4321" and target.namespace == "secured"
    assert target.nats_tls == RUN_TLS
    assert seed_file(target, "client") == str(run_dir / "security" / "client.nk")
    assert target.nats.replicas == 3  # the run's streams' replicas, not the defaults' 1
    sched = target_for(["sched", "status", "--run-dir", str(run_dir)], role="mesh")
    assert seed_file(sched, "mesh") == str(run_dir / "security" / "mesh.nk")
    assert sched.nats_tls == RUN_TLS


def test_the_latest_run_brings_its_tls_too(run_dir: Path) -> None:
    target = target_for(["--run-root", str(run_dir.parent), "watch"])
    assert target.run_dir == str(run_dir) and target.nats_tls == RUN_TLS


def test_a_config_that_sets_tls_wins_for_tls_with_its_paths_beside_it(run_dir: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine" / "client.toml"
    mine.parent.mkdir()
    mine.write_text('[security.nats_tls]\nenabled = true\nca_file = "pki/other-ca.pem"\n')
    target = target_for(["--config", str(mine), *SUBMIT, "--run-dir", str(run_dir)])
    assert target.nats_tls == NatsTlsConfig(enabled=True, ca_file=str(mine.parent / "pki/other-ca.pem"))
    # It set no credentials: the run's generated key is still used.
    assert seed_file(target, "client") == str(run_dir / "security" / "client.nk")


def test_a_config_that_leaves_tls_alone_does_not_turn_it_off(run_dir: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.toml"
    tasks.write_text('[rollout]\ntasks = ["rollmesh.rollout.molar_mass:MolarMassTask"]\n')
    target = target_for(["--config", str(tasks), *SUBMIT, "--run-dir", str(run_dir)])
    assert target.nats_tls == RUN_TLS


def test_a_config_with_the_roles_credentials_wins_for_them(run_dir: Path, tmp_path: Path) -> None:
    mine = tmp_path / "client.toml"
    mine.write_text('[security]\nenabled = true\n[security.credentials.client]\ncreds_file = "me.creds"\n')
    target = target_for(["--config", str(mine), *SUBMIT, "--run-dir", str(run_dir)])
    assert target.credentials_for("client").source.creds_file == str(tmp_path / "me.creds")
    assert target.nats_tls == RUN_TLS


def test_a_run_without_config_json_falls_back_to_the_cli_config(run_dir: Path) -> None:
    (run_dir / "config.json").unlink()
    target = target_for([*SUBMIT, "--run-dir", str(run_dir)])
    assert target.nats_tls == NatsTlsConfig()
    assert seed_file(target, "client") == str(run_dir / "security" / "client.nk")


def test_nats_url_names_no_run_so_only_the_config_counts(run_dir: Path) -> None:
    target = target_for([*SUBMIT, "--nats-url", "tls://127.0.0.1:4321", "--namespace", "secured"])
    assert target.nats_tls == NatsTlsConfig() and not target.secured


def test_clients_are_told_tls_when_the_mesh_speaks_it() -> None:
    assert nats_url_for_clients("nats://127.0.0.1:4222", tls=True) == "tls://127.0.0.1:4222"
    assert nats_url_for_clients("nats://a:4222, nats://b:4222,tls://c:4222", tls=True) == \
        "tls://a:4222,tls://b:4222,tls://c:4222"
    assert nats_url_for_clients("nats://127.0.0.1:4222", tls=False) == "nats://127.0.0.1:4222"


def tls_error(reason: str, *, verify_failed: bool) -> BusTlsError:
    return BusTlsError("cannot connect", url="tls://127.0.0.1:1", reason=reason, verify_failed=verify_failed)


@pytest.mark.parametrize(("error", "tls", "says"), [
    (tls_error("certificate verify failed: unable to get local issuer certificate", verify_failed=True),
     NatsTlsConfig(enabled=True, ca_file="/x/ca.pem"), "security.nats_tls.ca_file (/x/ca.pem) is not the CA"),
    (tls_error("certificate verify failed: unable to get local issuer certificate", verify_failed=True),
     NatsTlsConfig(), "security.nats_tls.ca_file is not set"),
    (tls_error("certificate verify failed: IP address mismatch, certificate is not valid for '127.0.0.1'.",
               verify_failed=True), NatsTlsConfig(enabled=True, ca_file="/x/ca.pem"), "subjectAltName"),
    (tls_error("tlsv13 alert certificate required", verify_failed=False),
     NatsTlsConfig(enabled=True, ca_file="/x/ca.pem"), "security.nats_tls.cert_file and key_file"),
], ids=["wrong-ca", "no-ca", "san", "no-client-cert"])
def test_a_tls_failure_is_one_line_naming_the_setting_to_fix(error, tls, says) -> None:
    message = tls_failure_message(error, tls, "tls://127.0.0.1:1")
    assert says in message and error.reason in message
    assert "\n" not in message


def test_only_asyncios_eof_received_ssl_warning_is_silenced(caplog: pytest.LogCaptureFixture) -> None:
    quiet_asyncio_ssl_warning()
    quiet_asyncio_ssl_warning()  # once per process, however often it is called
    asyncio_logger = logging.getLogger("asyncio")
    assert len(asyncio_logger.filters) == len(set(map(type, asyncio_logger.filters)))
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        asyncio_logger.warning("returning true from eof_received() has no effect when using ssl")
        asyncio_logger.warning("Task was destroyed but it is pending!")
    assert [record.getMessage() for record in caplog.records] == ["Task was destroyed but it is pending!"]
