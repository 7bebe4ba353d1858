"""The tracer of the CLI's own spans (``submit``, ``sandbox run``), service ``rollmesh.cli``.

Knows OpenTelemetry and the telemetry config; nothing of the bus or Ray. The CLI has no run
directory: it exports only where the OTEL_* variables (or an ``otlp`` config) say, never into a
``traces.jsonl`` in the working directory. A command flushes (``flush_tracing``) before it exits.
"""

from __future__ import annotations

from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

from rollmesh.config import TelemetryConfig
from rollmesh.telemetry.tracing import exporter_kinds, service_name, setup_tracing, without_run_dir

TRACER_NAME = "rollmesh.cli"


def cli_tracer(telemetry: TelemetryConfig) -> trace.Tracer:
    """The tracer for the CLI's spans, service ``rollmesh.cli``.

    When something would be exported (OTEL_* set, or an ``otlp`` config) the process-wide
    provider is set up. Otherwise it is left alone (a test calling ``main()`` in-process keeps
    its own) and a private, non-exporting provider makes the spans, so every request still
    carries a valid, sampled ``traceparent``.
    """
    telemetry = without_run_dir(telemetry)
    if exporter_kinds(telemetry):
        setup_tracing("cli", telemetry, Path.cwd())
        return trace.get_tracer(TRACER_NAME)
    if isinstance(trace.get_tracer_provider(), SdkTracerProvider):
        return trace.get_tracer(TRACER_NAME)
    private = SdkTracerProvider(resource=Resource.create({"service.name": service_name("cli")}))
    return private.get_tracer(TRACER_NAME)
