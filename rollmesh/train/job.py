"""A training job: the run file's ``[[stages]]``, in order, on a mesh this process starts or one it
attaches to; then the final checkpoint and ``summary.json``.

Knows the mesh launcher, the bus, Ray actor handles (the trainer's) and the feeder; the training
itself happens in the actors. Its files, in the run directory: ``train/feeder.json`` (the data
cursor, feeder_cursor.py), ``train/steps.jsonl`` (one line per trainer step, so a resumed job's
summary covers the steps before the stop), ``summary.json`` and ``final_model/`` (the final
Hugging Face checkpoint with its tokenizer).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog

from rollmesh.bus.publisher import BusPublisher
from rollmesh.bus.watcher import BusWatcher
from rollmesh.config import RollmeshConfig, TrainerConfig
from rollmesh.demo.curve import RewardCurve, window_mean
from rollmesh.mesh_address import MeshAddress
from rollmesh.messages import CheckpointConverted
from rollmesh.messages.subjects import CHECKPOINT_CONVERTED
from rollmesh.run_config import stage_names, stage_trainer_config
from rollmesh.tracking import Trackers, open_trackers
from rollmesh.train.errors import TrainError
from rollmesh.train.eval_schedule import EvalSchedule
from rollmesh.train.evaluation import Evaluation
from rollmesh.train.feeder import JobEvents, RlStageFeeder, StepRecord
from rollmesh.train.feeder_cursor import FeederCursor, read_cursor, write_cursor
from rollmesh.train.feeder_window import StagePlan, stage_steps
from rollmesh.train.prompt_source import prompt_source
from rollmesh.training.ledger import append_line
from rollmesh.train.supervised_stage import run_supervised_stage

_log = structlog.get_logger("rollmesh.train")
STEPS_FILE = "steps.jsonl"
# The job's whole config (its stages included), what `rollmesh train --resume` runs again; beside
# the mesh's config.json, which an attached mesh's run directory holds for the mesh.
JOB_CONFIG_FILE = "job.json"
FINAL_MODEL_DIR = "final_model"
# The resharder converts the final checkpoint to Hugging Face format: seconds for small models.
CONVERT_TIMEOUT_S = 600.0


class TrainerSettingsError(TrainError, RuntimeError):
    """The mesh's trainer runs with other settings than the stage's (an attached mesh started with
    another config): groups would not add up to its steps."""

    def __init__(self, stage: str, fields: list[str]) -> None:
        super().__init__(f"stage {stage!r}: the mesh's trainer runs with other settings "
                         f"({', '.join('trainer.' + field for field in fields)}); start the mesh with "
                         f"this run file, or let rollmesh train start its own")
        self.stage = stage
        self.fields = fields


def check_trainer_settings(stage: str, running: dict[str, Any], wanted: TrainerConfig) -> None:
    """TrainerSettingsError unless the mesh's trainer (its ``settings()``) runs as the stage wants."""
    actual = msgspec.convert(running, TrainerConfig)
    if actual != wanted:
        raise TrainerSettingsError(stage, sorted(key for key in wanted.__struct_fields__
                                                 if getattr(actual, key) != getattr(wanted, key)))


@dataclass
class MeshHandle:
    """What a job needs of a mesh: its address (the job connects as the "mesh" role) and its
    trainer actor; and, for a mesh the job started, how to restart the trainer with a stage's
    settings (None when attached)."""

    address: MeshAddress
    trainer: Any
    restart_trainer: Callable[[TrainerConfig], Awaitable[Any]] | None = None

    async def trainer_for(self, stage: str, wanted: TrainerConfig) -> Any:
        """The trainer, running with ``wanted``: as it is, or restarted from the last durable step
        (the previous stage's weights) with a fresh optimizer."""
        running = await self.trainer.settings.remote()
        try:
            check_trainer_settings(stage, running, wanted)
        except TrainerSettingsError:
            if self.restart_trainer is None:
                raise
            self.trainer = await self.restart_trainer(wanted)
        return self.trainer


