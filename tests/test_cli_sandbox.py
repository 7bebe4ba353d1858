"""``rollmesh sandbox``: the exit-code mapping and result line, and the commands end to end as
subprocesses against a broker served on the session's nats-server (its runtime is the fake one,
so the commands' own path is what is tested: bus, chunks, streaming, exit codes)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.fakes import FakeSandboxBackend

from rollmesh.sandbox.broker_logic import SandboxBrokerLogic
from rollmesh.actors.shell import ActorShell
from rollmesh.mesh_address import MeshAddress
from rollmesh.cli.sandbox import exit_status, result_line
from rollmesh.config import SandboxConfig, SandboxProfileConfig, TelemetryConfig
from rollmesh.messages import SandboxExecReply
from rollmesh.sandbox import SandboxBroker
from rollmesh.sandbox.sandbox_protocol import ExecOutcome


@pytest.mark.unit
@pytest.mark.parametrize("reply, code", [
    (SandboxExecReply(result="exit", exit_code=0), 0),
    (SandboxExecReply(result="exit", exit_code=3), 3),
    (SandboxExecReply(result="timeout", signal=9), 124),
    (SandboxExecReply(result="signal", signal=15), 143),
    (SandboxExecReply(result="oom", signal=9), 137),
    (SandboxExecReply(result="oom"), 137),
    (SandboxExecReply(result="output_truncated", truncated=True, signal=9), 137),
    (SandboxExecReply(result="sandbox_died"), 125),
    (SandboxExecReply(result="infra_error"), 125),
    (SandboxExecReply(error_kind="unknown_lease"), 125),
])
def test_run_exits_like_the_command_and_125_when_the_sandbox_failed(reply, code):
    assert exit_status(reply) == code


@pytest.mark.unit
def test_the_result_line_is_one_json_object_with_exactly_the_typed_fields():
    line = result_line(SandboxExecReply(result="signal", signal=15, duration_s=0.25, stdout=b"x"))
    assert json.loads(line) == {"result": "signal", "exit_code": None, "signal": 15, "truncated": False,
                                "duration_s": 0.25}
    assert "\n" not in line


@pytest.fixture
async def broker_on_bus(nats_server, namespace, tmp_path, trace_file):
    backend = FakeSandboxBackend()
    shell = ActorShell("sandbox-broker-cli", MeshAddress(nats_url=nats_server.url, namespace=namespace,
                                                         run_dir=str(tmp_path), telemetry=TelemetryConfig(exporter="jsonl")))
    publisher = await shell.connect()
    config = SandboxConfig(profiles={"default": SandboxProfileConfig(warm_min=0)})  # few sandboxes to look at
    broker = SandboxBroker(config, backend, snapshot_dir=tmp_path / "snapshots", publisher=publisher)
    await shell.serve(SandboxBrokerLogic(broker))
    yield backend, broker
    await shell.stop()


async def rollmesh(nats_server, namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    target = [args[0], args[1], "--nats-url", nats_server.url, "--namespace", namespace, *args[2:]]
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "rollmesh.cli", *target], capture_output=True, text=True,
        timeout=60)


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_lease_put_run_get_release_from_the_command_line(broker_on_bus, nats_server, namespace,
                                                                tmp_path: Path):
    backend, broker = broker_on_bus
    leased = await rollmesh(nats_server, namespace, "sandbox", "lease", "--ttl", "60")
    assert leased.returncode == 0, leased.stderr
    lease_id = leased.stdout.strip()

    local = tmp_path / "in.txt"
    local.write_text("hello from the host\n")
    put = await rollmesh(nats_server, namespace, "sandbox", "put", "--lease", lease_id, str(local), "data/in.txt")
    assert put.returncode == 0, put.stderr
    assert json.loads(put.stdout)["size"] == len("hello from the host\n")
    # The leased sandbox is the one holding the file (demand may have warmed a spare meanwhile).
    (sandbox,) = [created for created in backend.created if "data/in.txt" in created.files]
    assert sandbox.files["data/in.txt"] == b"hello from the host\n"

    ran = await rollmesh(nats_server, namespace, "sandbox", "run", "--lease", lease_id, "--", "cat", "data/in.txt")
    assert ran.returncode == 0, ran.stderr
    *output, last = ran.stdout.splitlines()
    assert output == ["hello from the host"]  # streamed once, not printed again from the reply
    assert json.loads(last) == {"result": "exit", "exit_code": 0, "signal": None, "truncated": False,
                                "duration_s": 0.01}

    backend.outcomes.append(ExecOutcome("timeout", None, 9, False, b"", b"", 3.0))
    timed_out = await rollmesh(nats_server, namespace, "sandbox", "run", "--lease", lease_id, "--timeout", "3",
                               "--", "sleep", "60")
    assert timed_out.returncode == 124, timed_out.stderr
    assert json.loads(timed_out.stdout.splitlines()[-1])["result"] == "timeout"
    assert sandbox.execs[-1]["timeout_s"] == 3.0

    backend.outcomes.append(ExecOutcome("output_truncated", None, 9, True, b"yyyy", b"", 0.1))
    cut = await rollmesh(nats_server, namespace, "sandbox", "run", "--lease", lease_id, "--", "yes")
    assert cut.returncode == 137 and "[rollmesh: output truncated" in cut.stderr
    assert json.loads(cut.stdout.splitlines()[-1])["truncated"] is True

    sandbox.files["out/result.bin"] = bytes(range(256))
    got = await rollmesh(nats_server, namespace, "sandbox", "get", "--lease", lease_id, "out/result.bin",
                         str(tmp_path / "result.bin"))
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "result.bin").read_bytes() == bytes(range(256))
    # Above sandbox.bulk_threshold_bytes, both ways go over the broker's bulk stream.
    large = tmp_path / "large.bin"
    large.write_bytes(bytes(range(256)) * 1024)
    put = await rollmesh(nats_server, namespace, "sandbox", "put", "--lease", lease_id, str(large), "large.bin")
    assert put.returncode == 0 and sandbox.files["large.bin"] == large.read_bytes(), put.stderr
    got = await rollmesh(nats_server, namespace, "sandbox", "get", "--lease", lease_id, "large.bin",
                         str(tmp_path / "back.bin"))
    assert got.returncode == 0 and (tmp_path / "back.bin").read_bytes() == large.read_bytes(), got.stderr
    assert (broker.counts["bulk_uploads"], broker.counts["bulk_downloads"]) == (1, 1)

    released = await rollmesh(nats_server, namespace, "sandbox", "release", lease_id)
    assert released.returncode == 0, released.stderr
    assert sandbox.destroyed
    gone = await rollmesh(nats_server, namespace, "sandbox", "run", "--lease", lease_id, "--", "true")
    assert gone.returncode == 125
    assert json.loads(gone.stdout.splitlines()[-1])["result"] == "infra_error"
    assert "unknown_lease" in gone.stderr


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_run_without_a_mesh_uses_a_broker_in_its_own_process(tmp_path: Path):
    ran = subprocess.run(
        [sys.executable, "-m", "rollmesh.cli", "--run-root", str(tmp_path / "no-runs"), "sandbox", "run",
         "--", "sh", "-c", "echo streamed; kill -TERM $$"],
        capture_output=True, text=True, timeout=50)
    assert "broker in this process" in ran.stderr
    *output, last = ran.stdout.splitlines()
    assert output == ["streamed"]
    assert json.loads(last)["result"] == "signal" and json.loads(last)["signal"] == 15
    assert ran.returncode == 143, ran.stderr
