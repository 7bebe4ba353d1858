"""rollmesh.telemetry: OpenTelemetry tracing and metrics, structlog logging and secret redaction.

The tracing conventions (service, span and attribute names) live in
``rollmesh.telemetry.conventions``, the metric names in ``rollmesh.telemetry.metrics_catalog``,
and W3C trace context in message headers (NATS or HTTP) in ``rollmesh.telemetry.trace_headers``;
any layer may import them.

Knows opentelemetry and structlog; nothing of NATS or Ray. Names load lazily so that importing
``rollmesh.telemetry.redaction`` does not pull in the OpenTelemetry SDK.
"""

from __future__ import annotations


from rollmesh.moved_names import lazy_exports

_EXPORTS = {
    "setup_tracing": "rollmesh.telemetry.tracing",
    "flush_tracing": "rollmesh.telemetry.tracing",
    "TRACES_FILE": "rollmesh.telemetry.tracing",
    "traces_path": "rollmesh.telemetry.tracing",
    "service_name": "rollmesh.telemetry.tracing",
    "effective_telemetry": "rollmesh.telemetry.tracing",
    "JsonlSpanExporter": "rollmesh.telemetry.jsonl_exporter",
    "setup_logging": "rollmesh.telemetry.logging",
    "redact_url": "rollmesh.telemetry.redaction",
    "redact_value": "rollmesh.telemetry.redaction",
    "setup_metrics": "rollmesh.telemetry.metrics",
    "collect_report": "rollmesh.telemetry.metrics",
    "MetricsHubLogic": "rollmesh.telemetry.metrics_hub",
    "inject_trace_headers": "rollmesh.telemetry.trace_headers",
    "extract_trace_context": "rollmesh.telemetry.trace_headers",
}

__all__ = sorted(_EXPORTS)
# MetricsHub: deprecated, kept for one release.
__getattr__ = lazy_exports(__name__, _EXPORTS, moved={"MetricsHub": "rollmesh.telemetry.metrics_hub:MetricsHubLogic"})


def __dir__() -> list[str]:
    return __all__
