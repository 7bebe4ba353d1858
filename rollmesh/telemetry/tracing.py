"""OpenTelemetry tracing setup: one TracerProvider per process.

Knows the OpenTelemetry SDK and exporters; knows nothing of NATS or Ray. The global provider can
only be set once per process, so a second ``setup_tracing`` (another actor in the same process,
or a test) gets the first provider back. Spans are batched with a short delay so a trace file is
readable while the run is going; ``flush_tracing`` forces the rest out at shutdown.

The standard OTEL_* variables are read here, in every process, rather than folded into the config
at the entry point: the SDK reads most of them itself (sampler, resource, endpoint, headers), and
Ray workers inherit them from the process that started Ray. They win over ``telemetry.exporter``:

- ``OTEL_TRACES_EXPORTER`` (comma-separated): ``otlp`` (OTLP/HTTP), ``console``, ``jsonl``
  (ours), ``none``. Unset: OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set, else ``telemetry.exporter`` (JSONL by default).
- The OTLP endpoint: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` as is, else
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``, else ``telemetry.otlp_endpoint``.
- ``OTEL_SERVICE_NAME`` is the prefix of every ``service.name`` ("<prefix>.<component>").
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``: head sampling, by the SDK.
- ``OTEL_RESOURCE_ATTRIBUTES``: merged into the resource by the SDK (``service.name`` and
  ``rollmesh.actor`` are ours).

A mesh records the exporters and endpoint in effect in its config (``effective_telemetry``), so
the run's ``config.json`` exports the same way on ``rollmesh up --resume`` without the variables;
the variables set at resume still win. Headers (``OTEL_EXPORTER_OTLP_HEADERS``, which may hold
tokens) and the other variables are never recorded: they stay the environment's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import msgspec
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from rollmesh.config import TRACE_EXPORTER_KINDS, TelemetryConfig
from rollmesh.telemetry.conventions import DEFAULT_SERVICE_PREFIX, RESOURCE_ACTOR, component_of
from rollmesh.telemetry.jsonl_exporter import JsonlSpanExporter

TRACES_FILE = "traces.jsonl"
_SCHEDULE_DELAY_MS = 200

_lock = threading.Lock()
_provider: TracerProvider | None = None
_traces_path: Path | None = None


def service_name(component: str, env: Mapping[str, str] | None = None) -> str:
    """``service.name`` for a component or actor role: "rollmesh.decode", "myrl.rollout"..."""
    env = os.environ if env is None else env
    prefix = env.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_PREFIX
    return f"{prefix}.{component_of(component)}"


def exporter_kinds(config: TelemetryConfig, env: Mapping[str, str] | None = None) -> list[str]:
    """Which exporters this process uses, after the OTEL_* variables (see the module docstring)."""
    env = os.environ if env is None else env
    listed = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if listed:
        kinds = _split_kinds(listed)
        unknown = [kind for kind in kinds if kind not in TRACE_EXPORTER_KINDS]
        if unknown:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported {unknown}; use {list(TRACE_EXPORTER_KINDS)}")
        return [kind for kind in kinds if kind != "none"]
    if _otlp_endpoint_from_env(env) is not None:
        return ["otlp"]
    return [kind for kind in _split_kinds(config.exporter) if kind != "none"]


def _split_kinds(listed: str) -> list[str]:
    return [kind.strip() for kind in listed.split(",") if kind.strip()]


def otlp_endpoint(config: TelemetryConfig, env: Mapping[str, str] | None = None) -> str:
    """The OTLP/HTTP traces URL: the OTEL_* variables first, then ``telemetry.otlp_endpoint``."""
    env = os.environ if env is None else env
    return _otlp_endpoint_from_env(env) or config.otlp_endpoint


def _otlp_endpoint_from_env(env: Mapping[str, str]) -> str | None:
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return f"{base.rstrip('/')}/v1/traces" if base else None


def effective_telemetry(config: TelemetryConfig, env: Mapping[str, str] | None = None) -> TelemetryConfig:
    """``config`` with the exporters and OTLP endpoint the OTEL_* variables put in effect, for a
    run's saved config. An endpoint from the variables is recorded without any ``user:password@``."""
    env = os.environ if env is None else env
    kinds = exporter_kinds(config, env)
    from_env = _otlp_endpoint_from_env(env)
    endpoint = _without_userinfo(from_env) if "otlp" in kinds and from_env else config.otlp_endpoint
    return msgspec.structs.replace(config, exporter=",".join(kinds) or "none", otlp_endpoint=endpoint)


