"""Security file paths in config: relative to the config file, absolute in the run's config.json.

Plain logic through the real loader (``load_config``, ``save_run_config``, ``load_run_config``);
no server. Also that ``deploy/security.toml``, the example to copy, loads.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from rollmesh.config import (
    DEFAULT_CONFIG_PATH,
    NatsCredentialsConfig,
    NatsTlsConfig,
    ServeConfig,
    load_config,
    load_run_config,
    save_run_config,
)
from rollmesh.config_paths import CREDENTIALS_PATH_FIELDS, SECURITY_PATH_FIELDS

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REPO_ROOT = Path(__file__).resolve().parent.parent

RELATIVE = """
[security]
enabled = true

[security.nats_tls]
enabled = true
ca_file = "pki/ca.pem"
cert_file = "pki/client.pem"
key_file = "pki/client.key"
server_cert_file = "pki/server.pem"
server_key_file = "pki/server.key"
verify = true

[security.credentials.client]
creds_file = "creds/client.creds"
[security.credentials.trainer]
nkey_seed_file = "../shared/trainer.nk"
[security.credentials.scheduler]
user = "scheduler"
password_file = "secrets/scheduler.password"
[security.credentials.mesh]
nkey_seed_env = "ROLLMESH_NATS_MESH_SEED"

[serve]
api_key_file = "secrets/api-key"
tls_cert_file = "pki/server.pem"
tls_key_file = "pki/server.key"
"""


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``RELATIVE`` in ``site/sec.toml``, loaded from another working directory."""
    site = tmp_path / "site"
    site.mkdir()
    path = site / "sec.toml"
    path.write_text(RELATIVE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return path


def path_values(config) -> dict[str, str]:
    tls, serve, credentials = config.security.nats_tls, config.serve, config.security.credentials
    return {
        **{name: getattr(tls, name) for name in ("ca_file", "cert_file", "key_file", "server_cert_file",
                                                 "server_key_file")},
        **{f"serve.{name}": getattr(serve, name) for name in ("api_key_file", "tls_cert_file", "tls_key_file")},
        "client.creds_file": credentials["client"].creds_file,
        "trainer.nkey_seed_file": credentials["trainer"].nkey_seed_file,
        "scheduler.password_file": credentials["scheduler"].password_file,
    }


def test_relative_security_paths_are_relative_to_the_config_files_directory(config_file: Path) -> None:
    site = config_file.parent.absolute()
    config = load_config(config_file, environ={})
    assert path_values(config) == {
        "ca_file": str(site / "pki/ca.pem"), "cert_file": str(site / "pki/client.pem"),
        "key_file": str(site / "pki/client.key"), "server_cert_file": str(site / "pki/server.pem"),
        "server_key_file": str(site / "pki/server.key"),
        "serve.api_key_file": str(site / "secrets/api-key"), "serve.tls_cert_file": str(site / "pki/server.pem"),
        "serve.tls_key_file": str(site / "pki/server.key"),
        "client.creds_file": str(site / "creds/client.creds"),
        "trainer.nkey_seed_file": str(site / "../shared/trainer.nk"),
        "scheduler.password_file": str(site / "secrets/scheduler.password"),
    }
    # Not paths: left as they were.
    assert config.security.credentials["mesh"].nkey_seed_env == "ROLLMESH_NATS_MESH_SEED"
    assert config.security.credentials["scheduler"].user == "scheduler"


def test_a_config_file_named_relatively_resolves_against_its_own_directory(
    config_file: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(config_file.parent.parent)
    config = load_config(Path("site/sec.toml"), environ={})
    assert config.security.nats_tls.ca_file == str(config_file.parent.absolute() / "pki/ca.pem")


def test_absolute_and_home_paths_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "sec.toml"
    path.write_text('[security.nats_tls]\nenabled = true\nca_file = "/etc/pki/ca.pem"\n'
                    'cert_file = "~/pki/me.pem"\nkey_file = "~/pki/me.key"\n')
    tls = load_config(path, environ={}).security.nats_tls
    assert tls.ca_file == "/etc/pki/ca.pem"
    assert (tls.cert_file, tls.key_file) == (str(tmp_path / "home/pki/me.pem"), str(tmp_path / "home/pki/me.key"))
    assert tls.server_cert_file == ""  # unset stays unset


def test_paths_from_the_environment_and_overrides_are_relative_to_the_working_directory(
    config_file: Path,
) -> None:
    cwd = Path.cwd()
    config = load_config(config_file, environ={"ROLLMESH_SECURITY__NATS_TLS__CA_FILE": "env/ca.pem"},
                         overrides={"serve.api_key_file": "cli/api-key"})
    assert config.security.nats_tls.ca_file == str(cwd / "env/ca.pem")
    assert config.serve.api_key_file == str(cwd / "cli/api-key")
    # The file's own paths still resolve against the file.
    assert config.security.nats_tls.cert_file == str(config_file.parent.absolute() / "pki/client.pem")


def test_the_run_config_keeps_them_absolute_for_commands_run_anywhere(
    config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = load_config(config_file, environ={})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_run_config(run_dir, config)
    monkeypatch.chdir(tmp_path)  # yet another working directory
    assert path_values(load_run_config(run_dir)) == path_values(config)
    assert all(Path(value).is_absolute() for value in path_values(config).values())


def test_every_file_field_of_the_security_settings_is_resolved() -> None:
    """A new ``*_file`` field in the TLS, credentials or serve config must be listed in
    rollmesh/config_paths.py, or it would silently stay relative to the working directory."""
    tls = {f"security.nats_tls.{name}" for name in NatsTlsConfig.__struct_fields__ if name.endswith("_file")}
    serve = {f"serve.{name}" for name in ServeConfig.__struct_fields__ if name.endswith("_file")}
    assert tls | serve == set(SECURITY_PATH_FIELDS)
    assert {name for name in NatsCredentialsConfig.__struct_fields__ if name.endswith("_file")} == set(
        CREDENTIALS_PATH_FIELDS)


def test_the_deploy_security_example_loads_with_paths_beside_it(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    deploy = REPO_ROOT / "deploy"
    config = load_config(deploy / "security.toml", environ={})
    tls = config.security.nats_tls
    assert config.security.enabled and tls.enabled and tls.verify
    assert (tls.ca_file, tls.cert_file, tls.key_file, tls.server_cert_file, tls.server_key_file) == tuple(
        str(deploy / "pki" / name) for name in ("ca.pem", "client.pem", "client.key", "server.pem", "server.key"))
    assert config.serve.enabled and config.serve.host == "127.0.0.1"
    assert config.serve.api_key_file == str(deploy / "secrets" / "api-key")
    assert (config.serve.tls_cert_file, config.serve.tls_key_file) == (tls.server_cert_file, tls.server_key_file)


def test_the_deploy_security_example_is_the_local_config_with_security_on() -> None:
    """Everything but [security] and [serve] as the packaged defaults have it: copying the example
    changes nothing else about the mesh."""
    secured = load_config(REPO_ROOT / "deploy" / "security.toml", environ={})
    local = load_config(DEFAULT_CONFIG_PATH, environ={})
    plain = msgspec.structs.replace(secured, security=local.security, serve=local.serve)
    assert plain == local
    assert secured.serve.port == local.serve.port
