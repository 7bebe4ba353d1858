"""The Prometheus endpoint: the aggregate, in the text exposition format, at ``/metrics``.

Knows prometheus_client (its collector interface and HTTP server thread) and our aggregated
metrics; nothing of NATS. The aggregate is read through ``read`` on the server's thread, so
``read`` must be safe to call from another thread (the hub takes a lock). A busy port falls back to
a free one with a warning: a second mesh on a machine (tests, a colleague's run) must still start,
and ``mesh.json`` says where its metrics are.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from rollmesh.telemetry.metrics_aggregate import AggregatedMetric

_log = structlog.get_logger("rollmesh.telemetry.metrics_exposition")


class AggregateCollector:
    """A prometheus_client collector over ``read() -> list[AggregatedMetric]``."""

    def __init__(self, read: Callable[[], list[AggregatedMetric]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        for metric in self.read():
            yield to_family(metric)


def to_family(metric: AggregatedMetric) -> Metric:
    label_names = sorted({name for point in metric.points.values() for name in point.labels})
    base = metric.name.removesuffix("_total") if metric.kind == "counter" else metric.name
    if metric.kind == "counter":
        family: Any = CounterMetricFamily(base, metric.description, labels=label_names, unit="")
    elif metric.kind == "histogram":
        family = HistogramMetricFamily(base, metric.description, labels=label_names)
    else:
        family = GaugeMetricFamily(base, metric.description, labels=label_names)
    for point in metric.points.values():
        values = [point.labels.get(name, "") for name in label_names]
        if metric.kind == "histogram":
            family.add_metric(values, buckets=cumulative_buckets(point.bucket_bounds, point.bucket_counts),
                              sum_value=point.sum)
        else:
            family.add_metric(values, point.value)
    return family


def cumulative_buckets(bounds: list[float], counts: list[int]) -> list[tuple[str, float]]:
    """OpenTelemetry's per-bucket counts (one more than bounds) as Prometheus ``le`` buckets."""
    buckets, running = [], 0
    for bound, count in zip([*bounds, math.inf], counts):
        running += count
        buckets.append((floatToGoString(bound), float(running)))
    return buckets


@dataclass
class MetricsEndpoint:
    url: str
    server: Any
    thread: Any

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_metrics(read: Callable[[], list[AggregatedMetric]], *, host: str, port: int) -> MetricsEndpoint:
    """Serve ``/metrics`` on ``host:port`` (0: a free port; busy: a free one, with a warning)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AggregateCollector(read))  # type: ignore[arg-type]
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        if port == 0:
            raise
        _log.warning("metrics_port_busy", port=port, error=str(exc), fallback="a free port")
        server, thread = start_http_server(0, addr=host, registry=registry)
    bound = server.server_address[1]
    # A wildcard address is no place to scrape: name the machine instead.
    shown = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
    shown = f"[{shown}]" if ":" in shown else shown
    return MetricsEndpoint(f"http://{shown}:{bound}/metrics", server, thread)
