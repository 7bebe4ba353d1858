"""OpenTelemetry tracing setup: one TracerProvider per process.

Knows the OpenTelemetry SDK and exporters; knows nothing of NATS or Ray. The global provider can
only be set once per process, so a second ``setup_tracing`` (another actor in the same process,
or a test) gets the first provider back. Spans are batched with a short delay so a trace file is
readable while the run is going; ``flush_tracing`` forces the rest out at shutdown.
"""

from __future__ import annotations

import threading
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from rollmesh.config import TelemetryConfig
from rollmesh.telemetry.jsonl_exporter import JsonlSpanExporter

TRACES_FILE = "traces.jsonl"
_SCHEDULE_DELAY_MS = 200

_lock = threading.Lock()
_provider: TracerProvider | None = None
_traces_path: Path | None = None


def make_exporter(config: TelemetryConfig, run_dir: Path) -> SpanExporter | None:
    if config.exporter == "jsonl":
        return JsonlSpanExporter(Path(run_dir) / TRACES_FILE)
    if config.exporter == "otlp":
        # Imported here: the OTLP exporter pulls in requests/protobuf, needless for jsonl runs.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=config.otlp_endpoint)
    return None


def setup_tracing(service_name: str, config: TelemetryConfig, run_dir: Path) -> TracerProvider:
    """Install the process-wide TracerProvider (once) and return it."""
    global _provider, _traces_path
    with _lock:
        if _provider is not None:
            return _provider
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        exporter = make_exporter(config, run_dir)
        if exporter is not None:
            provider.add_span_processor(
                BatchSpanProcessor(exporter, schedule_delay_millis=_SCHEDULE_DELAY_MS)
            )
        trace.set_tracer_provider(provider)
        _provider = provider
        if isinstance(exporter, JsonlSpanExporter):
            _traces_path = exporter.path
        return provider


def traces_path() -> Path | None:
    """The JSONL file this process's spans go to (None: not set up, or not the jsonl exporter)."""
    return _traces_path


def flush_tracing(timeout_ms: int = 5_000) -> bool:
    """Export every finished span now; True when all made it in time (or tracing is off)."""
    provider = _provider
    return provider.force_flush(timeout_ms) if provider is not None else True
