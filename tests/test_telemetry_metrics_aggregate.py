"""The metrics plumbing without NATS or Ray: OpenTelemetry data to our snapshot, snapshots to the
mesh aggregate, the aggregate to the Prometheus text format and to TensorBoard scalars."""

from __future__ import annotations

import msgspec
import pytest
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rollmesh.messages import MetricPoint, MetricSeries, MetricsReported
from rollmesh.messages.subjects import METRICS_REPORTED
from rollmesh.telemetry import metrics_catalog as catalog
from rollmesh.telemetry.metrics import report_from
from rollmesh.telemetry.metrics_aggregate import MetricsAggregate
from rollmesh.telemetry.metrics_exposition import AggregateCollector, cumulative_buckets
from rollmesh.telemetry.metrics_tensorboard import scalars_of

pytestmark = pytest.mark.unit


def counter(name: str, value: float, **labels: str) -> MetricSeries:
    return MetricSeries(name=name, kind="counter", points=[MetricPoint(labels=labels, value=value)])


def gauge(name: str, value: float, **labels: str) -> MetricSeries:
    return MetricSeries(name=name, kind="gauge", points=[MetricPoint(labels=labels, value=value)])


def histogram(name: str, counts: list[int], total: float) -> MetricSeries:
    return MetricSeries(name=name, kind="histogram", points=[MetricPoint(
        bucket_bounds=[1.0, 2.0], bucket_counts=counts, count=sum(counts), sum=total)])


def report(source: str, at: float, *series: MetricSeries, component: str = "rollout") -> MetricsReported:
    return MetricsReported(source=source, component=component, reported_at=at, metrics=list(series))


def values(aggregate: MetricsAggregate, now: float) -> dict[str, dict]:
    return {m.name: {key: (p.value, p.count, p.bucket_counts) for key, p in m.points.items()}
            for m in aggregate.metrics(now)}


def test_opentelemetry_data_becomes_a_snapshot_that_survives_the_wire():
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    meter.create_counter("rollmesh_rollouts_failed").add(2, {"kind": "timeout"})
    meter.create_up_down_counter("rollmesh_things").add(-1)
    meter.create_histogram("rollmesh_lag", explicit_bucket_boundaries_advisory=[0, 1, 2]).record(1)
    meter.create_observable_gauge("rollmesh_version", [lambda options: [Observation(7, {"worker": "d-0"})]])

    snapshot = report_from(reader.get_metrics_data(), source="rw-0/1/ab", component="rollout", now=5.0)
    decoded = METRICS_REPORTED.decode(METRICS_REPORTED.encode(snapshot))

    series = {s.name: s for s in decoded.metrics}
    assert series["rollmesh_rollouts_failed"].kind == "counter"
    assert series["rollmesh_rollouts_failed"].points[0] == MetricPoint(labels={"kind": "timeout"}, value=2)
    assert series["rollmesh_things"].kind == "gauge"  # an up-down counter is no counter
    lag = series["rollmesh_lag"].points[0]
    assert (lag.bucket_bounds, lag.bucket_counts, lag.count, lag.sum) == ([0, 1, 2], [0, 1, 0, 0], 1, 1)
    assert series["rollmesh_version"].points[0].labels == {"worker": "d-0"}


def test_a_bad_metric_name_is_refused_on_decode():
    bad = msgspec.msgpack.encode({"type": "metrics.reported", "source": "s",
                                  "metrics": [{"name": "no spaces allowed", "kind": "gauge"}]})
    with pytest.raises(msgspec.ValidationError, match="name"):
        METRICS_REPORTED.decode(bad)


def test_counters_and_histograms_sum_over_sources_and_keep_a_dead_sources_counts():
    aggregate = MetricsAggregate(stale_after_s=10)
    aggregate.apply(report("a", 1, counter("c", 3), histogram("h", [1, 0, 0], 0.5), gauge("g", 2)), now=1)
    aggregate.apply(report("b", 1, counter("c", 4), histogram("h", [0, 1, 1], 4.0), gauge("g", 5)), now=1)
    seen = values(aggregate, now=2)
    assert seen["c"][()][0] == 7
    assert seen["h"][()][1:] == (3, [1, 1, 1])
    assert seen["g"][()][0] == 7
    # "a" goes quiet (its actor died; its restart is a new source): its gauge leaves, its counts stay.
    aggregate.apply(report("b", 20, counter("c", 5), histogram("h", [0, 1, 1], 4.0), gauge("g", 5)), now=20)
    seen = values(aggregate, now=20)
    assert seen["c"][()][0] == 8
    assert seen["g"][()][0] == 5
    assert seen["h"][()][1] == 3


def test_a_newer_snapshot_replaces_the_older_and_a_late_one_is_ignored():
    aggregate = MetricsAggregate(stale_after_s=10)
    aggregate.apply(report("a", 5, counter("c", 9)), now=5)
    aggregate.apply(report("a", 4, counter("c", 1)), now=6)  # delivered late
    assert values(aggregate, 6)["c"][()][0] == 9
    aggregate.apply(report("a", 7, counter("c", 12)), now=7)
    assert values(aggregate, 7)["c"][()][0] == 12


