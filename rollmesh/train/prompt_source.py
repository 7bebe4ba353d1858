"""Where an RL stage's prompts come from: a position in the stage's reading order becomes a
rollout's task and task input.

Knows the stage config, rollmesh.data and task plugins; nothing of NATS. Two sources:
- a dataset (``data``): each good row, in the stage's order over epochs. With the built-in
  ``dataset`` task, the row's messages (after the stage's system prompt) are the prompt and the
  stage's rewards score it; with a task plugin (``task``), the row is the plugin's task input.
- a mixture of datasets (``mixture``), interleaved by weight (``MixturePrompts``);
- a task plugin that samples its own inputs (``task`` without ``data``, as the demo's molar-mass
  task): position p's input is sampled from a generator seeded by (seed, p), so it is the same
  on resume.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from rollmesh.data import BadRowError, EmptyDatasetError, EpochOrder, PromptReader, open_dataset
from rollmesh.rollout.tasks import DemonstrableTask, load_task
from rollmesh.run_config import StageConfig
from rollmesh.train.dataset_input import DATASET_TASK, dataset_task_input, reward_entries
from rollmesh.training.prompt_ids import PromptRef

class PromptSource:
    """``at(position) -> (next_position, PromptRef, task_input)``; ``task`` names the task."""

    task: str
    num_rows: int

    def at(self, position: int) -> tuple[int, PromptRef, dict[str, Any]]: ...

    def close(self) -> None: ...


class DatasetPrompts(PromptSource):
    def __init__(self, stage: StageConfig, name: str, *,
                 on_bad_row: Callable[[BadRowError], None] | None = None) -> None:
        self.stage, self.name = stage, name
        self.dataset = open_dataset(stage.data)
        self.num_rows = len(self.dataset)
        self.order = EpochOrder(self.num_rows, shuffle=stage.shuffle, seed=stage.seed)
        self.reader = PromptReader(self.dataset, stage.fields, "rl", self.order, on_bad_row)
        self._plugin_bad_rows = 0
        self.task = load_task(stage.task).name if stage.task else DATASET_TASK
        self._rewards = reward_entries(stage.rewards)

    @property
    def bad_rows(self) -> int:
        return self.reader.bad_rows + self._plugin_bad_rows

    def at(self, position: int) -> tuple[int, PromptRef, dict[str, Any]]:
        if self.stage.task:
            return self._plugin_row(position)
        next_position, row, epoch, index = self.reader.read(position)
        return next_position, PromptRef(self.name, epoch, index), dataset_task_input(
            row, system_prompt=self.stage.system_prompt, rewards=self._rewards)

    def _plugin_row(self, position: int) -> tuple[int, PromptRef, dict[str, Any]]:
        """A task plugin's row is its task input as it is: any JSON object (the plugin checks it)."""
        while True:
            epoch, index = self.order.at(position)
            try:
                return position + 1, PromptRef(self.name, epoch, index), self.dataset.raw_row(index)
            except BadRowError as error:
                if self.reader.on_bad_row is not None:
                    self.reader.on_bad_row(error)
                self._plugin_bad_rows += 1
                if self._plugin_bad_rows > 2 * self.num_rows:
                    raise EmptyDatasetError(self.dataset.path, bad_rows=self._plugin_bad_rows) from error
                position += 1

    def close(self) -> None:
        self.dataset.close()


class SampledPrompts(PromptSource):
    def __init__(self, stage: StageConfig, name: str) -> None:
        task = load_task(stage.task)
        if not isinstance(task, DemonstrableTask):
            raise TypeError(f"stage {name!r}: task {stage.task!r} samples no inputs of its own "
                            "(sample_task_inputs): give the stage data")
        self.sampler, self.seed, self.name = task, stage.seed, name
        self.task = task.name
        self.num_rows = 0

    def at(self, position: int) -> tuple[int, PromptRef, dict[str, Any]]:
        rng = random.Random(f"{self.seed}/{position}")
        (task_input,) = self.sampler.sample_task_inputs(rng, 1, held_out=False)
        return position + 1, PromptRef(self.name, 0, position), task_input

    def close(self) -> None:
        pass


class MixturePrompts(PromptSource):
    """Several datasets interleaved by weight (smooth weighted round robin: deterministic, and
    each source's share of any stretch of positions is within one prompt of its weight's). Each
    source reads its own rows in its own order over its own epochs; a prompt is named
    ``<stage>.<source>/e<epoch>/i<index>``. A position's source depends on every position before
    it, so the interleaving is replayed from 0 to reach a position out of turn (on resume)."""

    def __init__(self, stage: StageConfig, name: str, *,
                 on_bad_row: Callable[[BadRowError], None] | None = None) -> None:
        self.stage, self.name = stage, name
        self.task = DATASET_TASK
        self.sources = []
        for number, source in enumerate(stage.mixture):
            dataset = open_dataset(source.data)
            order = EpochOrder(len(dataset), shuffle=stage.shuffle, seed=stage.seed + number)
            self.sources.append((source, dataset, PromptReader(dataset, source.fields, "rl", order, on_bad_row)))
        self.num_rows = sum(len(dataset) for _, dataset, _ in self.sources)
        self._weights = [source.weight for source, _, _ in self.sources]
        self._rewards = reward_entries(stage.rewards)
        self._reset()

    @property
    def bad_rows(self) -> int:
        return sum(reader.bad_rows for _, _, reader in self.sources)

    def _reset(self) -> None:
        self._position = 0
        self._credit = [0.0] * len(self.sources)
        self._next = [0] * len(self.sources)  # each source's own next position

    def _pick(self) -> int:
        total = sum(self._weights)
        for index, weight in enumerate(self._weights):
            self._credit[index] += weight
        chosen = max(range(len(self._weights)), key=lambda index: (self._credit[index], -index))
        self._credit[chosen] -= total
        return chosen

    def at(self, position: int) -> tuple[int, PromptRef, dict[str, Any]]:
        if position < self._position:
            self._reset()
        while self._position < position:  # replay the positions before this one
            chosen = self._pick()
            self._next[chosen] = self.sources[chosen][2].read(self._next[chosen])[0]
            self._position += 1
        chosen = self._pick()
        source, _, reader = self.sources[chosen]
        self._next[chosen], row, epoch, index = reader.read(self._next[chosen])
        self._position += 1
        return position + 1, PromptRef(f"{self.name}.{source.label}", epoch, index), dataset_task_input(
            row, system_prompt=self.stage.system_prompt, rewards=self._rewards)

    def close(self) -> None:
        for _, dataset, _ in self.sources:
            dataset.close()


def prompt_source(stage: StageConfig, name: str, *,
                  on_bad_row: Callable[[BadRowError], None] | None = None) -> PromptSource:
    if stage.mixture:
        return MixturePrompts(stage, name, on_bad_row=on_bad_row)
    if stage.data:
        return DatasetPrompts(stage, name, on_bad_row=on_bad_row)
    return SampledPrompts(stage, name)
