"""The observability config sections: traces, logs and metrics (``[telemetry]``) and the live
dashboard (``[dashboard]``).

Knows msgspec only; part of the config tree ``rollmesh.config`` loads.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from rollmesh.config_types import ConfigSection, PositiveFloat, PositiveInt

TRACE_EXPORTER_KINDS = ("otlp", "jsonl", "console", "none")
TRACE_EXPORTERS_PATTERN = r"^\s*({0})\s*(,\s*({0})\s*)*$".format("|".join(TRACE_EXPORTER_KINDS))


class TelemetryConfig(ConfigSection):
    # "jsonl": spans to <run_dir>/traces.jsonl; "otlp": OTLP over HTTP to otlp_endpoint;
    # "console"; "none"; or several comma-separated, as OTEL_TRACES_EXPORTER takes them (a run's
    # config.json records the exporters the OTEL_* variables put in effect, so a resume keeps them).
    exporter: Annotated[str, Meta(pattern=TRACE_EXPORTERS_PATTERN)] = "jsonl"
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Prometheus metrics of the whole mesh, served by `rollmesh up` (docs/metrics.md): 0 picks a
    # free port; a busy port falls back to a free one (mesh.json has the real URL).
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 9464
    metrics_host: str = "127.0.0.1"
    # How often every process sends its metric snapshot to the hub.
    metrics_report_s: PositiveFloat = 2.0
    # How often the hub appends the aggregate to <run_dir>/tensorboard/ as scalars.
    tensorboard_every_s: PositiveFloat = 10.0


class DashboardConfig(ConfigSection):
    """The live dashboard at ``/dashboard`` on the Serve app's port (``rollmesh dashboard``)."""

    enabled: bool = True
    # Where a rollout's trace link goes: a URL with ``{trace_id}`` in it, e.g. Jaeger's
    # "http://127.0.0.1:16686/trace/{trace_id}". Empty: the dashboard's own view of the run's
    # traces.jsonl (/dashboard/traces/<trace_id>).
    trace_url: str = ""
    # How often the page refreshes, and how often the Serve app asks the scheduler and the sandbox
    # broker for their numbers (events arrive as they happen either way).
    refresh_s: Annotated[float, Meta(ge=0.2)] = 1.0
    poll_s: Annotated[float, Meta(ge=0.2)] = 2.0
    # Bounds of what the dashboard keeps: rollouts in flight (the least recently heard of go
    # first), recent failures, and points of the reward curve and accelerator timeline.
    max_rollouts: PositiveInt = 200
    max_failures: PositiveInt = 50
    max_points: PositiveInt = 500

    def __post_init__(self) -> None:
        if self.trace_url and "{trace_id}" not in self.trace_url:
            raise ValueError("dashboard.trace_url must contain {trace_id}")
