"""When a training job evaluates, and where the results go.

Knows the job's ``[[eval]]`` list, ``Evaluation`` (one evaluation on the mesh) and the trackers;
nothing of stages. Each ``[[eval]]`` runs before training (``eval_before_train``), every
``eval_every`` trainer steps, and after the last step, alongside training. A result is recorded
in ``train/evals.jsonl`` (read again on resume, so an evaluation already done at a step is not
run again and the summary covers them all), its scalars and sample table go to the trackers,
and one line reports it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollmesh.run_config import EvalConfig, stage_names
from rollmesh.tracking import Trackers
from rollmesh.train.evaluation import Evaluation, EvalResult
from rollmesh.training.ledger import append_line

EVALS_FILE = "evals.jsonl"


class EvalSchedule:
    def __init__(self, configs: list[EvalConfig], *, make: Callable[[EvalConfig, str], Evaluation],
                 run_dir: Path, trackers: Trackers, report: Callable[[str], None]) -> None:
        self.configs = configs
        self.names = stage_names(configs)
        self.evaluations = [make(config, name) for config, name in zip(configs, self.names)]
        self.path = Path(run_dir) / "train" / EVALS_FILE
        self.trackers, self.report = trackers, report
        self.results: list[dict[str, Any]] = _read_results(self.path)
        self._running: list[asyncio.Task[None]] = []

    def before_training(self, trainer_step: int) -> None:
        for evaluation, config in zip(self.evaluations, self.configs):
            if config.eval_before_train:
                self._start(evaluation, trainer_step)

    def after_step(self, trainer_step: int, stage: str = "") -> None:
        for evaluation, config in zip(self.evaluations, self.configs):
            if config.stages and stage not in config.stages:
                continue
            if config.eval_every and trainer_step % config.eval_every == 0:
                self._start(evaluation, trainer_step)

    async def after_training(self, trainer_step: int) -> None:
        for evaluation in self.evaluations:
            self._start(evaluation, trainer_step)
        await self.wait()

    async def wait(self) -> None:
        running, self._running = self._running, []
        await asyncio.gather(*running)

    async def cancel(self) -> None:
        """Stop the evaluations still running (a job that failed); idempotent."""
        running, self._running = self._running, []
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _start(self, evaluation: Evaluation, step: int) -> None:
        if any(result["name"] == evaluation.name and result["step"] == step for result in self.results):
            return  # done before a stop, or already asked for at this step
        self.results.append({"name": evaluation.name, "step": step, "metrics": None})  # a claim
        self._running.append(asyncio.create_task(self._run(evaluation, step), name=f"eval:{evaluation.name}:{step}"))

    async def _run(self, evaluation: Evaluation, step: int) -> None:
        result: EvalResult = await evaluation.run(step)
        record = {"name": result.name, "step": step, "metrics": result.metrics, "table": str(result.path)}
        self.results = [entry for entry in self.results
                        if not (entry["name"] == result.name and entry["step"] == step)] + [record]
        append_line(self.path, json.dumps(record))
        self.trackers.log_scalars(step, {f"eval/{result.name}/{key}": float(value)
                                         for key, value in result.metrics.items()})
        self.trackers.log_table(f"eval/{result.name}", step, result.rows)
        shown = " ".join(f"{key}={value:.4f}" if isinstance(value, float) else f"{key}={value}"
                         for key, value in result.metrics.items())
        self.report(f"eval={result.name} step={step} {shown}")

    def mean_rewards(self) -> list[tuple[int, float]]:
        """(step, mean@n) of the first [[eval]]'s finished evaluations, by step."""
        if not self.configs:
            return []
        key = f"mean@{self.configs[0].n_samples}"
        return sorted((entry["step"], entry["metrics"][key]) for entry in self.results
                      if entry["name"] == self.names[0] and entry["metrics"] and key in entry["metrics"])


def _read_results(path: Path) -> list[dict[str, Any]]:
    results = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                results.append(json.loads(line))
            except ValueError:
                continue  # torn by a kill: that evaluation runs again
    return results
