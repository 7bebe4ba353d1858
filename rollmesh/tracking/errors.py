"""Errors of the experiment trackers.

Knows nothing but the standard library. A backend's own exception (wandb's, MLflow's, an OSError)
is wrapped at the boundary with ``raise TrackerError(...) from exc``::

    TrackerError   a tracker could not be opened (backend: "tensorboard" | "wandb" | "mlflow";
                   reason: what went wrong, in the backend's words)
"""

from __future__ import annotations


class TrackerError(RuntimeError):
    """A tracker could not be opened: ``rollmesh train`` refuses to start rather than train a run
    nobody can see. (A tracker that fails later is dropped with a warning; it never raises.)"""

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"tracker {backend}: {reason}")
        self.backend = backend
        self.reason = reason
