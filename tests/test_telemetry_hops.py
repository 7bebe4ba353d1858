"""The tracing hops outside the mesh's actors: HTTP into the Serve app and ``rollmesh submit``
over NATS. (The SGLang client's ``traceparent`` is checked against the fake SGLang server in
test_engine_sglang.py.)

The request span (FastAPI's telemetry, configured as the inference app does) is checked in-process
under an in-memory exporter (its own provider, so the process-wide one is untouched); the deployed app's replica is another process, so one
request goes through Serve and its span is read back from the replica's ``traces.jsonl``. The
CLI runs as a subprocess with ``OTEL_TRACES_EXPORTER=jsonl`` and a NATS subscriber reads the
headers of what it publishes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from fastapi import FastAPI
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from support.ray_actors import stop_and_kill
from rollmesh.actors.inference_workers import DecodeWorkerActor
from rollmesh.mesh_address import MeshAddress
from rollmesh.bus.connection import connect_bus
from rollmesh.bus.embedded_server import EmbeddedNatsServer
from rollmesh.config import InferenceConfig, ModelConfig, TelemetryConfig
from rollmesh.messages.subjects import ROLLOUT_REQUESTED
from rollmesh.serve_apps import build_inference_app, deploy_inference_app, shutdown_inference_app
from rollmesh.serve_apps.inference_app import HTTP_TELEMETRY
from rollmesh.telemetry.trace_headers import inject_trace_headers
from rollmesh.telemetry.tracing import exporter_kinds, without_run_dir

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"
REPO_ROOT = Path(__file__).resolve().parent.parent


# -- the request span, in-process ----------------------------------------------------------


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def traced_app(spans: InMemorySpanExporter) -> FastAPI:
    """A FastAPI app traced the way the inference app is, into an in-memory exporter."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    app = FastAPI(telemetry={**HTTP_TELEMETRY, "tracer_provider": provider})

    @app.post("/v1/items/{item_id}")
    async def item(item_id: str) -> dict[str, str]:
        return inject_trace_headers({})  # what the router passes on to a worker

    return app


@pytest.mark.unit
async def test_request_span_is_a_server_child_of_the_incoming_traceparent(traced_app, spans):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=traced_app),
                                 base_url="http://testserver") as http:
        response = await http.post("/v1/items/abc", headers={"traceparent": TRACEPARENT})

    [span] = spans.get_finished_spans()  # no per-operation child spans
    assert span.name == "POST /v1/items/{item_id}"  # the route template, never the id
    assert span.kind == SpanKind.SERVER
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert f"{span.parent.span_id:016x}" == CALLER_SPAN_ID and span.parent.is_remote
    assert span.attributes["http.request.method"] == "POST"
    assert span.attributes["http.route"] == "/v1/items/{item_id}"
    assert span.attributes["http.response.status_code"] == 200
    # The handler runs inside the span: the context it passes on names the server span.
    version, trace_id, parent_id, _ = response.json()["traceparent"].split("-")
    assert (trace_id, parent_id) == (TRACE_ID, f"{span.context.span_id:016x}")


# -- the deployed Serve app: replica process -> traces.jsonl -----------------------------------


def wait_spans(path: Path, trace_id: str, want: int, timeout_s: float = 15.0) -> list[dict]:
    """The spans of ``trace_id`` in a JSONL trace file, once ``want`` of them are there."""
    deadline = time.monotonic() + timeout_s
    found: list[dict] = []
    while time.monotonic() < deadline:
        if path.exists():
            found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            found = [s for s in found if s["trace_id"] == trace_id]
            if len(found) >= want:
                return found
        time.sleep(0.2)  # the exporter batches with a 200 ms delay; nothing to wait on instead
    return found


