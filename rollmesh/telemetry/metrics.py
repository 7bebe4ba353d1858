"""OpenTelemetry metrics in one process: the MeterProvider, our instruments, and the snapshot.

Knows the OpenTelemetry metrics SDK and our wire messages; nothing of NATS or Ray. Logic code
records through ``add`` / ``record`` (synchronous instruments) or ``observe`` (a gauge read at
collection time from a live object), naming a ``metrics_catalog`` spec. Before ``setup_metrics``
ran (unit tests, the CLI) the API's proxy instruments drop everything, at no cost.

``setup_metrics`` installs the process-wide provider once, with an in-memory reader whose
cumulative snapshot ``collect_report`` turns into a ``MetricsReported`` message; the actor shell
sends it to the hub (``metrics_reporter``). Observed gauges hold their owner weakly, so logic
objects that are gone (a test's, a stopped actor's) stop reporting instead of staying alive.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import structlog
from opentelemetry import metrics as otel_metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricsData,
    NumberDataPoint,
    Sum,
)
from opentelemetry.sdk.resources import Resource

from rollmesh.messages.metrics import MetricPoint, MetricSeries, MetricsReported
from rollmesh.telemetry.metrics_catalog import MetricSpec

_log = structlog.get_logger("rollmesh.telemetry.metrics")
_METER = "rollmesh"

Labels = Mapping[str, str]
Read = Callable[[Any], Iterable[tuple[float, Labels]]]

_lock = threading.Lock()
_reader: InMemoryMetricReader | None = None
_source = ""
_component = ""
_actor = ""
_instruments: dict[str, Any] = {}
_observers: dict[str, list[tuple[weakref.ref, Read]]] = {}
_deferred: list[tuple[MetricSpec, float, Labels | None]] = []  # see record_deferred
DEFERRED_MAX = 256  # values waiting for a collection are recorded at once past this many


def setup_metrics(component: str, *, actor: str = "") -> None:
    """Install this process's MeterProvider (once; later calls keep the first)."""
    global _reader, _source, _component, _actor
    with _lock:
        if _reader is not None:
            return
        reader = InMemoryMetricReader()
        attributes = {"service.name": f"rollmesh.{component}"}
        otel_metrics.set_meter_provider(MeterProvider(metric_readers=[reader],
                                                      resource=Resource.create(attributes)))
        # The process, not the actor: a restarted actor is a new source, so the hub keeps the
        # counts of the process that died and adds the new one's.
        _source = f"{actor or component}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        _component, _actor = component, actor
        _reader = reader


def add(spec: MetricSpec, amount: float, labels: Labels | None = None) -> None:
    """Add to a counter or an up-down counter."""
    _instrument(spec).add(amount, attributes=dict(labels) if labels else None)


def record(spec: MetricSpec, value: float, labels: Labels | None = None) -> None:
    """Record one value in a histogram."""
    _instrument(spec).record(value, attributes=dict(labels) if labels else None)


def record_deferred(spec: MetricSpec, value: float, labels: Labels | None = None) -> None:
    """``record``, done at the next collection (or once DEFERRED_MAX values wait) instead of
    now, for a caller whose reply someone is waiting for (a sandbox exec): the OpenTelemetry
    histogram path costs tens of microseconds. Snapshots are the same, since values are only
    ever read at collection (exemplars, which rollmesh never reports, are not taken)."""
    if _reader is None:
        return  # as ``record`` before setup_metrics: dropped
    with _lock:
        _deferred.append((spec, value, labels))
        full = len(_deferred) >= DEFERRED_MAX
    if full:
        _record_deferred()


def _record_deferred() -> None:
    with _lock:
        batch = _deferred[:]
        _deferred.clear()
    for spec, value, labels in batch:
        record(spec, value, labels)


