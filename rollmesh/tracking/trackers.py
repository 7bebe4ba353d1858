"""The trackers a training job reports to, as one object: open them all, log to each, close them.

Knows the ``Tracker`` protocol, ``TrackingConfig`` and which module holds each backend; not how
any backend stores a run. A tracker that fails to open is a ``TrackerError`` from ``open_trackers``
(the job has not started yet, so refusing costs nothing); one that fails later is dropped with a
warning, because trackers only observe a run and must never stop it.

A run directory holds one job, so it holds one run of each backend: the run ids are kept in
``<run_dir>/trackers.json``, and a job resumed there (``rollmesh train --resume``) continues
those runs instead of opening new ones.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import structlog

from rollmesh.run_config import TrackingConfig
from rollmesh.tracking.errors import TrackerError

_log = structlog.get_logger("rollmesh.tracking")

# {backend: run id} of the runs a run directory's job logs to.
RUNS_FILE = "trackers.json"


class Tracker(Protocol):
    """One backend's run. Rows of a table are flat dicts of str, int and float."""

    backend: str
    # The backend's id of the run, to continue it on resume; None: nothing to continue (a
    # TensorBoard run is its directory).
    run_id: str | None

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None: ...

    def log_table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def _open_tensorboard(tracking: TrackingConfig, run_dir: Path, run_name: str,
                      config: dict[str, Any], resume_id: str | None) -> Tracker:
    from rollmesh.tracking.tensorboard_tracker import TensorBoardTracker
    return TensorBoardTracker(run_dir, config)


def _open_wandb(tracking: TrackingConfig, run_dir: Path, run_name: str,
                config: dict[str, Any], resume_id: str | None) -> Tracker:
    from rollmesh.tracking.wandb_tracker import WandbTracker
    return WandbTracker(run_dir, project=tracking.project, run_name=run_name,
                        mode=tracking.wandb_mode, config=config, resume_id=resume_id)


def _open_mlflow(tracking: TrackingConfig, run_dir: Path, run_name: str,
                 config: dict[str, Any], resume_id: str | None) -> Tracker:
    from rollmesh.tracking.mlflow_tracker import MlflowTracker
    return MlflowTracker(run_dir, tracking_uri=tracking.mlflow_tracking_uri,
                         experiment=tracking.project, run_name=run_name, config=config, resume_id=resume_id)


_OPENERS: dict[str, Callable[[TrackingConfig, Path, str, dict[str, Any], str | None], Tracker]] = {
    "tensorboard": _open_tensorboard,
    "wandb": _open_wandb,
    "mlflow": _open_mlflow,
}


def open_trackers(tracking: TrackingConfig, *, run_dir: Path | str, run_name: str = "",
                  config: dict[str, Any]) -> Trackers:
    """Open a run in each of ``tracking.backends`` and log ``config`` (the job's whole config as
    builtins) to it once; or continue the runs ``<run_dir>/trackers.json`` names (a resumed job).
    ``run_name`` "" is ``tracking.run_name``, else the run directory's name. Raises
    ``TrackerError`` naming the first backend that cannot open (the others are closed)."""
    run_dir = Path(run_dir)
    run_name = run_name or tracking.run_name or run_dir.resolve().name
    runs_file = run_dir / RUNS_FILE
    previous: dict[str, str] = json.loads(runs_file.read_text()) if runs_file.is_file() else {}
    opened: list[Tracker] = []
    try:
        for backend in dict.fromkeys(tracking.backends):  # a backend listed twice opens once
            try:
                opened.append(_OPENERS[backend](tracking, run_dir, run_name, config, previous.get(backend)))
            except TrackerError:
                raise
            except Exception as exc:  # the backend's own failure, in its own words
                raise TrackerError(backend, f"{type(exc).__name__}: {exc}") from exc
    except BaseException:
        Trackers(opened).close()
        raise
    runs = {**previous, **{tracker.backend: tracker.run_id for tracker in opened if tracker.run_id}}
    if runs != previous:
        runs_file.parent.mkdir(parents=True, exist_ok=True)
        runs_file.write_text(json.dumps(runs, indent=2) + "\n")
    return Trackers(opened)


class Trackers:
    """Every open tracker; each call goes to all of them. Usable as a context manager."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self._trackers = list(trackers)

    @property
    def backends(self) -> list[str]:
        """The backends still logging (one that failed is gone)."""
        return [tracker.backend for tracker in self._trackers]

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        scalars = {tag: float(value) for tag, value in scalars.items()}
        self._each("log_scalars", lambda tracker: tracker.log_scalars(step, scalars))

    def log_table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        self._each("log_table", lambda tracker: tracker.log_table(name, step, rows))

    def close(self) -> None:
        """Flush and close every tracker; a second call does nothing."""
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as exc:
                _log.warning("tracker_close_failed", backend=tracker.backend, error=repr(exc))

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self._trackers):
            try:
                call(tracker)
            except Exception as exc:
                # An observer's failure (disk full, server gone) must not stop the training job.
                _log.warning("tracker_dropped", backend=tracker.backend, during=what, error=repr(exc))
                self._trackers.remove(tracker)
                try:
                    tracker.close()
                except Exception:
                    pass  # already failing; the warning above says why
