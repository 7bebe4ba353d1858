"""The standard OTEL_* environment variables: exporter choice, endpoint, service names, sampler
and resource. Each test passes its own environment (or patches os.environ) and builds its own
provider, so nothing here touches the process-wide one."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

from rollmesh.config import TelemetryConfig
from rollmesh.telemetry.conventions import SERVICE_COMPONENTS, component_of
from rollmesh.telemetry.jsonl_exporter import JsonlSpanExporter
from rollmesh.telemetry.tracing import (
    exporter_kinds,
    make_exporters,
    otlp_endpoint,
    service_name,
)

pytestmark = pytest.mark.unit

_DEFAULT = TelemetryConfig()


def test_jsonl_file_stays_the_default_without_otel_variables():
    assert exporter_kinds(_DEFAULT, {}) == ["jsonl"]
    assert exporter_kinds(TelemetryConfig(exporter="none"), {}) == []


def test_otlp_endpoint_alone_selects_otlp_http_with_the_signal_path_added():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}
    assert exporter_kinds(_DEFAULT, env) == ["otlp"]
    assert otlp_endpoint(_DEFAULT, env) == "http://collector:4318/v1/traces"


def test_traces_endpoint_is_used_as_is_and_wins_over_the_base_endpoint():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4318",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:9999/custom"}
    assert exporter_kinds(TelemetryConfig(exporter="none"), env) == ["otlp"]
    assert otlp_endpoint(_DEFAULT, env) == "http://traces:9999/custom"


def test_config_endpoint_is_used_when_no_variable_names_one():
    config = TelemetryConfig(exporter="otlp", otlp_endpoint="http://cfg:4318/v1/traces")
    assert exporter_kinds(config, {}) == ["otlp"]
    assert otlp_endpoint(config, {}) == "http://cfg:4318/v1/traces"


def test_otel_traces_exporter_wins_over_endpoint_and_config(tmp_path):
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}
    assert exporter_kinds(_DEFAULT, {**endpoint, "OTEL_TRACES_EXPORTER": "none"}) == []
    assert exporter_kinds(_DEFAULT, {"OTEL_TRACES_EXPORTER": "otlp, jsonl"}) == ["otlp", "jsonl"]
    exporters = make_exporters(_DEFAULT, tmp_path, {**endpoint, "OTEL_TRACES_EXPORTER": "otlp,console,jsonl"})
    assert [type(e) for e in exporters] == [OTLPSpanExporter, ConsoleSpanExporter, JsonlSpanExporter]
    assert exporters[0]._endpoint == "http://127.0.0.1:1/v1/traces"
    for exporter in exporters:
        exporter.shutdown()


def test_unknown_otel_traces_exporter_is_refused():
    with pytest.raises(ValueError, match="zipkin"):
        exporter_kinds(_DEFAULT, {"OTEL_TRACES_EXPORTER": "zipkin"})


def test_service_names_are_prefix_dot_component():
    assert service_name("decode", {}) == "rollmesh.decode"
    assert service_name("rollout_worker", {}) == "rollmesh.rollout"
    assert service_name("sandbox_broker", {}) == "rollmesh.sandbox"
    assert service_name("gpu_scheduler", {}) == "rollmesh.scheduler"
    assert service_name("prefill", {"OTEL_SERVICE_NAME": "myrl"}) == "myrl.prefill"
    for component in SERVICE_COMPONENTS:
        assert component_of(component) == component


def test_every_role_actor_maps_to_one_of_the_documented_services():
    import importlib
    import pkgutil

    import rollmesh.actors
    from rollmesh.actors.role_base import RoleActor

    for module in pkgutil.iter_modules(rollmesh.actors.__path__):
        importlib.import_module(f"rollmesh.actors.{module.name}")

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    # Only rollmesh's own: a test's throwaway subclass (test_role_names' "widget") is not a
    # service, and may still be alive when this runs after it.
    roles = {sub.role for sub in subclasses(RoleActor) if sub.__module__.startswith("rollmesh.")}
    assert {"prefill", "decode", "rollout_worker", "trainer", "resharder", "sandbox_broker",
            "gpu_scheduler"} <= roles
    assert {component_of(role) for role in roles} <= set(SERVICE_COMPONENTS)


def test_sdk_reads_sampler_and_resource_variables(monkeypatch):
    # setup_tracing relies on these two SDK behaviours; this pins them.
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,service.name=ignored")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "myrl")
    provider = TracerProvider(resource=Resource.create({"service.name": service_name("trainer")}))
    assert isinstance(provider.sampler, ParentBasedTraceIdRatio)
    assert provider.sampler._root.rate == 0.25
    assert provider.resource.attributes["deployment.environment"] == "test"
    assert provider.resource.attributes["service.name"] == "myrl.trainer"
    provider.shutdown()


def test_jsonl_records_name_the_actor_and_the_service(tmp_path):
    import json

    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from rollmesh.telemetry.conventions import RESOURCE_ACTOR

    path = tmp_path / "traces.jsonl"
    provider = TracerProvider(resource=Resource.create(
        {"service.name": "rollmesh.decode", RESOURCE_ACTOR: "decode-0"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
    with provider.get_tracer("t").start_as_current_span("generate"):
        pass
    provider.shutdown()
    (record,) = map(json.loads, path.read_text().splitlines())
    assert (record["service"], record["service_name"]) == ("decode-0", "rollmesh.decode")