@pytest.fixture(scope="module")
def served_run_dir(ray_session: None, nats_server: EmbeddedNatsServer,
                   tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[tuple[str, Path]]:
    """One aggregated decode worker behind the app, both tracing into one run directory."""
    model = ModelConfig(path=str(demo_model_dir))
    namespace = "t" + uuid.uuid4().hex[:10]
    run_dir = tmp_path_factory.mktemp("serve-trace-run")
    mesh = MeshAddress(namespace=namespace, nats_url=nats_server.url, run_dir=str(run_dir))
    name = f"decode-{namespace}"
    decode = ray.remote(DecodeWorkerActor).options(name=name, namespace=namespace, num_cpus=0).remote(
        name, mesh, model, InferenceConfig(max_batch=2))
    try:
        ray.get(decode.start.remote(), timeout=60)
        app = build_inference_app(
            prefill_actor_names=[], decode_actor_names=[name], ray_namespace=namespace,
            model=model, model_name="tiny", telemetry=TelemetryConfig(exporter="jsonl"), run_dir=str(run_dir),
        )
        url = deploy_inference_app(app, host="127.0.0.1", port=_free_port())
        yield url, run_dir / "traces.jsonl"
    finally:
        shutdown_inference_app()
        stop_and_kill(decode)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_serve_request_continues_the_callers_trace_into_the_decode_worker(served_run_dir) -> None:
    url, traces = served_run_dir
    response = httpx.post(f"{url}/v1/completions", headers={"traceparent": TRACEPARENT}, timeout=60,
                          json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text

    spans = wait_spans(traces, TRACE_ID, want=3)
    [server] = [s for s in spans if s["kind"] == "SERVER"]
    assert server["name"] == "POST /v1/completions"
    assert server["parent_span_id"] == CALLER_SPAN_ID
    assert server["service_name"] == "rollmesh.serve"
    assert server["attributes"]["http.response.status_code"] == 200
    assert server["attributes"]["gen_ai.operation.name"] == "text_completion"
    assert server["attributes"]["gen_ai.request.model"] == "tiny"
    assert server["attributes"]["gen_ai.usage.output_tokens"] == 2
    [generate] = [s for s in spans if s["name"] == "generate" and s["parent_span_id"] == server["span_id"]]
    # The router's headers reached the decode worker, whose spans continue the same trace.
    worker = [s for s in spans if s["service_name"] == "rollmesh.decode"]
    assert worker and all(s["trace_id"] == TRACE_ID for s in worker), spans
    assert any(s["parent_span_id"] == generate["span_id"] for s in worker), spans


# -- rollmesh submit -------------------------------------------------------------------------


@pytest.mark.unit
def test_cli_exports_nothing_by_default_and_follows_otel_variables() -> None:
    cli = without_run_dir(TelemetryConfig())
    assert exporter_kinds(cli, env={}) == []  # no traces.jsonl in the working directory
    assert exporter_kinds(cli, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ["otlp"]
    assert exporter_kinds(cli, env={"OTEL_TRACES_EXPORTER": "jsonl"}) == ["jsonl"]
    assert without_run_dir(TelemetryConfig(exporter="otlp")).exporter == "otlp"


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_submit_publishes_each_request_with_the_cli_spans_traceparent(
    nats_server: EmbeddedNatsServer, namespace: str, tmp_path: Path
) -> None:
    rollout_id = f"hop-{uuid.uuid4().hex[:8]}"
    requests_file = tmp_path / "requests.jsonl"
    requests_file.write_text(json.dumps({
        "rollout_id": rollout_id, "task": "molar_mass",
        "task_input": {"formula": "H2O"},
    }) + "\n")
    nc = await connect_bus(nats_server.url, name="hops-test", connect_timeout_s=5.0)
    try:
        sub = await nc.subscribe(ROLLOUT_REQUESTED.format(namespace))
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(OTEL_TRACES_EXPORTER="jsonl", PYTHONPATH=str(REPO_ROOT))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollmesh.cli", "submit", "--file", str(requests_file),
            "--nats-url", nats_server.url, "--namespace", namespace,
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        output, _ = await asyncio.wait_for(process.communicate(), timeout=45)
        assert process.returncode == 0, output.decode()
        msg = await sub.next_msg(timeout=5)
    finally:
        await nc.close()

    version, trace_id, publish_span_id, flags = msg.headers["traceparent"].split("-")
    records = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    [submit] = [r for r in records if r["name"] == "submit"]
    assert submit["service_name"] == "rollmesh.cli"
    assert submit["attributes"]["rl.rollout_id"] == rollout_id
    assert (version, trace_id) == ("00", submit["trace_id"]) and int(flags, 16) & 1  # sampled
    [publish] = [r for r in records if r["span_id"] == publish_span_id]
    assert publish["kind"] == "PRODUCER" and publish["parent_span_id"] == submit["span_id"]
