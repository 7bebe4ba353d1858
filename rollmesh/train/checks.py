"""What a run file must get right before a training job starts anything.

Knows the config, rollmesh.data and the rewards' loader; nothing of the mesh. Each problem is a
``RunFileError`` naming the stage and what to fix: an unknown kind is refused by the config's own
types; here, a missing dataset or a field mapping that fits none of its first rows, a reward that
does not import, a task plugin that does not load.
"""

from __future__ import annotations

from rollmesh.config import RollmeshConfig
from rollmesh.data import DatasetError, check_dataset
from rollmesh.rewards.combined import check_reward_specs
from rollmesh.rewards.errors import RewardError
from rollmesh.rollout.tasks import load_task
from rollmesh.run_config import EvalConfig, StageConfig, stage_names
from rollmesh.train.errors import TrainError

class RunFileError(TrainError, ValueError):
    def __init__(self, reason: str, *, stage: str = "") -> None:
        super().__init__(f"stage {stage!r}: {reason}" if stage else reason)
        self.stage = stage
        self.reason = reason


def check_stages(config: RollmeshConfig) -> None:
    if not config.stages:
        raise RunFileError("the run file has no [[stages]]")
    for name, stage in zip(stage_names(config.stages), config.stages):
        if stage.epochs and not stage.data:
            raise RunFileError("epochs count passes over data: give data, or stop by steps", stage=name)
        for source in stage.mixture:
            try:
                check_dataset(source.data, fields=source.fields, kind="rl")
            except DatasetError as exc:
                raise RunFileError(f"mixture {source.label!r}: {exc}", stage=name) from exc
        _check_inputs(stage, kind=stage.kind, where=name)
    for name, evaluation in zip(stage_names(config.eval), config.eval):
        _check_inputs(evaluation, kind="rl", where=f"eval {name}")


def _check_inputs(entry: StageConfig | EvalConfig, *, kind: str, where: str) -> None:
    """A stage's or an eval's dataset, task plugin and rewards."""
    if entry.data:
        try:
            # A task plugin's rows are its own inputs: only the file is checked.
            check_dataset(entry.data, **({} if entry.task else {"fields": entry.fields, "kind": kind}))
        except DatasetError as exc:
            raise RunFileError(str(exc), stage=where) from exc
    if entry.task:
        try:
            load_task(entry.task)
        except Exception as exc:  # any import or construction error: the plugin is unusable
            raise RunFileError(f"task {entry.task!r} does not load: {exc!r}", stage=where) from exc
    try:
        check_reward_specs(entry.rewards)
    except RewardError as exc:
        raise RunFileError(str(exc), stage=where) from exc
