"""The CLI on a TLS mesh, as a user runs it: ``rollmesh --config sec.toml up --run-dir R`` with
``deploy/security.toml`` copied beside certificates made by docs/security.md's own commands
(relative paths, mutual TLS), then ``submit``, ``watch``, ``sched status``, ``sandbox run`` and
``down`` from another working directory with nothing but ``--run-dir R``; and a wrong or missing
CA is one clear line on stderr.

Every command is a ``rollmesh`` subprocess. The mesh is one ``rollmesh up`` for the module (NATS
and its own local Ray in a child process, no Serve app: HTTPS Serve is test_security_mesh.py's).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

REPO_ROOT = Path(__file__).resolve().parent.parent
ROLLMESH = [sys.executable, "-m", "rollmesh.cli"]
# Generous: every command starts a Python process on a machine other tests may be loading.
COMMAND_TIMEOUT_S = 240


def rollmesh(args: list[str], *, cwd: Path, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ROLLMESH, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=os.environ.copy())


def make_pki_commands() -> str:
    """The shell block under ``<!-- make-pki ... -->`` in docs/security.md, as written there."""
    text = (REPO_ROOT / "docs" / "security.md").read_text()
    found = re.search(r"<!-- make-pki[^>]*-->\s*```sh\n(.*?)```", text, re.S)
    assert found, "docs/security.md lost its make-pki block"
    return found.group(1)


@dataclass(frozen=True)
class CliMesh:
    site: Path  # the config file, pki/ and secrets/ beside it
    run_dir: Path
    elsewhere: Path  # a working directory that is neither the site nor the run


@pytest.fixture(scope="module")
def cli_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliMesh]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (docs/security.md makes the certificates with it)")
    root = tmp_path_factory.mktemp("cli-tls")
    site, elsewhere = root / "site", root / "elsewhere"
    site.mkdir()
    elsewhere.mkdir()
    shutil.copy(REPO_ROOT / "deploy" / "security.toml", site / "sec.toml")
    made = subprocess.run(["sh", "-e", "-c", make_pki_commands()], cwd=site, capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    (site / "secrets").mkdir()
    (site / "secrets" / "api-key").write_text("sk-not-used-without-serve\n")
    run_dir = root / "run"
    up = rollmesh(["--config", "sec.toml", "up", "--run-dir", str(run_dir), "--no-serve", "--metrics-port", "0",
                   "--timeout", "300"], cwd=site, timeout=360)
    assert up.returncode == 0, up.stdout + up.stderr + (run_dir / "mesh.log").read_text(errors="replace")[-3000:]
    try:
        yield CliMesh(site, run_dir, elsewhere)
    finally:
        if (run_dir / "mesh.json").exists():  # a test below failed before its own `down`
            rollmesh(["down", "--run-dir", str(run_dir), "--timeout", "60"], cwd=elsewhere, timeout=120)


def test_mesh_json_tells_clients_to_dial_tls_and_the_run_config_holds_absolute_paths(cli_mesh: CliMesh) -> None:
    mesh = json.loads((cli_mesh.run_dir / "mesh.json").read_text())
    assert mesh["nats_url"].startswith("tls://127.0.0.1:")
    tls = json.loads((cli_mesh.run_dir / "config.json").read_text())["security"]["nats_tls"]
    assert tls["ca_file"] == str(cli_mesh.site / "pki" / "ca.pem")
    assert tls["cert_file"] == str(cli_mesh.site / "pki" / "client.pem") and tls["verify"] is True


def test_submit_from_another_directory_reaches_the_tls_mesh_with_only_the_run_dir(cli_mesh: CliMesh) -> None:
    submit = rollmesh(["submit", "--run-dir", str(cli_mesh.run_dir), "--task", "molar_mass", "--count", "1",
                       "--wait", "--timeout", "180"], cwd=cli_mesh.elsewhere)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    assert "completed" in submit.stdout
    assert "eof_received" not in submit.stderr


def test_watch_from_the_run_dir_sees_a_rollout_finish(cli_mesh: CliMesh) -> None:
    watch = subprocess.Popen(
        [*ROLLMESH, "watch", "--run-dir", str(cli_mesh.run_dir), "--count", "1", "--timeout", "180"],
        cwd=cli_mesh.elsewhere, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        first = watch.stdout.readline()  # printed once its subscriptions are active on the server
        assert first.startswith("watching rl.") and " on tls://127.0.0.1:" in first, first + watch.stderr.read()
        submit = rollmesh(["submit", "--run-dir", str(cli_mesh.run_dir), "--task", "molar_mass", "--count", "1"],
                          cwd=cli_mesh.elsewhere)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        out, err = watch.communicate(timeout=COMMAND_TIMEOUT_S)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate()
    assert watch.returncode == 0, first + out + err
    assert "completed" in out or "failed" in out


def test_sched_status_and_sandbox_run_as_the_mesh_role_from_the_run_dir(cli_mesh: CliMesh) -> None:
    status = rollmesh(["sched", "status", "--run-dir", str(cli_mesh.run_dir)], cwd=cli_mesh.elsewhere)
    assert status.returncode == 0, status.stdout + status.stderr
    run = rollmesh(["sandbox", "run", "--run-dir", str(cli_mesh.run_dir), "--timeout", "30", "--",
                    "echo", "over tls"], cwd=cli_mesh.elsewhere)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no running mesh found" not in run.stderr  # the mesh's broker, not one in this process
    assert run.stdout.splitlines()[0] == "over tls"


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("other-ca") / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(path))
    return path


# An eval request: a lone training request would add a warning line about unfilled groups.
ONE_EVAL_REQUEST = ["--task", "molar_mass", "--count", "1", "--purpose", "eval"]


def assert_one_error_line(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr  # no asyncio warning, no traceback, no retries logged
    assert lines[0].startswith("rollmesh: error: TLS to the NATS server at tls://127.0.0.1:"), lines[0]
    for text in expected:
        assert text in lines[0]
    return lines[0]


def test_a_wrong_ca_is_one_clear_line_naming_the_ca_setting(cli_mesh: CliMesh, other_ca: Path) -> None:
    # --config sets [security.nats_tls], so it wins over the run's; its relative path is beside it.
    shutil.copy(other_ca, cli_mesh.site / "other-ca.pem")
    (cli_mesh.site / "wrong-ca.toml").write_text('[security.nats_tls]\nenabled = true\nca_file = "other-ca.pem"\n')
    submit = rollmesh(["--config", str(cli_mesh.site / "wrong-ca.toml"), "submit", "--run-dir", str(cli_mesh.run_dir),
                       *ONE_EVAL_REQUEST], cwd=cli_mesh.elsewhere)
    assert_one_error_line(submit, "certificate verify failed",
                          f"security.nats_tls.ca_file ({cli_mesh.site / 'other-ca.pem'})")


def test_no_ca_is_one_clear_line_saying_to_set_it(cli_mesh: CliMesh) -> None:
    url = json.loads((cli_mesh.run_dir / "mesh.json").read_text())["nats_url"]
    submit = rollmesh(["submit", "--nats-url", url, "--namespace", "default", *ONE_EVAL_REQUEST],
                      cwd=cli_mesh.elsewhere)
    assert_one_error_line(submit, "certificate verify failed", "security.nats_tls.ca_file is not set")


def test_a_client_without_a_certificate_is_one_line_naming_the_certificate_settings(cli_mesh: CliMesh) -> None:
    # The right CA but no client certificate: the server (verify = true) refuses the handshake.
    (cli_mesh.site / "no-cert.toml").write_text('[security.nats_tls]\nenabled = true\nca_file = "pki/ca.pem"\n')
    submit = rollmesh(["--config", str(cli_mesh.site / "no-cert.toml"), "submit", "--run-dir", str(cli_mesh.run_dir),
                       *ONE_EVAL_REQUEST], cwd=cli_mesh.elsewhere)
    assert_one_error_line(submit, "it refused this client", "security.nats_tls.cert_file and key_file")


def test_down_from_the_run_dir_stops_the_mesh(cli_mesh: CliMesh) -> None:
    down = rollmesh(["down", "--run-dir", str(cli_mesh.run_dir), "--timeout", "90"], cwd=cli_mesh.elsewhere,
                    timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "mesh stopped" in down.stdout
    assert not (cli_mesh.run_dir / "mesh.json").exists()
