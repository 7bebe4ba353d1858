"""TensorBoard scalars of the aggregate, under ``<run_dir>/tensorboard/``.

Knows tensorboardX (a small event-file writer that needs neither TensorFlow nor the TensorBoard
server) and our aggregated metrics. One tag per metric and label set ("name" or
"name/label=value,..."): counters as their total and their rate per second since the previous
write ("<tag>/per_s": generated tokens per second), gauges as their value, histograms as their
count, sum and mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rollmesh.telemetry.metrics_aggregate import AggregatedMetric

TENSORBOARD_DIR = "tensorboard"

# tensorboardX imports torch whenever it is installed (seconds); the hub runs in the launcher
# process, so the writer is made at the first write, on the hub's tick thread, not at start.
if TYPE_CHECKING:
    from tensorboardX import SummaryWriter


def scalars_of(metrics: list[AggregatedMetric]) -> dict[str, float]:
    """The scalars one write records, by tag (rates are the writer's, not here)."""
    scalars: dict[str, float] = {}
    for metric in metrics:
        for point in metric.points.values():
            tag = metric.name
            if point.labels:
                tag += "/" + ",".join(f"{k}={v}" for k, v in sorted(point.labels.items()))
            if metric.kind == "histogram":
                scalars[f"{tag}/count"] = float(point.count)
                scalars[f"{tag}/sum"] = point.sum
                if point.count:
                    scalars[f"{tag}/mean"] = point.sum / point.count
            elif metric.kind == "counter":
                scalars[f"{tag}/total"] = point.value
            else:
                scalars[tag] = point.value
    return scalars


class TensorBoardScalars:
    def __init__(self, run_dir: Path) -> None:
        self.directory = Path(run_dir) / TENSORBOARD_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self._writer: SummaryWriter | None = None
        self._step = 0
        self._previous: tuple[float, dict[str, float]] | None = None

    def write(self, metrics: list[AggregatedMetric], now: float) -> int:
        """Append one step of scalars and flush it to disk; returns how many were written."""
        scalars = scalars_of(metrics)
        if self._previous is not None and now > self._previous[0]:
            before_at, before = self._previous
            for tag, value in list(scalars.items()):
                if tag.endswith("/total") and tag in before:
                    scalars[tag.removesuffix("/total") + "/per_s"] = (value - before[tag]) / (now - before_at)
        self._previous = (now, {tag: v for tag, v in scalars.items() if tag.endswith("/total")})
        self._step += 1
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=str(self.directory), flush_secs=3600)
        for tag, value in sorted(scalars.items()):
            self._writer.add_scalar(tag, value, global_step=self._step, walltime=now)
        self._writer.flush()
        return len(scalars)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
