"""A mesh started with OTLP chosen only by OTEL_EXPORTER_OTLP_ENDPOINT, stopped, and resumed
without the variable, still exports its rollouts' spans to that endpoint.

The mesh runs as ``rollmesh up`` / ``up --resume`` / ``submit`` / ``down`` subprocesses; spans
arrive at the OTLP/HTTP receiver of tests/test_telemetry_otlp_mesh.py, in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_telemetry_otlp_mesh import _Receiver, receiver  # noqa: F401 (receiver: a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROLLMESH = [sys.executable, "-m", "rollmesh.cli"]
SPANS_TIMEOUT_S = 60.0


def run(args: list[str], env: dict[str, str], *, timeout: float, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ROLLMESH, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)


def wait_rollout_span(receiver: _Receiver) -> dict:
    deadline = time.monotonic() + SPANS_TIMEOUT_S
    while True:
        with receiver.lock:
            rollouts = [span for span in receiver.spans if span["name"] == "rollout"]
        if rollouts:
            return rollouts[0]
        assert time.monotonic() < deadline, "no rollout span arrived over OTLP"
        time.sleep(0.2)  # polling the receiver's list; the span's arrival is the signal


def test_a_resume_without_the_otlp_variable_still_exports_over_otlp(tmp_path: Path, receiver: _Receiver) -> None:
    without_otel = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    first = {**without_otel, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    run_dir = tmp_path / "run"
    up = run(["up", "--run-dir", str(run_dir), "--no-serve", "--timeout", "240"], first, timeout=300, cwd=tmp_path)
    assert up.returncode == 0, up.stdout + up.stderr
    down = run(["down", "--run-dir", str(run_dir), "--timeout", "60"], first, timeout=120, cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    telemetry = json.loads((run_dir / "config.json").read_text())["telemetry"]
    assert telemetry["exporter"] == "otlp"
    assert telemetry["otlp_endpoint"] == f"{endpoint}/v1/traces"
    with receiver.lock:
        receiver.spans.clear()  # what the first start sent; only the resumed run's spans count

    resumed = run(["up", "--resume", str(run_dir), "--no-serve", "--timeout", "240"], without_otel,
                  timeout=300, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    try:
        submit = run(["submit", "--run-dir", str(run_dir), "--task", "molar_mass", "--count", "1", "--wait",
                      "--timeout", "120"], without_otel, timeout=180, cwd=tmp_path)
        assert submit.returncode == 0, submit.stdout + submit.stderr
    finally:
        down = run(["down", "--run-dir", str(run_dir), "--timeout", "60"], without_otel, timeout=120, cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    rollout = wait_rollout_span(receiver)
    assert rollout["service"] == "rollmesh.rollout"
    assert not (run_dir / "traces.jsonl").exists()  # the saved exporter, not the config file's jsonl
