"""What a local Ray that rollmesh starts is given, without starting one: its token file (new,
random, this user's only), the ``ray.node_ip_address`` key, the ``ray.init`` options, and the
environment for a process that starts or joins it (``ray start``, the benchmarks' children).
tests/test_ray_loopback.py starts a real one."""

from __future__ import annotations

import os
import stat

import pytest

from rollmesh.config import ConfigError, load_config
from rollmesh.local_ray import RAY_AUTH_TOKEN_FILE, LocalRayEnvironment, write_ray_auth_token

pytestmark = pytest.mark.unit


def test_the_token_file_is_new_random_and_readable_by_this_user_only(tmp_path):
    stale = tmp_path / RAY_AUTH_TOKEN_FILE
    stale.write_text("left by an earlier start")
    stale.chmod(0o644)
    first = write_ray_auth_token(tmp_path)
    token = first.read_text()
    assert first == stale and stat.S_IMODE(first.stat().st_mode) == 0o600
    assert len(token) == 64 and int(token, 16) >= 0  # 32 random bytes in hex, as Ray makes them
    assert write_ray_auth_token(tmp_path).read_text() != token


def test_ray_node_ip_address_defaults_to_loopback_and_takes_another_address():
    assert load_config(None, environ={}).ray.node_ip_address == "127.0.0.1"
    assert load_config(None, environ={"ROLLMESH_RAY__NODE_IP_ADDRESS": "10.0.0.5"}).ray.node_ip_address == "10.0.0.5"
    assert load_config(None, environ={}, overrides={"ray.node_ip_address": ""}).ray.node_ip_address == ""


def test_ray_node_ip_address_that_is_not_an_address_is_a_config_error():
    with pytest.raises(ConfigError, match="ray.node_ip_address: 'my-laptop' is not an IP address"):
        load_config(None, environ={}, overrides={"ray.node_ip_address": "my-laptop"})


def test_ray_init_is_given_the_node_ip_only_when_one_is_set(tmp_path):
    token = tmp_path / RAY_AUTH_TOKEN_FILE
    assert LocalRayEnvironment(token_file=token, node_ip_address="127.0.0.1").init_options() == {
        "_node_ip_address": "127.0.0.1"}
    assert LocalRayEnvironment(token_file=token, node_ip_address="").init_options() == {}


def test_a_subprocess_env_turns_token_auth_on_with_the_file_whatever_the_environment_said(tmp_path, monkeypatch):
    token = write_ray_auth_token(tmp_path)
    monkeypatch.chdir(tmp_path)  # a relative token path is given to Ray absolute
    environ = {"PATH": "/usr/bin", "RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "another"}
    env = LocalRayEnvironment(token_file=RAY_AUTH_TOKEN_FILE, node_ip_address="127.0.0.1").subprocess_env(environ)
    assert env == {"PATH": "/usr/bin", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token.resolve()),
                   "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    assert environ == {"PATH": "/usr/bin", "RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "another"}


def test_a_subprocess_env_starts_from_this_process_environment_and_leaves_it_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("ROLLMESH_TEST_MARK", "kept")
    env = LocalRayEnvironment(token_file=tmp_path / RAY_AUTH_TOKEN_FILE, node_ip_address="::1").subprocess_env()
    assert env["ROLLMESH_TEST_MARK"] == "kept" and env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert os.environ["RAY_AUTH_MODE"] == "disabled"


def test_a_subprocess_env_leaves_the_loopback_switch_alone_for_another_node_ip(tmp_path):
    token = tmp_path / RAY_AUTH_TOKEN_FILE
    for node_ip in ("192.0.2.2", ""):
        env = LocalRayEnvironment(token_file=token, node_ip_address=node_ip).subprocess_env({})
        assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}


@pytest.mark.parametrize(("node_ip", "bound"), [("127.0.0.1", "127.0.0.1:0"), ("::1", "[::1]:0"),
                                                ("192.0.2.2", "[::]:0")])
def test_a_serve_replica_binds_its_grpc_server_to_a_loopback_node_ip_only(monkeypatch, node_ip, bound):
    import ray
    from ray.serve._private import replica

    from rollmesh.serve_apps.replica_loopback import keep_replica_grpc_on_loopback

    calls = []
    monkeypatch.setattr(replica, "add_port_to_grpc_server", lambda server, address: calls.append(address) or 1)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: node_ip)
    assert keep_replica_grpc_on_loopback() == (bound != "[::]:0")
    assert keep_replica_grpc_on_loopback() == (bound != "[::]:0")  # a second replica: not wrapped twice
    replica.add_port_to_grpc_server(None, "[::]:0")
    assert calls == [bound]
