"""Tracing setup and the JSONL span exporter."""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from rollmesh.config import TelemetryConfig
from rollmesh.telemetry.jsonl_exporter import JsonlSpanExporter
from rollmesh.telemetry.tracing import make_exporter, setup_tracing, traces_path

pytestmark = pytest.mark.unit


def _provider(path, service):
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
    return provider


def test_jsonl_exporter_writes_one_line_per_span_with_parent_and_links(tmp_path):
    path = tmp_path / "traces.jsonl"
    provider = _provider(path, "svc-a")
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("rollout") as rollout:
        pass
    with tracer.start_as_current_span("turn", links=[trace.Link(rollout.get_span_context())]) as turn:
        with tracer.start_as_current_span("generate", attributes={"rollout_id": "r1"}):
            pass
    provider.shutdown()

    records = {r["name"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert set(records) == {"rollout", "turn", "generate"}
    generate, turn_rec = records["generate"], records["turn"]
    assert generate["parent_span_id"] == f"{turn.get_span_context().span_id:016x}"
    assert generate["trace_id"] == turn_rec["trace_id"] == f"{turn.get_span_context().trace_id:032x}"
    assert turn_rec["parent_span_id"] is None
    assert turn_rec["links"] == [{
        "trace_id": records["rollout"]["trace_id"], "span_id": records["rollout"]["span_id"],
        "attributes": {},
    }]
    assert generate["attributes"] == {"rollout_id": "r1"}
    assert generate["service"] == "svc-a"
    assert generate["start_ns"] <= generate["end_ns"]


def test_two_writers_share_one_file_without_breaking_lines(tmp_path):
    path = tmp_path / "traces.jsonl"
    providers = [_provider(path, "a"), _provider(path, "b")]
    for i in range(50):
        with providers[i % 2].get_tracer("t").start_as_current_span(f"s{i}", attributes={"pad": "x" * 500}):
            pass
    for provider in providers:
        provider.shutdown()
    lines = path.read_text().splitlines()
    assert len(lines) == 50
    assert {json.loads(line)["service"] for line in lines} == {"a", "b"}


def test_exporter_kind_follows_config(tmp_path):
    assert isinstance(make_exporter(TelemetryConfig(exporter="jsonl"), tmp_path), JsonlSpanExporter)
    otlp = make_exporter(TelemetryConfig(exporter="otlp", otlp_endpoint="http://127.0.0.1:1/v1/traces"),
                         tmp_path)
    assert isinstance(otlp, OTLPSpanExporter)
    otlp.shutdown()
    assert make_exporter(TelemetryConfig(exporter="none"), tmp_path) is None


def test_setup_tracing_installs_one_provider_per_process(trace_file, tmp_path):
    first = setup_tracing("again", TelemetryConfig(exporter="none"), tmp_path)
    assert setup_tracing("and-again", TelemetryConfig(), tmp_path) is first
    assert trace.get_tracer_provider() is first
    assert traces_path() == trace_file
