"""MetricsAggregate: the whole mesh's metrics, from the latest snapshot of every process.

Plain logic: knows our metric messages, nothing of NATS, HTTP or OpenTelemetry. Snapshots are
cumulative, so a source's newer snapshot replaces its older one. Across sources:

- counters and histograms are summed, and a source that went quiet (an actor that died or
  stopped) keeps its last counts: a restarted actor is a new source, and the total never drops;
- gauges are summed over the sources heard within ``stale_after_s`` only: a dead process's
  "in flight" must not linger.

Histograms whose bucket bounds differ from the first seen (a mixed-version mesh) are skipped,
counted in ``skipped_histograms``. Local gauges are set by the hub itself (queue depths it reads
from the bus), one value per label set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rollmesh.messages.metrics import MetricKind, MetricsReported, MetricSeries
from rollmesh.telemetry.metrics_catalog import METRICS_SOURCES, MetricSpec

LabelKey = tuple[tuple[str, str], ...]


@dataclass
class AggregatedPoint:
    labels: dict[str, str]
    value: float = 0.0
    bucket_bounds: list[float] = field(default_factory=list)
    bucket_counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0


@dataclass
class AggregatedMetric:
    name: str
    kind: MetricKind
    description: str
    unit: str
    points: dict[LabelKey, AggregatedPoint] = field(default_factory=dict)


@dataclass
class _Source:
    report: MetricsReported
    heard_at: float


class MetricsAggregate:
    def __init__(self, *, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self._sources: dict[str, _Source] = {}
        self._local: dict[str, tuple[MetricSpec, dict[LabelKey, float]]] = {}
        self.reports = 0
        self.skipped_histograms = 0

    def apply(self, report: MetricsReported, now: float) -> None:
        """Take a source's snapshot (a late, older one than held is ignored)."""
        held = self._sources.get(report.source)
        if held is not None and report.reported_at < held.report.reported_at:
            return
        self._sources[report.source] = _Source(report, now)
        self.reports += 1

    def set_local_gauge(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        _, values = self._local.setdefault(spec.name, (spec, {}))
        values[_key(labels)] = float(value)

    def live_sources(self, now: float) -> list[MetricsReported]:
        return [s.report for s in self._sources.values() if now - s.heard_at <= self.stale_after_s]

    def metrics(self, now: float) -> list[AggregatedMetric]:
        """Every metric, aggregated over the sources as the module docstring says; sorted by name."""
        merged: dict[str, AggregatedMetric] = {}
        skipped = 0
        for source in self._sources.values():
            live = now - source.heard_at <= self.stale_after_s
            for series in source.report.metrics:
                if series.kind == "gauge" and not live:
                    continue
                skipped += _merge(merged, series)
        self.skipped_histograms = skipped
        for spec, values in self._local.values():
            metric = merged.setdefault(spec.name, AggregatedMetric(spec.name, "gauge", spec.description, spec.unit))
            for key, value in values.items():
                metric.points[key] = AggregatedPoint(dict(key), value)
        sources = merged.setdefault(METRICS_SOURCES.name, AggregatedMetric(
            METRICS_SOURCES.name, "gauge", METRICS_SOURCES.description, METRICS_SOURCES.unit))
        for report in self.live_sources(now):
            key = _key({"component": report.component})
            sources.points.setdefault(key, AggregatedPoint(dict(key))).value += 1
        return [merged[name] for name in sorted(merged)]


def _merge(merged: dict[str, AggregatedMetric], series: MetricSeries) -> int:
    """Add one source's series into ``merged``; returns 1 when a histogram point was skipped."""
    metric = merged.get(series.name)
    if metric is None:
        metric = merged[series.name] = AggregatedMetric(series.name, series.kind, series.description,
                                                        series.unit)
    elif metric.kind != series.kind:
        return 0  # one name, two kinds: only a mixed-version mesh does that; keep the first
    skipped = 0
    for point in series.points:
        key = _key(point.labels)
        held = metric.points.get(key)
        if held is None:
            metric.points[key] = AggregatedPoint(
                dict(key), point.value, list(point.bucket_bounds), list(point.bucket_counts),
                point.count, point.sum)
        elif series.kind != "histogram":
            held.value += point.value
        elif held.bucket_bounds == list(point.bucket_bounds) and len(held.bucket_counts) == len(point.bucket_counts):
            held.bucket_counts = [a + b for a, b in zip(held.bucket_counts, point.bucket_counts)]
            held.count += point.count
            held.sum += point.sum
        else:
            skipped += 1
    return skipped


def _key(labels: Mapping[str, str]) -> LabelKey:
    return tuple(sorted((str(k), str(v)) for k, v in labels.items()))