class TrainJob:
    def __init__(self, config: RollmeshConfig, *, run_dir: Path, run_name: str,
                 report: Callable[[str], None] = print,
                 on_step: Callable[[StepRecord], None] | None = None) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.report = report
        self.on_step = on_step or (lambda record: report(record.line()))
        self.names = stage_names(config.stages)
        self.records: list[StepRecord] = _read_steps(self.run_dir)
        self.bad_rows = 0
        self.trackers: Trackers | None = None
        self.evals: EvalSchedule | None = None

    def open_trackers(self) -> Trackers:
        """The job's trackers, opened (and its config logged) before any training: one that
        cannot open is a TrackerError now, not a surprise after hours of training."""
        if self.trackers is None:
            self.trackers = open_trackers(self.config.tracking, run_dir=self.run_dir, run_name=self.run_name,
                                          config=msgspec.to_builtins(self.config))
        return self.trackers

    async def run(self, mesh: MeshHandle) -> dict[str, Any]:
        self._started = time.monotonic()
        save_job_config(self.run_dir, self.config)
        nc = await mesh.address.connect("rollmesh-train", role="mesh")
        namespace = mesh.address.namespace
        events, converted = JobEvents(), asyncio.Queue[CheckpointConverted]()
        watcher = BusWatcher(nc, namespace, name="rollmesh-train")
        await events.watch(watcher)
        await watcher.watch(CHECKPOINT_CONVERTED, converted.put_nowait)
        trackers = self.open_trackers()
        try:
            publisher = BusPublisher(nc, nc.jetstream(), namespace)
            self.evals = EvalSchedule(
                self.config.eval, run_dir=self.run_dir, trackers=trackers, report=self.report,
                make=lambda config, name: Evaluation(
                    config, name=name, run_name=self.run_name, run_dir=self.run_dir, publisher=publisher, nc=nc,
                    namespace=namespace, on_bad_row=lambda error: self.report(f"skipped bad row: {error}")))
            cursor = read_cursor(self.run_dir) or FeederCursor()
            if mesh.restart_trainer is None:
                # Attached: the trainer cannot be restarted, so every stage still to run must fit
                # it; found now, before the first stage trains anything.
                running = await mesh.trainer.settings.remote()
                for name, stage in zip(self.names, self.config.stages):
                    if name not in cursor.done_stages:
                        check_trainer_settings(name, running, stage_trainer_config(self.config.trainer, stage))
            if not cursor.stage:  # a fresh job: the baseline, before anything trains
                self.evals.before_training(await mesh.trainer.step.remote())
            for index, (name, stage) in enumerate(zip(self.names, self.config.stages)):
                if name in cursor.done_stages:
                    continue
                if stage.kind == "rl":
                    cursor = await self._run_rl_stage(index, cursor, mesh, publisher, events)
                else:
                    cursor = await self._run_supervised_stage(index, cursor, mesh)
            await self.evals.after_training(await mesh.trainer.step.remote())
            return await self._finish(mesh, converted)
        finally:
            if self.evals is not None:
                await self.evals.cancel()  # a job that failed does not wait for its evaluations
            trackers.close()
            await watcher.close(drain_timeout_s=0)
            await nc.close()

    async def _run_rl_stage(self, index: int, cursor: FeederCursor, mesh: MeshHandle,
                            publisher: BusPublisher, events: JobEvents) -> FeederCursor:
        name, stage = self.names[index], self.config.stages[index]
        trainer_config = stage_trainer_config(self.config.trainer, stage)
        await mesh.trainer_for(name, trainer_config)
        trainer_step = await mesh.trainer.step.remote()
        if cursor.stage != name:  # the stage starts now, at the trainer's current step
            cursor = FeederCursor(stage_index=index, stage=name, start_step=trainer_step,
                                  done_stages=list(cursor.done_stages))
            write_cursor(self.run_dir, cursor)
        else:  # resumed: what the trainer consumed while nobody was watching is not awaited
            consumed = await mesh.trainer.consumed_groups.remote(list(cursor.outstanding))
            cursor = cursor.with_(outstanding=sorted(set(cursor.outstanding) - set(consumed)))
        source = prompt_source(stage, name, on_bad_row=lambda error: self.report(f"skipped bad row: {error}"))
        try:
            plan = StagePlan(name=name, stage_index=index, groups_per_step=trainer_config.groups_per_step,
                             max_groups_ahead=stage.max_groups_ahead,
                             steps=stage_steps(steps=stage.steps, epochs=stage.epochs, num_rows=source.num_rows,
                                               groups_per_step=trainer_config.groups_per_step))
            self.report(f"stage {name} ({stage.kind}): {plan.steps} steps of {plan.groups_per_step} groups x "
                        f"{trainer_config.n_samples_per_prompt} rollouts, from trainer step {cursor.start_step}")
            feeder = RlStageFeeder(stage=stage, plan=plan, source=source, cursor=cursor, publisher=publisher,
                                   events=events, run_dir=self.run_dir, run_name=self.run_name,
                                   n_samples_per_prompt=trainer_config.n_samples_per_prompt,
                                   report=self._record_step)
            await feeder.run(trainer_step)
        finally:
            source.close()
        self.bad_rows += getattr(source, "bad_rows", 0)
        cursor = feeder.window.cursor.with_(done_stages=[*cursor.done_stages, name])
        write_cursor(self.run_dir, cursor)
        return cursor

    async def _run_supervised_stage(self, index: int, cursor: FeederCursor, mesh: MeshHandle) -> FeederCursor:
        name, stage = self.names[index], self.config.stages[index]
        trainer = await mesh.trainer_for(name, stage_trainer_config(self.config.trainer, stage))
        if cursor.stage != name:
            cursor = FeederCursor(stage_index=index, stage=name, start_step=await trainer.step.remote(),
                                  done_stages=list(cursor.done_stages))
            write_cursor(self.run_dir, cursor)
        await run_supervised_stage(trainer, stage, name, start_step=cursor.start_step,
                                   record=self._record_step, report=self.report)
        cursor = cursor.with_(done_stages=[*cursor.done_stages, name])
        write_cursor(self.run_dir, cursor)
        return cursor

    def _record_step(self, record: StepRecord) -> None:
        self.records.append(record)
        append_line(self.run_dir / "train" / STEPS_FILE, json.dumps(asdict(record)))
        self.on_step(record)
        if self.trackers is not None:
            self.trackers.log_scalars(record.trainer_step, step_scalars(record))
        if self.evals is not None:
            self.evals.after_step(record.trainer_step, record.stage)

    async def _finish(self, mesh: MeshHandle, converted: asyncio.Queue[CheckpointConverted]) -> dict[str, Any]:
        checkpoint = await mesh.trainer.save_checkpoint.remote()
        export = await asyncio.wait_for(_converted_from(converted, checkpoint), CONVERT_TIMEOUT_S)
        final = link_final_model(Path(export.hf_path), self.run_dir / FINAL_MODEL_DIR)
        summary = self.summary(checkpoint=checkpoint, final_model=str(final),
                               wall_s=round(time.monotonic() - self._started, 2))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        RewardCurve(step_rewards=summary["reward_per_step"], evaluations=self.evals.mean_rewards() if self.evals else []
                    ).plot(self.run_dir / "reward_curve.png", title=f"rollmesh train: {self.run_name}",
                           reward_label="reward (last rl stage; evaluations: the first [[eval]]'s mean)")
        return summary

    def summary(self, **extra: Any) -> dict[str, Any]:
        stages = []
        for name, stage in zip(self.names, self.config.stages):
            records = [record for record in self.records if record.stage == name]
            stages.append({"name": name, "kind": stage.kind, "steps": len(records),
                           "first": _metrics(records[0]) if records else None,
                           "last": _metrics(records[-1]) if records else None})
        rl = [name for name, stage in zip(self.names, self.config.stages) if stage.kind == "rl"]
        last_rl = [record.reward for record in self.records if rl and record.stage == rl[-1]]
        evaluated = self.evals.mean_rewards() if self.evals is not None else []
        failures: dict[str, int] = {}
        for record in self.records:
            for kind, count in record.failures.items():
                failures[kind] = failures.get(kind, 0) + count
        return {
            "first_window_reward": window_mean(last_rl, 0.1, last=False),
            "last_window_reward": window_mean(last_rl, 0.1, last=True),
            # The first [[eval]]'s mean reward, at its first and last evaluation (null: no [[eval]]).
            "eval_reward_first": evaluated[0][1] if evaluated else None,
            "eval_reward_last": evaluated[-1][1] if evaluated else None,
            "steps": len(last_rl),
            "rollouts": sum(record.rollouts for record in self.records if rl and record.stage == rl[-1]),
            "weight_versions": max((record.weight_version for record in self.records), default=0),
            "stages": stages,
            "evaluations": [entry for entry in (self.evals.results if self.evals else []) if entry["metrics"]],
            "reward_per_step": last_rl,
            "failures": failures,
            # Met by this process (a resumed job reads its rows again and reports them again).
            "bad_rows": self.bad_rows,
            **extra,
        }