def test_histograms_with_other_bounds_are_skipped_and_counted():
    aggregate = MetricsAggregate(stale_after_s=10)
    other = MetricSeries(name="h", kind="histogram", points=[MetricPoint(
        bucket_bounds=[5.0], bucket_counts=[1, 1], count=2, sum=9.0)])
    aggregate.apply(report("a", 1, histogram("h", [1, 0, 0], 0.5)), now=1)
    aggregate.apply(report("b", 1, other), now=1)
    assert values(aggregate, 1)["h"][()][1] == 1
    assert aggregate.skipped_histograms == 1


def test_the_hub_counts_live_sources_by_component_and_holds_its_own_gauges():
    aggregate = MetricsAggregate(stale_after_s=10)
    aggregate.apply(report("a", 1, component="decode"), now=1)
    aggregate.apply(report("b", 1, component="decode"), now=1)
    aggregate.set_local_gauge(catalog.QUEUE_DEPTH, {"queue": "rollout_requests", "worker": ""}, 3)
    aggregate.set_local_gauge(catalog.QUEUE_DEPTH, {"queue": "rollout_requests", "worker": ""}, 2)
    seen = values(aggregate, 2)
    assert seen[catalog.METRICS_SOURCES.name][(("component", "decode"),)][0] == 2
    assert seen[catalog.QUEUE_DEPTH.name][(("queue", "rollout_requests"), ("worker", ""))][0] == 2
    assert values(aggregate, 30)[catalog.METRICS_SOURCES.name] == {}


def test_the_exposition_parses_back_with_prometheus_clients_parser():
    aggregate = MetricsAggregate(stale_after_s=10)
    aggregate.apply(report("a", 1, counter("rollmesh_rollouts_failed", 2, kind="timeout"),
                           histogram("rollmesh_version_lag", [2, 1, 1], 5.0),
                           gauge("rollmesh_queue_depth", 4, queue="decode", worker="decode-0")), now=1)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AggregateCollector(lambda: aggregate.metrics(1)))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}

    failed = families["rollmesh_rollouts_failed"]
    assert failed.type == "counter"
    assert [(s.name, s.labels, s.value) for s in failed.samples] == [
        ("rollmesh_rollouts_failed_total", {"kind": "timeout"}, 2.0)]
    buckets = [(s.labels["le"], s.value) for s in families["rollmesh_version_lag"].samples
               if s.name.endswith("_bucket")]
    assert buckets == [("1.0", 2.0), ("2.0", 3.0), ("+Inf", 4.0)]
    assert families["rollmesh_queue_depth"].samples[0].labels == {"queue": "decode", "worker": "decode-0"}


def test_cumulative_buckets_end_with_the_total_count():
    assert cumulative_buckets([0.5, 1.0], [1, 2, 3]) == [("0.5", 1.0), ("1.0", 3.0), ("+Inf", 6.0)]


def test_tensorboard_scalars_name_each_label_set():
    aggregate = MetricsAggregate(stale_after_s=10)
    aggregate.apply(report("a", 1, counter("c", 3, kind="timeout"), histogram("h", [1, 1, 0], 3.0),
                           gauge("g", 2)), now=1)
    assert scalars_of(aggregate.metrics(1)) == {
        "c/kind=timeout/total": 3, "g": 2, "h/count": 2, "h/sum": 3.0, "h/mean": 1.5,
        f"{catalog.METRICS_SOURCES.name}/component=rollout": 1}


def test_every_catalogued_metric_has_a_prometheus_name_and_bounded_labels():
    names = [spec.name for spec in catalog.ALL_METRICS]
    assert len(set(names)) == len(names)
    for spec in catalog.ALL_METRICS:
        assert spec.name.startswith("rollmesh_") and not spec.name.endswith("_total")
        assert not {"rollout_id", "lease_id", "group_id", "request_id", "trace_id"} & set(spec.labels)
        assert (spec.kind == "histogram") == bool(spec.buckets)


def test_a_deferred_histogram_value_is_in_the_next_snapshot():
    """``record_deferred`` (the sandbox broker's exec durations) leaves the caller's hot path but
    not the snapshot: the next collection holds the value."""
    from rollmesh.telemetry import metrics

    metrics.setup_metrics("metrics-test")  # process-wide and in memory (a no-op when already set up)

    def recorded() -> int:
        snapshot = metrics.collect_report()
        assert snapshot is not None
        return sum(point.count for series in snapshot.metrics if series.name == catalog.SANDBOX_EXEC_DURATION.name
                   for point in series.points if point.labels.get("result") == "deferred-test")

    before = recorded()
    metrics.record_deferred(catalog.SANDBOX_EXEC_DURATION, 0.002, {"result": "deferred-test"})
    metrics.record_deferred(catalog.SANDBOX_EXEC_DURATION, 0.003, {"result": "deferred-test"})
    assert recorded() == before + 2
