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
from rollmesh.run_config import stage_names

class RunFileError(ValueError):
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
        if stage.data:
            try:
                # A task plugin's rows are its own inputs: only the file is checked.
                check_dataset(stage.data, **({} if stage.task else {"fields": stage.fields, "kind": stage.kind}))
            except DatasetError as exc:
                raise RunFileError(str(exc), stage=name) from exc
        for source in stage.mixture:
            try:
                check_dataset(source.data, fields=source.fields, kind="rl")
            except DatasetError as exc:
                raise RunFileError(f"mixture {source.label!r}: {exc}", stage=name) from exc
        if stage.task:
            try:
                load_task(stage.task)
            except Exception as exc:  # any import or construction error: the plugin is unusable
                raise RunFileError(f"task {stage.task!r} does not load: {exc!r}", stage=name) from exc
        try:
            check_reward_specs(stage.rewards)
        except RewardError as exc:
            raise RunFileError(str(exc), stage=name) from exc
    for name, evaluation in zip(stage_names(config.eval), config.eval):
        where = f"eval {name}"
        if evaluation.data:
            try:
                check_dataset(evaluation.data, **({} if evaluation.task else {"fields": evaluation.fields, "kind": "rl"}))
            except DatasetError as exc:
                raise RunFileError(str(exc), stage=where) from exc
        if evaluation.task:
            try:
                load_task(evaluation.task)
            except Exception as exc:  # any import or construction error: the plugin is unusable
                raise RunFileError(f"task {evaluation.task!r} does not load: {exc!r}", stage=where) from exc
        try:
            check_reward_specs(evaluation.rewards)
        except RewardError as exc:
            raise RunFileError(str(exc), stage=where) from exc