def job_config_path(run_dir: Path) -> Path:
    return Path(run_dir) / "train" / JOB_CONFIG_FILE


def save_job_config(run_dir: Path, config: RollmeshConfig) -> None:
    path = job_config_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_bytes(msgspec.json.format(msgspec.json.encode(config)))
    staging.replace(path)


def step_scalars(record: StepRecord) -> dict[str, float]:
    """A step's scalars for the trackers, under its stage's name."""
    scalars = {f"{record.stage}/loss": record.loss, f"{record.stage}/tokens_per_s": record.tokens_per_s,
               f"{record.stage}/trainer_idle_pct": record.trainer_idle_pct,
               f"{record.stage}/weight_version": float(record.weight_version)}
    if record.reward is not None:
        scalars[f"{record.stage}/reward"] = record.reward
        scalars[f"{record.stage}/max_version_lag"] = float(record.max_version_lag)
        scalars.update({f"{record.stage}/rewards/{name}": value for name, value in record.rewards.items()})
    return scalars


def _metrics(record: StepRecord) -> dict[str, Any]:
    return {"reward": record.reward, "loss": record.loss, "tokens_per_s": record.tokens_per_s,
            "trainer_idle_pct": record.trainer_idle_pct, "rewards": record.rewards}


def _read_steps(run_dir: Path) -> list[StepRecord]:
    path = run_dir / "train" / STEPS_FILE
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                records.append(StepRecord(**json.loads(line)))
            except (ValueError, TypeError):
                continue  # a line torn by a kill
    return records


