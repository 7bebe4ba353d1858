"""The feeder of an RL stage: publishes its prompts to the mesh in groups, ahead of the trainer,
and follows the trainer's steps until the stage is done.

A thin NATS shell around ``FeederWindow`` (what to publish) and ``PromptSource`` (what a position
is). Knows the bus (it is a client like any user's) and the run directory's feeder cursor;
nothing of Ray. One group per prompt: ``n_samples_per_prompt`` rollout requests sharing its group
id. The cursor is written after each group is acknowledged, so a killed job resumes without
skipping or repeating a prompt (feeder_cursor.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from rollmesh.messages import (
    GroupDropped,
    RolloutCompleted,
    RolloutFailed,
    RolloutRequested,
    TrainerStepped,
)
from rollmesh.messages.subjects import (
    GROUP_DROPPED,
    ROLLOUT_COMPLETED,
    ROLLOUT_FAILED,
    ROLLOUT_REQUESTED,
    TRAINER_STEPPED,
)
from rollmesh.ports import Publisher
from rollmesh.run_config import StageConfig
from rollmesh.train.feeder_cursor import FeederCursor, write_cursor
from rollmesh.train.feeder_window import FeederWindow, StagePlan
from rollmesh.train.prompt_source import PromptSource
from rollmesh.training.prompt_ids import parse_group_id

if TYPE_CHECKING:
    from rollmesh.bus.watcher import BusWatcher

_log = structlog.get_logger("rollmesh.train.feeder")


@dataclass
class StepRecord:
    """One trainer step as the job reports it (the progress line's keys, and the summary's)."""

    stage: str
    kind: str
    step: int  # the stage's own step, from 1
    trainer_step: int
    reward: float | None  # None for a supervised stage (its line says reward=nan)
    loss: float
    tokens_per_s: float
    trainer_idle_pct: float
    weight_version: int
    rewards: dict[str, float] = field(default_factory=dict)  # each named reward's mean
    # The stage's training rollouts that completed, and those that failed by kind, since the
    # previous step: summed over steps.jsonl, they count a resumed job's whole run.
    rollouts: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    max_version_lag: int = 0  # the step's generation lag (TrainerStepped.max_generation_lag)
    logprob_mismatch: float | None = None  # the step's (TrainerStepped.logprob_mismatch)

    def line(self) -> str:
        reward = "nan" if self.reward is None else f"{self.reward:.4f}"
        return (f"stage={self.stage} kind={self.kind} step={self.step} reward={reward} "
                f"loss={self.loss:.4f} tokens_per_s={self.tokens_per_s:.1f} "
                f"trainer_idle_pct={self.trainer_idle_pct:.1f}")


class JobEvents:
    """The mesh's events a training job follows, queued for whichever stage is running."""

    def __init__(self) -> None:
        self.trainer = asyncio.Queue[TrainerStepped | GroupDropped]()
        self.rollouts = asyncio.Queue[RolloutCompleted | RolloutFailed]()

    def _keep(self, outcome: RolloutCompleted | RolloutFailed) -> None:
        if outcome.purpose == "train" and parse_group_id(outcome.group_id) is not None:
            self.rollouts.put_nowait(outcome)

    async def watch(self, watcher: BusWatcher) -> None:
        """Follow the events on ``watcher``. Only the feeder's own training rollouts are kept:
        evaluations and other clients' rollouts would pile up while no rl stage reads the queue
        (a supervised stage)."""
        await watcher.watch(TRAINER_STEPPED, self.trainer.put_nowait)
        await watcher.watch(GROUP_DROPPED, self.trainer.put_nowait)
        await watcher.watch(ROLLOUT_COMPLETED, self._keep)
        await watcher.watch(ROLLOUT_FAILED, self._keep)


@dataclass
class RolloutTally:
    """What the stage's rollouts did between two steps: tokens, named rewards, failures."""

    tokens: int = 0
    rollouts: int = 0
    components: dict[str, list[float]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)

    def add(self, outcome: RolloutCompleted | RolloutFailed) -> None:
        if isinstance(outcome, RolloutFailed):
            self.failures[outcome.kind] = self.failures.get(outcome.kind, 0) + 1
            return
        self.rollouts += 1
        self.tokens += outcome.num_tokens
        for name, value in outcome.reward_components.items():
            self.components.setdefault(name, []).append(value)

    def means(self) -> dict[str, float]:
        return {name: sum(values) / len(values) for name, values in self.components.items() if values}


