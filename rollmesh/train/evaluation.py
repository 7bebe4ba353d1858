"""One ``[[eval]]`` of a training job: its held-out prompts rolled out ``n_samples`` times each on
the mesh, scored, and written as a sample table.

Knows the eval config, rollmesh.data, task plugins, the rollout messages, a ``Publisher`` and a
nats-py client its ``BusWatcher`` follows the outcomes on; nothing of Ray or the trainer (which ignores ``purpose =
"eval"`` rollouts). The prompts are read once: the first ``size`` good rows of ``data`` in file
order (bad rows reported and skipped), or ``size`` held-out inputs a task plugin samples by
``seed``, so every evaluation of a run sees the same prompts. The metrics are
rollmesh.train.eval_metrics'. Each evaluation is one group (``eval-<name>-<step>``) and listens for
its own outcomes, so several may run at once, alongside training.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from rollmesh.bus.watcher import BusWatcher
from rollmesh.data import BadRowError, EmptyDatasetError, map_row, open_dataset
from rollmesh.messages import RolloutCompleted, RolloutFailed, RolloutRequested
from rollmesh.messages.subjects import ROLLOUT_COMPLETED, ROLLOUT_FAILED, ROLLOUT_REQUESTED
from rollmesh.ports import Publisher
from rollmesh.rollout.tasks import DemonstrableTask, Task, load_task
from rollmesh.run_config import EvalConfig
from rollmesh.train.dataset_input import DATASET_TASK, dataset_task_input, reward_entries
from rollmesh.train.eval_metrics import EvalSample, eval_metrics, normalize_answer

_log = structlog.get_logger("rollmesh.train.eval")

# How long an evaluation waits for its outcomes before it counts the missing ones as failed.
DEFAULT_TIMEOUT_S = 3600.0
# The failure kind of a sample whose outcome never came.
TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class EvalPrompt:
    text: str  # the last user message's text (for the table)
    task_input: dict[str, Any]


@dataclass(frozen=True)
class EvalResult:
    name: str
    step: int
    metrics: dict[str, float | int]
    rows: list[dict[str, Any]]
    path: Path


class Evaluation:
    """``await run(step)`` evaluates once. Table rows: ``prompt``, ``completion``, ``reward``,
    ``rewards`` (each named reward's score), ``prompt_index``, ``sample``, ``failed`` (the
    failure kind, "" for a scored sample)."""

    def __init__(self, config: EvalConfig, *, name: str, run_name: str, run_dir: Path | str,
                 publisher: Publisher, nc: Any, namespace: str,
                 timeout_s: float = DEFAULT_TIMEOUT_S, threshold: float = 1.0,
                 on_bad_row: Callable[[BadRowError], None] | None = None) -> None:
        self.config, self.name, self.run_name = config, name, run_name
        self.run_dir = Path(run_dir)
        self.publisher, self.nc, self.namespace = publisher, nc, namespace
        self.timeout_s, self.threshold = timeout_s, threshold
        self.on_bad_row = on_bad_row
        self.task: Task | None = load_task(config.task) if config.task else None
        self.task_name = self.task.name if self.task is not None else DATASET_TASK
        self.tools = self.task.tools() if self.task is not None else None
        self.math = any(spec.name == "math" for spec in config.rewards)
        self.bad_rows = 0
        self._prompts: list[EvalPrompt] | None = None
        self._reading = asyncio.Lock()  # evaluations running at once read the prompts once

    def table_path(self, step: int) -> Path:
        return self.run_dir / "eval" / self.name / f"step_{step}.jsonl"

    async def prompts(self) -> list[EvalPrompt]:
        async with self._reading:
            if self._prompts is None:
                self._prompts = await asyncio.to_thread(self._read_prompts)
        return self._prompts

    async def run(self, step: int) -> EvalResult:
        prompts = await self.prompts()
        group_id = f"eval-{self.name}-{step}"
        expected = {f"{self.run_name}-eval-{self.name}-s{step}-p{p}-{s}": (p, s)
                    for p in range(len(prompts)) for s in range(self.config.n_samples)}
        outcomes: dict[str, RolloutCompleted | RolloutFailed] = {}
        all_in = asyncio.Event()

        def on_outcome(outcome: RolloutCompleted | RolloutFailed) -> None:
            if outcome.group_id == group_id and outcome.rollout_id in expected:
                outcomes.setdefault(outcome.rollout_id, outcome)
                if len(outcomes) == len(expected):
                    all_in.set()

        async with BusWatcher(self.nc, self.namespace, name=f"eval-{self.name}") as watcher:
            # Watched before the first request: an outcome is a core NATS event, never replayed.
            for subject in (ROLLOUT_COMPLETED, ROLLOUT_FAILED):
                await watcher.watch(subject, on_outcome)
            for rollout_id, (p, _) in expected.items():
                await self.publisher.publish(ROLLOUT_REQUESTED, RolloutRequested(
                    rollout_id=rollout_id, task=self.task_name, task_input=prompts[p].task_input,
                    group_id=group_id, purpose="eval", sampling=self.config.sampling,
                    max_turns=self.config.max_turns, requested_at=time.time()))
            try:
                await asyncio.wait_for(all_in.wait(), timeout=self.timeout_s)
            except TimeoutError:
                _log.warning("eval_timed_out", eval=self.name, step=step, timeout_s=self.timeout_s,
                             missing=len(expected) - len(outcomes), of=len(expected))
        samples, rows = [], []
        for rollout_id, (p, s) in expected.items():
            sample, row = self._scored(prompts[p], p, s, outcomes.get(rollout_id))
            samples.append(sample)
            rows.append(row)
        metrics = eval_metrics(samples, n_samples=self.config.n_samples, pass_k=self.config.pass_k,
                               threshold=self.threshold)
        path = self.table_path(step)
        await asyncio.to_thread(_write_table, path, rows)
        _log.info("eval_done", eval=self.name, step=step, **metrics)
        return EvalResult(self.name, step, metrics, rows, path)

    def _scored(self, prompt: EvalPrompt, p: int, s: int,
                outcome: RolloutCompleted | RolloutFailed | None) -> tuple[EvalSample, dict[str, Any]]:
        # completion None: the final answer is not known here (see final_answer).
        row: dict[str, Any] = {"prompt": prompt.text, "completion": None, "reward": None,
                               "rewards": {}, "prompt_index": p, "sample": s, "failed": ""}
        if not isinstance(outcome, RolloutCompleted):
            row["failed"] = outcome.kind if outcome is not None else TIMED_OUT
            return EvalSample(p, s, None, failed=row["failed"]), row
        completion = final_answer(outcome)
        row.update(completion=completion, reward=outcome.reward, rewards=dict(outcome.reward_components))
        answer = None if completion is None else normalize_answer(completion, math=self.math)
        return EvalSample(p, s, outcome.reward, answer), row

    def _read_prompts(self) -> list[EvalPrompt]:
        config = self.config
        if not config.data:
            if not isinstance(self.task, DemonstrableTask):
                raise TypeError(f"eval {self.name!r}: task {config.task!r} samples no inputs of its "
                                "own (sample_task_inputs): give the eval data")
            inputs = self.task.sample_task_inputs(random.Random(config.seed), config.size, held_out=True)
            return [EvalPrompt(self._plugin_text(task_input), task_input) for task_input in inputs]
        prompts: list[EvalPrompt] = []
        rewards = reward_entries(config.rewards)
        with open_dataset(config.data) as dataset:
            for index in range(len(dataset)):
                if config.size and len(prompts) == config.size:
                    break
                try:
                    raw = dataset.raw_row(index)
                    if self.task is not None:  # a plugin's row is its task input as it is
                        prompts.append(EvalPrompt(self._plugin_text(raw), raw))
                        continue
                    row = map_row(raw, config.fields, kind="rl", path=dataset.path,
                                  row=dataset.row_label(index))
                except BadRowError as error:
                    self.bad_rows += 1
                    _log.warning("eval_bad_row", eval=self.name, path=str(error.path), row=error.row,
                                 reason=error.reason)
                    if self.on_bad_row is not None:
                        self.on_bad_row(error)
                    continue
                task_input = dataset_task_input(row, system_prompt=config.system_prompt, rewards=rewards)
                prompts.append(EvalPrompt(last_user_text(task_input["messages"]), task_input))
        if not prompts:
            raise EmptyDatasetError(config.data, bad_rows=self.bad_rows)
        return prompts

    def _plugin_text(self, task_input: dict[str, Any]) -> str:
        assert self.task is not None
        try:
            return last_user_text(self.task.messages(task_input))
        except Exception:  # the plugin refuses this input: its rollouts will say why (invalid_request)
            return ""


def last_user_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last user message (its text parts joined, when it has parts)."""
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def final_answer(completed: RolloutCompleted) -> str:
    """The final answer the rollout's reward saw (RolloutCompleted.final_text, as the rollout
    worker took it: the last turn's content when it ended cleanly and called no tool, else "")."""
    return completed.final_text


def _write_table(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".jsonl.tmp")
    with staging.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    staging.replace(path)
