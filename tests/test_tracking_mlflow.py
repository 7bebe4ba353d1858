"""The MLflow tracker against the real package, offline: a run in ``sqlite:///<run dir>/mlflow.db``
whose params, config artifact, metrics of two steps and sample table are read back through
``MlflowClient``. One run for the module (importing mlflow and creating its database take
seconds); mlflow is imported inside the fixture, with telemetry off, so it never reaches out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollmesh.run_config import TrackingConfig
from rollmesh.tracking import TrackerError, open_trackers

pytestmark = pytest.mark.unit

CONFIG = {"model": {"path": "/models/tiny"}, "trainer": {"lr": 1e-5, "megatron": {"data_parallel": 2}},
          "stages": [{"kind": "rl", "steps": 2}], "serve": {"api_key_file": "/secrets/key"},
          "notes": "x" * 7000}
ROWS = [{"prompt": "1+1=?", "completion": "2", "reward": 1.0, "rewards/math": 1.0},
        {"prompt": "2+2=?", "completion": "5 | or so", "reward": 0.0, "rewards/math": 0.0}]


@pytest.fixture(scope="module")
def mlflow_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        tracking = TrackingConfig(backends=["mlflow"], project="tiny-math", run_name="first")
        with open_trackers(tracking, run_dir=run_dir, config=CONFIG) as trackers:
            trackers.log_scalars(1, {"rl/reward": 0.25, "rl/loss": 1.5})
            trackers.log_scalars(2, {"rl/reward": 0.75, "rl/loss": 1.0, "eval/arith/mean@4": 0.5})
            trackers.log_table("eval/arith/samples", 2, ROWS)
            assert trackers.backends == ["mlflow"]
        from mlflow import MlflowClient
        client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("tiny-math")
        (run,) = client.search_runs([experiment.experiment_id])
        yield run_dir, client, run


def test_run_is_named_finished_and_keeps_artifacts_in_the_run_directory(mlflow_run) -> None:
    run_dir, _, run = mlflow_run
    assert run.info.run_name == "first"
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith((run_dir / "mlflow-artifacts").as_uri())


def test_config_is_params_with_dotted_keys_and_the_whole_config_json(mlflow_run, tmp_path) -> None:
    _, client, run = mlflow_run
    params = run.data.params
    assert params["trainer.lr"] == "1e-05"
    assert params["trainer.megatron.data_parallel"] == "2"
    assert params["serve.api_key_file"] == "/secrets/key"
    assert json.loads(params["stages"]) == [{"kind": "rl", "steps": 2}]
    assert params["notes"] == "x" * 6000  # MLflow's limit; config.json has the whole value
    path = client.download_artifacts(run.info.run_id, "config.json", str(tmp_path))
    assert json.loads(Path(path).read_text()) == CONFIG


def test_scalars_of_each_step_are_metric_history(mlflow_run) -> None:
    _, client, run = mlflow_run
    history = client.get_metric_history(run.info.run_id, "rl/reward")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "rl/loss")] == [
        (1, 1.5), (2, 1.0)]
    # MLflow rejects '@' in names.
    assert [(m.step, m.value) for m in client.get_metric_history(
        run.info.run_id, "eval/arith/mean_at_4")] == [(2, 0.5)]


def test_sample_table_is_an_artifact_mlflow_loads_back(mlflow_run, monkeypatch) -> None:
    run_dir, client, run = mlflow_run
    # load_table finds runs through mlflow.search_runs, which reads the global tracking URI (its
    # default would be ./mlflow.db), not the client's.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{run_dir / 'mlflow.db'}")
    table = client.load_table(run.info.experiment_id, "tables/eval/arith/samples_step2.json",
                              run_ids=[run.info.run_id])
    assert table[["prompt", "completion", "reward", "rewards/math"]].to_dict("records") == ROWS


def test_tracking_uri_mlflow_cannot_use_is_a_tracker_error(mlflow_run, tmp_path) -> None:
    tracking = TrackingConfig(backends=["mlflow"], mlflow_tracking_uri="nosuchstore://nowhere")
    with pytest.raises(TrackerError) as raised:
        open_trackers(tracking, run_dir=tmp_path, config=CONFIG)
    assert raised.value.backend == "mlflow"
    assert "nosuchstore" in raised.value.reason


def test_mlflow_names_replace_what_mlflow_rejects() -> None:
    from rollmesh.tracking.mlflow_tracker import mlflow_name
    assert mlflow_name("eval/arith/mean@4") == "eval/arith/mean_at_4"
    assert mlflow_name("rl/rewards/math") == "rl/rewards/math"
    assert mlflow_name("x(y)!") == "x_y__"


def test_flat_params_are_dotted_keys_with_lists_as_json() -> None:
    from rollmesh.tracking.mlflow_tracker import flat_params
    config = {"trainer": {"lr": 1e-5, "megatron": {"data_parallel": 2}}, "stages": [{"kind": "rl"}],
              "tracking": {}, "name": "run"}
    assert flat_params(config) == {"trainer.lr": 1e-5, "trainer.megatron.data_parallel": 2,
                                   "stages": '[{"kind": "rl"}]', "tracking": {}, "name": "run"}


def test_a_resumed_job_logs_on_into_the_same_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    tracking = TrackingConfig(backends=["mlflow"], project="tiny-math")
    with open_trackers(tracking, run_dir=tmp_path, config=CONFIG) as trackers:
        trackers.log_scalars(1, {"rl/reward": 0.25})
    with open_trackers(tracking, run_dir=tmp_path, config=CONFIG) as trackers:  # rollmesh train --resume
        trackers.log_scalars(2, {"rl/reward": 0.5})
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny-math").experiment_id])
    history = client.get_metric_history(run.info.run_id, "rl/reward")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5)]
    assert run.info.status == "FINISHED"