def observe(spec: MetricSpec, owner: object, read: Read) -> None:
    """Report ``read(owner)`` -> [(value, labels)] as ``spec`` at every collection, while
    ``owner`` lives. ``spec`` is a gauge, or a counter whose values are cumulative totals."""
    with _lock:
        first = spec.name not in _observers
        _observers.setdefault(spec.name, []).append((weakref.ref(owner), read))
    if first:
        meter = otel_metrics.get_meter(_METER)
        callback = _observer_callback(spec.name)
        if spec.kind == "counter":
            meter.create_observable_counter(spec.name, [callback], unit=spec.unit,
                                            description=spec.description)
        else:
            meter.create_observable_gauge(spec.name, [callback], unit=spec.unit,
                                          description=spec.description)


def _observer_callback(name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        with _lock:
            live = [(ref(), read) for ref, read in _observers.get(name, ()) if ref() is not None]
            _observers[name] = [(weakref.ref(owner), read) for owner, read in live]
        observations = []
        for owner, read in live:
            try:
                observations += [Observation(value, dict(labels)) for value, labels in read(owner)]
            except Exception as exc:  # one broken reader must not cost the whole snapshot
                _log.warning("metric_observe_failed", metric=name, error=repr(exc))
        return observations

    return callback


def _instrument(spec: MetricSpec) -> Any:
    instrument = _instruments.get(spec.name)
    if instrument is not None:
        return instrument
    with _lock:
        if spec.name not in _instruments:
            meter = otel_metrics.get_meter(_METER)
            if spec.kind == "counter":
                made = meter.create_counter(spec.name, unit=spec.unit, description=spec.description)
            elif spec.kind == "updown":
                made = meter.create_up_down_counter(spec.name, unit=spec.unit,
                                                    description=spec.description)
            elif spec.kind == "histogram":
                made = meter.create_histogram(
                    spec.name, unit=spec.unit, description=spec.description,
                    explicit_bucket_boundaries_advisory=list(spec.buckets) or None)
            else:
                raise ValueError(f"{spec.name} is an observed gauge: use observe()")
            _instruments[spec.name] = made
        return _instruments[spec.name]


def collect_report() -> MetricsReported | None:
    """This process's cumulative snapshot (None before ``setup_metrics``)."""
    reader = _reader
    if reader is None:
        return None
    _record_deferred()
    return report_from(reader.get_metrics_data(), source=_source, component=_component,
                       actor=_actor, now=time.time())


def report_from(data: MetricsData | None, *, source: str, component: str = "", actor: str = "",
                now: float = 0.0) -> MetricsReported:
    """OpenTelemetry's cumulative ``MetricsData`` as our wire message."""
    series: list[MetricSeries] = []
    for resource_metrics in (data.resource_metrics if data is not None else ()):
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                converted = _series(metric.name, metric.description, metric.unit, metric.data)
                if converted is not None:
                    series.append(converted)
    return MetricsReported(source=source, component=component, actor=actor, reported_at=now,
                           metrics=series)


def _series(name: str, description: str, unit: str, data: Any) -> MetricSeries | None:
    if isinstance(data, Histogram):
        points = [_histogram_point(point) for point in data.data_points]
        return MetricSeries(name=name, kind="histogram", description=description, unit=unit,
                            points=points)
    if isinstance(data, Sum):
        kind = "counter" if data.is_monotonic else "gauge"
    elif isinstance(data, Gauge):
        kind = "gauge"
    else:  # exponential histograms: we never create one
        return None
    points = [MetricPoint(labels=_labels(point.attributes), value=float(point.value))
              for point in data.data_points if isinstance(point, NumberDataPoint)]
    return MetricSeries(name=name, kind=kind, description=description, unit=unit, points=points)


def _histogram_point(point: HistogramDataPoint) -> MetricPoint:
    return MetricPoint(labels=_labels(point.attributes), bucket_bounds=list(point.explicit_bounds),
                       bucket_counts=list(point.bucket_counts), count=point.count, sum=point.sum)


def _labels(attributes: Mapping[str, Any] | None) -> dict[str, str]:
    return {str(key): str(value) for key, value in (attributes or {}).items()}
