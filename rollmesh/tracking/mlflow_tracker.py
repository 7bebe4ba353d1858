"""The MLflow tracker: one MLflow run, by default in ``sqlite:///<run_dir>/mlflow.db``.

Knows the ``mlflow`` package, through an ``MlflowClient`` and an explicit run id (no global
active run, so it shares a process with anything else). The experiment is ``[tracking] project``;
with the default database its artifacts go to ``<run_dir>/mlflow-artifacts`` (MLflow would put
them in ``./mlruns`` of the working directory). The config is logged twice: as params with dotted
keys (values cut to MLflow's length limit) for searching, and whole as the artifact
``config.json``. Sample tables are the artifacts ``tables/<name>_step<step>.json``. MLflow names
allow only letters, digits and ``_-. :/``: ``mean@4`` is logged as ``mean_at_4``, any other
character as ``_``. ``resume_id`` continues that run: it is marked running again, and its
params and config, logged when it was created, are not logged twice.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

DATABASE = "mlflow.db"
ARTIFACTS_DIR = "mlflow-artifacts"
_NOT_IN_NAMES = re.compile(r"[^/\w.\- :]")


class MlflowTracker:
    backend = "mlflow"

    def __init__(self, run_dir: Path, *, tracking_uri: str, experiment: str, run_name: str,
                 config: dict[str, Any], resume_id: str | None = None) -> None:
        run_dir = Path(run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = tracking_uri or f"sqlite:///{run_dir / DATABASE}"
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self._closed = False
        if resume_id is not None:
            self.run_id = self.client.get_run(resume_id).info.run_id  # a run that is gone raises
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            return
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            # A tracking server chooses its own artifact store; a database of our own keeps the
            # artifacts beside it in the run directory.
            location = None if tracking_uri else (run_dir / ARTIFACTS_DIR).as_uri()
            experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(key, str(value)[:MAX_PARAM_VAL_LENGTH])
                  for key, value in flat_params(config).items()]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + MAX_PARAMS_TAGS_PER_BATCH])
        self.client.log_text(self.run_id, json.dumps(config, indent=2, sort_keys=True, default=str),
                             "config.json")

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        now_ms = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(key), value, now_ms, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + MAX_METRICS_PER_BATCH])

    def log_table(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        data = {column: [row.get(column) for row in rows] for column in columns}
        self.client.log_table(self.run_id, data=data, artifact_file=f"tables/{mlflow_name(name)}_step{step}.json")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.client.set_terminated(self.run_id, status=RunStatus.to_string(RunStatus.FINISHED))


def mlflow_name(name: str) -> str:
    """A metric or table name MLflow accepts (it rejects ``@``, which pass@k and mean@k use)."""
    return _NOT_IN_NAMES.sub("_", name.replace("@", "_at_"))


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables as dotted keys (``trainer.lr``); lists stay whole values (``stages`` is
    searchable as its JSON text, cut to the limit; ``config.json`` has it all)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value, default=str) if isinstance(value, list) else value
    return flat
