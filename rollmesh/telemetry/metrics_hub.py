"""The metrics hub's logic: the mesh's metrics in one place, served to Prometheus and written for
TensorBoard.

Knows the aggregate, the Prometheus endpoint and the TensorBoard writer; nothing of NATS (its
shell, ``rollmesh.metrics_hub_shell``, feeds it snapshots and queue depths). Runs in the
``rollmesh up`` process. Snapshots arrive on the event loop while scrapes come on the HTTP
server's thread, hence the lock around the aggregate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from rollmesh.config import TelemetryConfig
from rollmesh.moved_names import forward_moved_names
from rollmesh.messages.metrics import MetricsReported
from rollmesh.telemetry.metrics_aggregate import AggregatedMetric, MetricsAggregate
from rollmesh.telemetry.metrics_catalog import QUEUE_DEPTH
from rollmesh.telemetry.metrics_exposition import MetricsEndpoint, serve_metrics
from rollmesh.telemetry.metrics_tensorboard import TensorBoardScalars

# Deprecated: renamed for its role.
__getattr__ = forward_moved_names(__name__, {"MetricsHub": "rollmesh.telemetry.metrics_hub:MetricsHubLogic"})

# A source missing this many report intervals is gone: its gauges leave the aggregate.
STALE_AFTER_REPORTS = 3


class MetricsHubLogic:
    def __init__(self, config: TelemetryConfig, run_dir: Path, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.clock = clock
        self.aggregate = MetricsAggregate(stale_after_s=max(10.0, STALE_AFTER_REPORTS * config.metrics_report_s))
        self._lock = threading.Lock()
        self._endpoint: MetricsEndpoint | None = None
        self._tensorboard: TensorBoardScalars | None = None
        self._next_tensorboard = 0.0

    @property
    def url(self) -> str:
        return self._endpoint.url if self._endpoint else ""

    def start(self) -> str:
        """Open the TensorBoard directory and serve ``/metrics``; returns the URL."""
        self._tensorboard = TensorBoardScalars(self.run_dir)
        self._next_tensorboard = self.clock() + self.config.tensorboard_every_s
        self._endpoint = serve_metrics(self.metrics, host=self.config.metrics_host,
                                       port=self.config.metrics_port)
        return self._endpoint.url

    def receive(self, report: MetricsReported) -> None:
        with self._lock:
            self.aggregate.apply(report, self.clock())

    def set_queue_depth(self, queue: str, depth: int) -> None:
        with self._lock:
            self.aggregate.set_local_gauge(QUEUE_DEPTH, {"queue": queue, "worker": ""}, depth)

    def metrics(self) -> list[AggregatedMetric]:
        with self._lock:
            return self.aggregate.metrics(self.clock())

    def tick(self) -> bool:
        """Write TensorBoard scalars when ``tensorboard_every_s`` has passed; True if it wrote."""
        now = self.clock()
        if self._tensorboard is None or now < self._next_tensorboard:
            return False
        self._next_tensorboard = now + self.config.tensorboard_every_s
        self._tensorboard.write(self.metrics(), now)
        return True

    def close(self) -> None:
        """Write the last scalars, stop serving."""
        if self._tensorboard is not None:
            self._tensorboard.write(self.metrics(), self.clock())
            self._tensorboard.close()
            self._tensorboard = None
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