class RlStageFeeder:
    def __init__(self, *, stage: StageConfig, plan: StagePlan, source: PromptSource, cursor: FeederCursor,
                 publisher: Publisher, events: JobEvents, run_dir: Path, run_name: str,
                 n_samples_per_prompt: int, report: Callable[[StepRecord], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stage, self.plan, self.source = stage, plan, source
        self.window = FeederWindow(plan, cursor)
        self.publisher, self.events = publisher, events
        self.run_dir, self.run_name = Path(run_dir), run_name
        self.n_samples = n_samples_per_prompt
        self.report = report
        self.clock = clock
        self.steps: list[StepRecord] = []
        self.failures: dict[str, int] = {}
        self.train_rollouts = 0
        self.last_version = 0

    async def run(self, trainer_step: int) -> list[StepRecord]:
        """Feed the stage from ``trainer_step`` (the trainer's durable step now) until its last step."""
        tally, since = RolloutTally(), self.clock()
        await self._fill(trainer_step)
        while not self.window.finished(trainer_step):
            event = await self._next_trainer_event(tally)
            if isinstance(event, GroupDropped):
                self._write(self.window.dropped(event.group_id))
            else:
                trainer_step = event.step
                self._write(self.window.consumed(event.groups))
                now = self.clock()
                self.steps.append(self._record(event, tally, now - since))
                self.report(self.steps[-1])
                tally, since = RolloutTally(), now
            await self._fill(trainer_step)
        return self.steps

    async def _next_trainer_event(self, tally: RolloutTally) -> TrainerStepped | GroupDropped:
        """The next trainer event; the stage's rollout outcomes are tallied meanwhile."""
        trainer_event = asyncio.ensure_future(self.events.trainer.get())
        try:
            while True:
                rollout_event = asyncio.ensure_future(self.events.rollouts.get())
                done, _ = await asyncio.wait({trainer_event, rollout_event}, return_when=asyncio.FIRST_COMPLETED)
                if rollout_event in done:
                    self._tally(rollout_event.result(), tally)
                else:
                    rollout_event.cancel()
                if trainer_event in done:
                    return trainer_event.result()
        finally:
            trainer_event.cancel()

    def _tally(self, outcome: RolloutCompleted | RolloutFailed, tally: RolloutTally) -> None:
        ref = parse_group_id(outcome.group_id)
        # A mixture's prompts are named "<stage>.<source>": stage names hold no dot.
        if outcome.purpose != "train" or ref is None or ref.stage.split(".")[0] != self.plan.name:
            return
        tally.add(outcome)
        if isinstance(outcome, RolloutFailed):
            self.failures[outcome.kind] = self.failures.get(outcome.kind, 0) + 1
        else:
            self.train_rollouts += 1

    def _record(self, stepped: TrainerStepped, tally: RolloutTally, interval_s: float) -> StepRecord:
        self.last_version = stepped.weight_version
        idle = 100.0 * max(0.0, interval_s - stepped.duration_s) / interval_s if interval_s > 0 else 0.0
        return StepRecord(
            stage=self.plan.name, kind=self.stage.kind, step=self.window.steps_done(stepped.step),
            trainer_step=stepped.step, reward=stepped.reward_mean, loss=stepped.loss,
            tokens_per_s=tally.tokens / interval_s if interval_s > 0 else 0.0,
            trainer_idle_pct=idle, weight_version=stepped.weight_version, rewards=tally.means(),
            rollouts=tally.rollouts, failures=dict(tally.failures), max_version_lag=stepped.max_generation_lag,
            logprob_mismatch=stepped.logprob_mismatch)

    async def _fill(self, trainer_step: int) -> None:
        for _ in range(self.window.wanted(trainer_step)):
            next_position, ref, task_input = await asyncio.to_thread(
                self.source.at, self.window.cursor.next_position)
            for member in range(self.n_samples):
                await self.publisher.publish(ROLLOUT_REQUESTED, RolloutRequested(
                    rollout_id=ref.rollout_id(self.run_name, member), task=self.source.task,
                    task_input=task_input, group_id=ref.group_id, purpose="train",
                    sampling=self.stage.sampling, max_turns=self.stage.max_turns, requested_at=time.time()))
            # Only now: a kill before this line publishes the group again, never skips it.
            self._write(self.window.published(ref.group_id, next_position))

    def _write(self, cursor: FeederCursor) -> None:
        write_cursor(self.run_dir, cursor)
