"""One real rollout through a mesh configured only by OTEL_* variables, received over OTLP/HTTP;
then the same mesh resumed without the variables still exports its rollouts' spans there.

An OTLP/HTTP receiver runs in the test process and decodes what the exporters send with
opentelemetry-proto; the mesh runs as ``rollmesh up`` / ``submit`` / ``sandbox run`` / ``down``
subprocesses. Starting a mesh is the slow part, so the first run (``otlp_run``) serves both tests:
its spans are kept for the first, and its run directory is what the second resumes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from rollmesh.bus.connection import connect_bus
from rollmesh.bus.streams import rollout_results_stream
from rollmesh.config import load_run_config
from rollmesh.messages import RolloutCompleted
from rollmesh.messages.subjects import ROLLOUT_COMPLETED
from rollmesh.telemetry import conventions

# Whichever test runs first also starts, uses and stops the first mesh (``otlp_run``).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

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


@pytest.fixture(scope="module")
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


async def _last_completion(run_dir: Path) -> RolloutCompleted:
    """The mesh's last ``RolloutCompleted``, as stored in its results stream."""
    mesh = json.loads((run_dir / "mesh.json").read_text())
    nc = await connect_bus(mesh["nats_url"], name="otlp-test", connect_timeout_s=10.0)
    try:
        stored = await nc.jetstream().get_last_msg(rollout_results_stream(mesh["namespace"]),
                                                   ROLLOUT_COMPLETED.format(mesh["namespace"]))
    finally:
        await nc.close()
    return ROLLOUT_COMPLETED.decode(stored.data)


SPANS_TIMEOUT_S = 60.0
FIRST_RUN_SPANS = ("rollout", "turn", "publish rl.{ns}.rollout.completed", conventions.SPAN_SANDBOX_RUN)


def wait_spans(receiver: _Receiver, names: tuple[str, ...]) -> list[dict]:
    """The receiver's spans once one of each of ``names`` arrived, or all it has at the deadline."""
    deadline = time.monotonic() + SPANS_TIMEOUT_S
    while True:
        with receiver.lock:
            spans = list(receiver.spans)
        if {s["name"] for s in spans} >= set(names) or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)  # polling the receiver's list; the spans' arrival is the signal


@dataclass
class OtlpRun:
    """A mesh run made with OTLP chosen only by OTEL_EXPORTER_OTLP_ENDPOINT, now stopped."""

    run_dir: Path
    endpoint: str
    completion: RolloutCompleted  # of its one rollout
    spans: list[dict]  # what it exported: its rollout's, the sandbox run's


