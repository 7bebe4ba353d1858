"""The shipped OpenTelemetry Collector config keeps every error and every slow turn."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "otel" / "collector.yaml"


def test_collector_tail_samples_errors_slow_turns_and_a_share_of_the_rest():
    config = yaml.safe_load(CONFIG.read_text())
    assert set(config["receivers"]["otlp"]["protocols"]) == {"http", "grpc"}
    policies = {p["type"]: p for p in config["processors"]["tail_sampling"]["policies"]}
    assert policies["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    assert policies["latency"]["latency"]["threshold_ms"] > 0
    assert 0 < policies["probabilistic"]["probabilistic"]["sampling_percentage"] < 100
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    assert "tail_sampling" in pipeline["processors"]
    assert {"otlp", "debug"} <= set(pipeline["exporters"])
    assert set(pipeline["exporters"]) <= set(config["exporters"])
