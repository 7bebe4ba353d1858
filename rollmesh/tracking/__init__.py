"""Experiment trackers: a training job's config, per-step scalars and evaluation sample tables,
sent to TensorBoard, Weights & Biases and MLflow as ``[tracking] backends`` lists them.

``trackers`` holds the protocol and the fan-out that ``open_trackers`` returns; each backend lives
in its own module and is imported only when it is listed (wandb and mlflow are slow to import).
"""

from rollmesh.tracking.errors import TrackerError
from rollmesh.tracking.trackers import Tracker, Trackers, open_trackers

__all__ = ["Tracker", "TrackerError", "Trackers", "open_trackers"]
