"""One real rollout through a mesh configured only by OTEL_* variables, received over OTLP/HTTP.

An OTLP/HTTP receiver runs in the test process and decodes what the exporters send with
opentelemetry-proto; the mesh runs as ``rollmesh up`` / ``submit`` / ``down`` subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from rollmesh.telemetry import conventions

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ROLLMESH = [sys.executable, "-m", "rollmesh.cli"]


class _Receiver(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[dict] = []
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: _Receiver

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        request = ExportTraceServiceRequest.FromString(body)
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append({
                        "service": resource.get("service.name", ""), "name": span.name,
                        "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(), "kind": span.kind,
                        "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        "attributes": {a.key: _value(a.value) for a in span.attributes},
                    })
        with self.server.lock:
            self.server.spans.extend(received)
        payload = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


def _value(value):
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "int_value", "bool_value", "double_value") else None


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    server = _Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _run(args: list[str], env: dict[str, str], *, timeout: float, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ROLLMESH, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)


def test_rollout_arrives_over_otlp_linked_and_attributed(tmp_path: Path, receiver: _Receiver) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(RAY_AUTH_MODE="disabled",
               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.server_address[1]}",
               OTEL_TRACES_SAMPLER="parentbased_always_on")
    run_root = tmp_path / "runs"
    up = _run(["--run-root", str(run_root), "up", "--no-serve", "--timeout", "180"], env,
              timeout=240, cwd=tmp_path)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        submit = _run(["--run-root", str(run_root), "submit", "--task", "molar_mass", "--count", "1",
                       "--wait", "--timeout", "120"], env, timeout=180, cwd=tmp_path)
        assert submit.returncode == 0, submit.stdout + submit.stderr
    finally:
        down = _run(["--run-root", str(run_root), "down", "--timeout", "60"], env, timeout=120, cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    (run_dir,) = list(run_root.iterdir())
    assert not (run_dir / "traces.jsonl").exists()  # the endpoint alone switched to OTLP

    deadline = time.monotonic() + 20
    while True:
        with receiver.lock:
            spans = list(receiver.spans)
        rollouts = [s for s in spans if s["name"] == "rollout"]
        turns = [s for s in spans if s["name"] == "turn"]
        if rollouts and turns:
            break
        assert time.monotonic() < deadline, f"no rollout/turn spans among {len(spans)}"
        time.sleep(0.2)

    services = {s["service"] for s in spans}
    assert len(services & {"rollmesh.prefill", "rollmesh.decode", "rollmesh.rollout",
                           "rollmesh.sandbox", "rollmesh.trainer"}) >= 4, services
    (rollout,) = rollouts
    rollout_id = rollout["attributes"]["rl.rollout_id"]
    for turn in turns:
        assert turn["attributes"]["rl.rollout_id"] == rollout_id
        assert turn["attributes"]["rl.turn.index"] >= 1
        assert turn["links"] == [(rollout["trace_id"], rollout["span_id"])]
        assert turn["trace_id"] != rollout["trace_id"]
        assert "rl.weight_version.first" in turn["attributes"]
    assert all(rollout_id not in s["name"] for s in spans)  # ids in attributes, never in names
    generates = [s for s in spans if s["name"] == conventions.SPAN_GENERATE]
    assert generates and all(s["attributes"]["gen_ai.request.model"] == "rollmesh-tiny"
                             and s["attributes"]["gen_ai.usage.output_tokens"] > 0 for s in generates)

    # Across NATS: every consumer span whose parent is in another process is a publish's child.
    by_id = {s["span_id"]: s for s in spans}
    publishes = [s for s in spans if s["name"].startswith(("publish ", "request "))]
    assert publishes and all(p["attributes"]["messaging.system"] == "nats" for p in publishes)
    crossed = [s for s in spans if s["parent_span_id"] in by_id
               and by_id[s["parent_span_id"]]["name"].startswith(("publish ", "request "))
               and by_id[s["parent_span_id"]]["service"] != s["service"]]
    assert crossed, "no span is the child of a publish in another service"
    for child in crossed:
        assert child["trace_id"] == by_id[child["parent_span_id"]]["trace_id"]