def _without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def make_exporters(config: TelemetryConfig, run_dir: Path,
                   env: Mapping[str, str] | None = None) -> list[SpanExporter]:
    return [_make_exporter(kind, config, run_dir, env) for kind in exporter_kinds(config, env)]


def make_exporter(config: TelemetryConfig, run_dir: Path,
                  env: Mapping[str, str] | None = None) -> SpanExporter | None:
    """The first exporter ``make_exporters`` would build (None: tracing exports nothing)."""
    kinds = exporter_kinds(config, env)
    return _make_exporter(kinds[0], config, run_dir, env) if kinds else None


def _make_exporter(kind: str, config: TelemetryConfig, run_dir: Path,
                   env: Mapping[str, str] | None) -> SpanExporter:
    if kind == "jsonl":
        return JsonlSpanExporter(Path(run_dir) / TRACES_FILE)
    if kind == "console":
        return ConsoleSpanExporter()
    # Imported here: the OTLP exporter pulls in requests/protobuf, needless for jsonl runs.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=otlp_endpoint(config, env))


def without_run_dir(config: TelemetryConfig) -> TelemetryConfig:
    """``config`` for a process with no run directory (the CLI, a Serve app given none): the
    ``jsonl`` exporter is dropped (``none`` when it was the only one), so only OTLP (configured,
    or by OTEL_*) or the console exports anything and no ``traces.jsonl`` lands in the working
    directory."""
    kinds = _split_kinds(config.exporter)
    if "jsonl" not in kinds:
        return config
    return msgspec.structs.replace(config, exporter=",".join(k for k in kinds if k != "jsonl") or "none")


def setup_tracing(component: str, config: TelemetryConfig, run_dir: Path, *,
                  instance: str | None = None) -> TracerProvider:
    """Install the process-wide TracerProvider (once) and return it.

    ``component`` is an actor role or one of ``conventions.SERVICE_COMPONENTS``; the service is
    named ``service_name(component)``. ``instance`` (the actor's name) becomes the
    ``rollmesh.actor`` resource attribute. Head sampling follows OTEL_TRACES_SAMPLER (the SDK's default:
    parent-based, always on).
    """
    global _provider, _traces_path
    with _lock:
        if _provider is not None:
            return _provider
        attributes = {"service.name": service_name(component)}
        if instance:
            attributes[RESOURCE_ACTOR] = instance
        # Resource.create merges OTEL_RESOURCE_ATTRIBUTES; TracerProvider reads the sampler vars.
        provider = TracerProvider(resource=Resource.create(attributes))
        exporters = make_exporters(config, run_dir)
        for exporter in exporters:
            provider.add_span_processor(
                BatchSpanProcessor(exporter, schedule_delay_millis=_SCHEDULE_DELAY_MS)
            )
            if isinstance(exporter, JsonlSpanExporter):
                _traces_path = exporter.path
        trace.set_tracer_provider(provider)
        _provider = provider
        return provider


def traces_path() -> Path | None:
    """The JSONL file this process's spans go to (None: not set up, or not the jsonl exporter)."""
    return _traces_path


def flush_tracing(timeout_ms: int = 5_000) -> bool:
    """Export every finished span now; True when all made it in time (or tracing is off)."""
    provider = _provider
    return provider.force_flush(timeout_ms) if provider is not None else True
