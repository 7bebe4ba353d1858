"""The trackers' fan-out and the plain pieces of each backend: a tracker that fails mid-run is
dropped and the others go on, one that fails to open is a TrackerError that closes the rest, and
the Markdown tables TensorBoard is given. (MLflow's names and params: tests/test_tracking_mlflow.py,
which imports mlflow; this module stays quick.)"""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any

import pytest

from rollmesh.run_config import TrackingConfig
from rollmesh.tracking import TrackerError, Trackers, open_trackers
from rollmesh.tracking import trackers as trackers_module
from rollmesh.tracking.tensorboard_tracker import markdown_table, tensorboard_tag

pytestmark = pytest.mark.unit


class RecordingTracker:
    """A tracker that records its calls, and fails on the step it is told to."""

    def __init__(self, backend: str, fail_at_step: int | None = None, run_id: str | None = None) -> None:
        self.backend = backend
        self.run_id = run_id
        self.fail_at_step = fail_at_step
        self.steps: list[int] = []
        self.tables: list[str] = []
        self.closes = 0

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        if step == self.fail_at_step:
            raise OSError("disk full")
        self.steps.append(step)

    def log_table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        self.tables.append(name)

    def close(self) -> None:
        self.closes += 1


def test_tracker_failing_mid_run_is_dropped_and_the_others_keep_logging() -> None:
    failing, healthy = RecordingTracker("wandb", fail_at_step=2), RecordingTracker("mlflow")
    trackers = Trackers([failing, healthy])
    for step in (1, 2, 3):
        trackers.log_scalars(step, {"rl/reward": 0.5})
    trackers.log_table("eval/arith/samples", 3, [{"prompt": "1+1"}])
    assert trackers.backends == ["mlflow"]
    assert failing.steps == [1] and failing.closes == 1 and failing.tables == []
    assert healthy.steps == [1, 2, 3] and healthy.tables == ["eval/arith/samples"]


def test_close_is_idempotent_and_the_context_manager_closes() -> None:
    tracker = RecordingTracker("tensorboard")
    with Trackers([tracker]) as trackers:
        trackers.log_scalars(1, {"rl/loss": 1.0})
    trackers.close()
    assert tracker.closes == 1


def test_tracker_failing_to_open_is_a_tracker_error_and_closes_those_opened(monkeypatch, tmp_path) -> None:
    opened = RecordingTracker("tensorboard")

    def refuse(*args: object) -> RecordingTracker:
        raise ConnectionError("server said no")

    monkeypatch.setitem(trackers_module._OPENERS, "tensorboard", lambda *args: opened)
    monkeypatch.setitem(trackers_module._OPENERS, "mlflow", refuse)
    with pytest.raises(TrackerError) as raised:
        open_trackers(TrackingConfig(backends=["tensorboard", "mlflow"]), run_dir=tmp_path, config={})
    assert raised.value.backend == "mlflow"
    assert "ConnectionError: server said no" in raised.value.reason
    assert opened.closes == 1


def test_run_name_defaults_to_the_tracking_config_then_the_run_directory(monkeypatch, tmp_path) -> None:
    names: list[str] = []

    def record(tracking: TrackingConfig, run_dir: Path, run_name: str, config: dict,
               resume_id: str | None) -> RecordingTracker:
        names.append(run_name)
        return RecordingTracker("tensorboard")

    monkeypatch.setitem(trackers_module._OPENERS, "tensorboard", record)
    run_dir = tmp_path / "run-7"
    open_trackers(TrackingConfig(), run_dir=run_dir, config={}).close()
    open_trackers(TrackingConfig(run_name="from-config"), run_dir=run_dir, config={}).close()
    open_trackers(TrackingConfig(run_name="from-config"), run_dir=run_dir, run_name="given",
                  config={}).close()
    assert names == ["run-7", "from-config", "given"]


def test_a_resumed_job_continues_the_runs_its_run_directory_recorded(monkeypatch, tmp_path) -> None:
    resumed: list[tuple[str, str | None]] = []

    def opener(backend: str):
        def open_run(tracking, run_dir, run_name, config, resume_id) -> RecordingTracker:
            resumed.append((backend, resume_id))
            return RecordingTracker(backend, run_id=None if backend == "tensorboard" else resume_id or f"{backend}-1")
        return open_run

    for backend in ("tensorboard", "wandb", "mlflow"):
        monkeypatch.setitem(trackers_module._OPENERS, backend, opener(backend))
    tracking = TrackingConfig(backends=["tensorboard", "wandb", "mlflow"])
    open_trackers(tracking, run_dir=tmp_path, config={}).close()
    assert json.loads((tmp_path / trackers_module.RUNS_FILE).read_text()) == {"wandb": "wandb-1", "mlflow": "mlflow-1"}
    open_trackers(tracking, run_dir=tmp_path, config={}).close()  # rollmesh train --resume
    assert resumed == [("tensorboard", None), ("wandb", None), ("mlflow", None),
                       ("tensorboard", None), ("wandb", "wandb-1"), ("mlflow", "mlflow-1")]


def test_markdown_table_keeps_each_row_on_one_line_and_escapes_cells() -> None:
    rows = [{"prompt": "a | b", "completion": "line1\nline2 <script>", "reward": 0.123456789},
            {"prompt": "c", "reward": 1.0, "rewards/math": 1}]
    lines = markdown_table(rows).splitlines()
    assert lines[0] == "| prompt | completion | reward | rewards/math |"
    assert lines[2] == "| a \\| b | line1<br>line2 &lt;script&gt; | 0.123457 |  |"
    assert lines[3] == "| c |  | 1 | 1 |"
    assert len(lines) == 4


def test_tensorboard_tags_replace_what_tensorboard_rejects() -> None:
    assert tensorboard_tag("eval/arith/mean@4") == "eval/arith/mean_at_4"
    assert tensorboard_tag("eval/arith/pass@2 (k)") == "eval/arith/pass_at_2__k_"
    assert tensorboard_tag("rl/rewards/math") == "rl/rewards/math"
