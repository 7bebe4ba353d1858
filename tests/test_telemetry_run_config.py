"""A run's config.json records the trace exporters the OTEL_* variables put in effect.

So ``rollmesh up --resume`` without the variables exports where the run did, and a variable set
at resume still wins. Plain logic: the mesh is constructed (which folds the variables in) but not
started; tests/test_telemetry_otlp_mesh.py does it with a real mesh and an OTLP receiver.
"""

from __future__ import annotations

import json

import msgspec
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

from rollmesh.config import RUN_CONFIG_FILE, ConfigError, TelemetryConfig, load_config, load_run_config, save_run_config
from rollmesh.telemetry.tracing import effective_telemetry, make_exporters, without_run_dir

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

COLLECTOR = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}


def exporter_endpoints(config: TelemetryConfig, run_dir, env) -> list[str]:
    exporters = make_exporters(config, run_dir, env)
    try:
        return [e._endpoint if isinstance(e, OTLPSpanExporter) else type(e).__name__ for e in exporters]
    finally:
        for exporter in exporters:
            exporter.shutdown()


def test_the_endpoint_variable_alone_is_recorded_as_the_otlp_exporter_and_its_traces_url():
    effective = effective_telemetry(TelemetryConfig(), COLLECTOR)
    assert effective.exporter == "otlp"
    assert effective.otlp_endpoint == "http://collector:4318/v1/traces"


def test_the_traces_endpoint_variable_is_recorded_as_is():
    env = {**COLLECTOR, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://traces.example:4318/custom"}
    assert effective_telemetry(TelemetryConfig(), env).otlp_endpoint == "https://traces.example:4318/custom"


def test_a_list_of_exporters_is_recorded_whole_and_none_as_none():
    env = {**COLLECTOR, "OTEL_TRACES_EXPORTER": "otlp, jsonl,console"}
    assert effective_telemetry(TelemetryConfig(), env).exporter == "otlp,jsonl,console"
    assert effective_telemetry(TelemetryConfig(), {**COLLECTOR, "OTEL_TRACES_EXPORTER": "none"}).exporter == "none"


def test_without_variables_the_config_is_what_is_recorded():
    # The config's own endpoint is its own business: kept as written, user info and all.
    configured = TelemetryConfig(exporter="otlp", otlp_endpoint="http://u:p@cfg:4318/v1/traces")
    assert effective_telemetry(configured, {}) == configured
    assert effective_telemetry(TelemetryConfig(), {}) == TelemetryConfig()


def test_credentials_in_the_endpoint_are_not_recorded():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://alice:s3cret@collector:4318"}
    assert effective_telemetry(TelemetryConfig(), env).otlp_endpoint == "https://collector:4318/v1/traces"


def test_the_mesh_saves_what_the_variables_put_in_effect_and_no_headers(tmp_path, monkeypatch):
    from rollmesh.launcher import Mesh

    for variable, value in {**COLLECTOR, "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer s3cret",
                            "OTEL_SERVICE_NAME": "myrl"}.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    mesh = Mesh(load_config(None, environ={}), run_dir=tmp_path)
    save_run_config(tmp_path, mesh.config)  # what Mesh.start writes first
    text = (tmp_path / RUN_CONFIG_FILE).read_text()
    assert json.loads(text)["telemetry"]["exporter"] == "otlp"
    assert json.loads(text)["telemetry"]["otlp_endpoint"] == "http://collector:4318/v1/traces"
    assert "s3cret" not in text and "myrl" not in text


def test_a_resume_without_the_variables_exports_to_the_saved_endpoint(tmp_path):
    config = load_config(None, environ={})
    started = msgspec.structs.replace(config, telemetry=effective_telemetry(config.telemetry, COLLECTOR))
    save_run_config(tmp_path, started)
    resumed = load_run_config(tmp_path).telemetry
    assert exporter_endpoints(resumed, tmp_path, {}) == ["http://collector:4318/v1/traces"]
    assert effective_telemetry(resumed, {}) == resumed  # and the resumed run saves the same again


def test_variables_set_at_resume_win_over_the_saved_exporters(tmp_path):
    config = load_config(None, environ={})
    save_run_config(tmp_path, msgspec.structs.replace(
        config, telemetry=effective_telemetry(config.telemetry, COLLECTOR)))
    resumed = load_run_config(tmp_path).telemetry
    elsewhere = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://elsewhere:4318"}
    assert exporter_endpoints(resumed, tmp_path, elsewhere) == ["http://elsewhere:4318/v1/traces"]
    assert exporter_endpoints(resumed, tmp_path, {"OTEL_TRACES_EXPORTER": "jsonl"}) == ["JsonlSpanExporter"]
    assert effective_telemetry(resumed, elsewhere).otlp_endpoint == "http://elsewhere:4318/v1/traces"


def test_the_config_takes_exporter_lists_and_refuses_unknown_ones():
    assert load_config(None, environ={"ROLLMESH_TELEMETRY__EXPORTER": "otlp,jsonl"}).telemetry.exporter == "otlp,jsonl"
    with pytest.raises(ConfigError) as refused:
        load_config(None, environ={"ROLLMESH_TELEMETRY__EXPORTER": "otlp,zipkin"})
    assert refused.value.path == "telemetry.exporter"


def test_a_process_without_a_run_dir_drops_only_the_jsonl_exporter():
    assert without_run_dir(TelemetryConfig(exporter="jsonl")).exporter == "none"
    assert without_run_dir(TelemetryConfig(exporter="otlp,jsonl")).exporter == "otlp"
    assert without_run_dir(TelemetryConfig(exporter="console")).exporter == "console"
