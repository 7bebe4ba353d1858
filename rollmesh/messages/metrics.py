"""Metric snapshots: what each process of the mesh reports to the metrics hub. Knows msgspec only.

A process sends its whole cumulative snapshot every ``telemetry.metrics_report_s`` (core NATS: a
lost report is made good by the next one), so the hub only keeps the latest per ``source``.
Labels are bounded by construction (role, worker name, failure kind, tool result...), never ids.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rollmesh.messages.base import WireMessage

MetricKind = Literal["counter", "gauge", "histogram"]


class MetricPoint(msgspec.Struct, frozen=True, kw_only=True):
    """One label set of a metric. Counters and gauges use ``value``; histograms use the rest
    (``bucket_counts`` per bucket, not cumulative: one more than ``bucket_bounds``)."""

    labels: dict[str, str] = {}
    value: float = 0.0
    bucket_bounds: list[float] = []
    bucket_counts: list[int] = []
    count: int = 0
    sum: float = 0.0


class MetricSeries(msgspec.Struct, frozen=True, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=200, pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")]
    kind: MetricKind
    description: str = ""
    unit: str = ""
    points: list[MetricPoint] = []


class MetricsReported(WireMessage, frozen=True, tag="metrics.reported"):
    """A process's cumulative metric snapshot. ``source`` names the process (actor, pid and a
    random suffix), so a restarted actor is a new source and its old counters are kept."""

    source: Annotated[str, Meta(min_length=1, max_length=200)]
    component: str = ""
    actor: str = ""
    reported_at: float = 0.0
    metrics: list[MetricSeries] = []