async def _converted_from(queue: asyncio.Queue[CheckpointConverted], checkpoint_path: str) -> CheckpointConverted:
    while True:
        converted = await queue.get()
        if converted.source_path == checkpoint_path:
            return converted


def link_final_model(export_dir: Path, final_dir: Path) -> Path:
    """The export's files, hard-linked (copied across filesystems) into ``final_dir``."""
    staging = final_dir.with_name(final_dir.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for source in export_dir.iterdir():
        if source.is_file():
            try:
                os.link(source, staging / source.name)
            except OSError:
                shutil.copy2(source, staging / source.name)
    shutil.rmtree(final_dir, ignore_errors=True)
    staging.replace(final_dir)
    return final_dir


def mesh_config_for(config: RollmeshConfig) -> RollmeshConfig:
    """The config a job's own mesh starts with: the first stage's trainer settings, and every
    stage's and eval's task plugin and reward functions known to the rollout workers."""
    stages = config.stages
    trainer = stage_trainer_config(config.trainer, stages[0]) if stages else config.trainer
    tasks = list(config.rollout.tasks)
    functions = list(config.rollout.reward_functions)
    for entry in [*stages, *config.eval]:
        if entry.task and entry.task not in tasks:
            tasks.append(entry.task)
        for spec in entry.rewards:
            if spec.fn and spec.fn not in functions:
                functions.append(spec.fn)
    rollout = msgspec.structs.replace(config.rollout, tasks=tasks, reward_functions=functions)
    return msgspec.structs.replace(config, trainer=trainer, rollout=rollout)
