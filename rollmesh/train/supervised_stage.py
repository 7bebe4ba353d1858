"""A supervised stage (``sft``, ``midtrain``) of a training job: step after step on the trainer
actor until the stage's stopping rule (steps, epochs or tokens) is met.

Knows the trainer actor's ``supervised_step`` and ``stage_cursor`` and the job's step records;
nothing of NATS. The trainer reads, renders, packs and trains the data itself (the dataset is
never sent through Ray) and records the stage's place in its ledger with each durable step, so a
resumed stage asks the trainer where it was: no example is trained twice or skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from rollmesh.data import check_dataset
from rollmesh.run_config import StageConfig
from rollmesh.train.feeder import StepRecord


async def run_supervised_stage(trainer: Any, stage: StageConfig, name: str, *, start_step: int,
                               record: Callable[[StepRecord], None], report: Callable[[str], None],
                               clock: Callable[[], float] = time.monotonic) -> None:
    place = await trainer.stage_cursor.remote(name)
    position, tokens = int(place.get("next_position", 0)), int(place.get("tokens", 0))
    trainer_step = await trainer.step.remote()
    end_position = stage.epochs * check_dataset(stage.data) if stage.epochs else None
    rule = (f"{stage.steps} steps" if stage.steps else f"{stage.epochs} epochs" if stage.epochs
            else f"{stage.tokens} tokens")
    report(f"stage {name} ({stage.kind}): {rule} of about {stage.batch_tokens} tokens a step, "
           f"from trainer step {start_step}" + (f", resumed at row position {position}" if position else ""))
    built_ins = msgspec.to_builtins(stage)
    since = clock()
    while not _finished(stage, steps=trainer_step - start_step, position=position, tokens=tokens,
                        end_position=end_position):
        result = await trainer.supervised_step.remote(built_ins, name, position=position, tokens_before=tokens,
                                                      end_position=end_position)
        for reason in result["bad_rows"]:
            report(f"skipped bad row: {reason}")
        if result["mismatches"]:
            report(f"stage {name}: {result['mismatches']} example(s) whose loss mask differs from the "
                   f"chat template's assistant spans")
        if result["examples"] == 0 and result["next_position"] == position:
            break  # nothing left to read before the stage's end
        position, tokens, trainer_step = result["next_position"], tokens + result["tokens"], result["step"]
        now = clock()
        interval = max(now - since, 1e-9)
        since = now
        record(StepRecord(
            stage=name, kind=stage.kind, step=trainer_step - start_step, trainer_step=trainer_step,
            reward=None, loss=result["loss"], tokens_per_s=result["tokens"] / interval,
            trainer_idle_pct=100.0 * max(0.0, interval - result["duration_s"]) / interval,
            weight_version=result["weight_version"]))


def _finished(stage: StageConfig, *, steps: int, position: int, tokens: int, end_position: int | None) -> bool:
    if stage.steps:
        return steps >= stage.steps
    if stage.epochs:
        return end_position is not None and position >= end_position
    return tokens >= stage.tokens