@pytest.fixture(scope="module")
def otlp_run(tmp_path_factory: pytest.TempPathFactory, receiver: _Receiver) -> OtlpRun:
    """``up`` with the endpoint variable, one rollout and one ``sandbox run``, ``down``."""
    tmp_path = tmp_path_factory.mktemp("otlp")
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_TRACES_SAMPLER="parentbased_always_on")
    run_root = tmp_path / "runs"
    up = _run(["--run-root", str(run_root), "up", "--no-serve", "--timeout", "240"], env,
              timeout=300, cwd=tmp_path)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        submit = _run(["--run-root", str(run_root), "submit", "--task", "molar_mass", "--count", "1",
                       "--wait", "--timeout", "120"], env, timeout=180, cwd=tmp_path)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        (run_dir,) = list(run_root.iterdir())
        completion = asyncio.run(_last_completion(run_dir))
        sandbox_run = _run(["--run-root", str(run_root), "sandbox", "run", "--", "echo", "traced"], env,
                           timeout=120, cwd=tmp_path)
        assert sandbox_run.returncode == 0, sandbox_run.stdout + sandbox_run.stderr
    finally:
        down = _run(["--run-root", str(run_root), "down", "--timeout", "60"], env, timeout=120, cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    return OtlpRun(run_dir, endpoint, completion, wait_spans(receiver, FIRST_RUN_SPANS))


def test_rollout_arrives_over_otlp_linked_and_attributed(otlp_run: OtlpRun, demo_model_dir: Path) -> None:
    run_dir, completion, spans = otlp_run.run_dir, otlp_run.completion, otlp_run.spans
    assert not (run_dir / "traces.jsonl").exists()  # the endpoint alone switched to OTLP

    rollouts = [s for s in spans if s["name"] == "rollout"]
    turns = [s for s in spans if s["name"] == "turn"]
    completed_publishes = [s for s in spans if s["name"] == "publish rl.{ns}.rollout.completed"]
    sandbox_runs = [s for s in spans if s["name"] == conventions.SPAN_SANDBOX_RUN]
    assert rollouts and turns and completed_publishes and sandbox_runs, \
        f"no rollout/turn/completed/sandbox run spans among {len(spans)}"

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
    # The served model's name is its directory's: the run's model.path (the session's demo model).
    model_name = Path(load_run_config(run_dir).model.path).name
    assert model_name == demo_model_dir.name
    assert generates and all(s["attributes"]["gen_ai.request.model"] == model_name
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

    # Every request and publish the rollout made names it: the sandbox lease, exec and release too.
    assert completion.rollout_id == rollout_id
    for name in ("request rl.{ns}.sandbox.lease", "request rl.{ns}.sandbox.release"):
        assert [s for s in spans if s["name"] == name and s["service"] == "rollmesh.rollout"], name
    made_for_rollout = [s for s in publishes if s["service"] == "rollmesh.rollout" and s["attributes"][
        "messaging.destination.template"].startswith(("rl.{ns}.sandbox.", "rl.{ns}.rollout."))]
    assert {s["attributes"].get("rl.rollout_id") for s in made_for_rollout} == {rollout_id}
    # Its completion carries the version of the last token the model generated (loss mask 1).
    trace = completion.token_trace()
    generated_versions = [v for v, mask in zip(trace.versions, trace.loss_mask) if mask]
    assert generated_versions, "the rollout generated no token"
    (completed_publish,) = completed_publishes
    assert completed_publish["attributes"]["rl.rollout_id"] == rollout_id
    assert completed_publish["attributes"]["rl.weight_version"] == generated_versions[-1]

    # `rollmesh sandbox run` is its own trace's root, and its exec request is the root's child.
    (run_span,) = sandbox_runs
    assert run_span["service"] == "rollmesh.cli" and run_span["parent_span_id"] == ""
    assert run_span["attributes"][conventions.RL_SANDBOX_RESULT] == "exit"
    (cli_exec,) = [s for s in spans if s["name"] == "request rl.{ns}.sandbox.exec"
                   and s["service"] == "rollmesh.cli"]
    assert cli_exec["trace_id"] == run_span["trace_id"]
    assert cli_exec["parent_span_id"] == run_span["span_id"]
    assert "rl.rollout_id" not in cli_exec["attributes"]  # no rollout asked for it


def test_a_resume_without_the_otlp_variable_still_exports_over_otlp(otlp_run: OtlpRun, receiver: _Receiver,
                                                                     tmp_path: Path) -> None:
    run_dir = otlp_run.run_dir
    telemetry = json.loads((run_dir / "config.json").read_text())["telemetry"]
    assert telemetry["exporter"] == "otlp"
    assert telemetry["otlp_endpoint"] == f"{otlp_run.endpoint}/v1/traces"
    with receiver.lock:
        receiver.spans.clear()  # what the first run sent; only the resumed run's spans count

    without_otel = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    resumed = _run(["up", "--resume", str(run_dir), "--no-serve", "--timeout", "240"], without_otel,
                   timeout=300, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    try:
        submit = _run(["submit", "--run-dir", str(run_dir), "--task", "molar_mass", "--count", "1", "--wait",
                       "--timeout", "120"], without_otel, timeout=180, cwd=tmp_path)
        assert submit.returncode == 0, submit.stdout + submit.stderr
    finally:
        down = _run(["down", "--run-dir", str(run_dir), "--timeout", "60"], without_otel, timeout=120, cwd=tmp_path)
    assert down.returncode == 0, down.stdout + down.stderr
    rollouts = [span for span in wait_spans(receiver, ("rollout",)) if span["name"] == "rollout"]
    assert rollouts, "no rollout span arrived over OTLP"
    assert rollouts[0]["service"] == "rollmesh.rollout"
    assert not (run_dir / "traces.jsonl").exists()  # the saved exporter, not the config file's jsonl
