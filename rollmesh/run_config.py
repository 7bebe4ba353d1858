"""The config of a training job: ``[[stages]]`` (what ``rollmesh train`` runs, in order), their
data, rewards and stopping rules.

Knows msgspec and the config's own types; nothing of NATS, Ray or torch. A ``RUN.toml`` is an
ordinary rollmesh config file, so these sections sit in ``RollmeshConfig`` beside the mesh's own
(docs/training.md).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rollmesh.config_types import ConfigSection, NonNegInt, PositiveInt
from rollmesh.messages.base import SamplingParams
from rollmesh.trainer_config import TrainerConfig

StageKind = Literal["midtrain", "sft", "rl"]
_STAGE_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
OverlongPolicy = Literal["train", "mask", "penalty"]


class FieldMap(ConfigSection):
    """Which column of a dataset row holds each field (as slime's ``--input-key``, ``--label-key``).
    A row gives its prompt as ``prompt`` (a string: one user message) or ``messages`` (OpenAI chat
    messages); ``answer`` (or ``label``) is what rewards check the model against."""

    prompt: str = "prompt"
    messages: str = "messages"
    answer: str = "answer"
    label: str = "label"
    tools: str = "tools"
    metadata: str = "metadata"


class RewardSpec(ConfigSection):
    """One reward of a stage: a built-in by ``name`` (``math``, ``exact_match``, ``http``,
    ``judge``, ``code_tests``) or a function by import path ``fn = "package.module:function"``,
    weighted in the stage's total. ``args`` are keyword arguments the reward is called with."""

    name: str = ""
    fn: str = ""
    weight: float = 1.0
    args: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if bool(self.name) == bool(self.fn):
            raise ValueError("a reward has exactly one of name (a built-in) or fn (an import path)")
        if self.fn and (":" not in self.fn or self.fn.startswith(":") or self.fn.endswith(":")):
            raise ValueError(f"reward fn {self.fn!r} must look like 'package.module:function'")

    @property
    def label(self) -> str:
        """The reward's metric name: the built-in's name, or the function's."""
        return self.name or self.fn.rpartition(":")[2]


class MixtureSource(ConfigSection):
    """One dataset of an rl stage's mixture (``[[stages.mixture]]``): its file, its share of the
    stage's prompts (weights are relative) and its own field mapping."""

    data: str
    weight: Annotated[float, Meta(gt=0.0)] = 1.0
    fields: FieldMap = FieldMap()
    name: str = ""  # "": the file's name without its suffix; it names the source's prompts

    @property
    def label(self) -> str:
        return self.name or Path(self.data).stem


class StageConfig(ConfigSection):
    """One stage of a training job. It starts from the previous stage's weights (the first from
    ``model.path``) and stops after ``steps`` trainer steps, ``epochs`` passes over its data, or
    ``tokens`` trained tokens: exactly one of them."""

    kind: StageKind
    name: str = ""  # "": named by its kind (stage_names), numbered when a kind repeats
    # The dataset: a JSONL or Parquet file or a `datasets` save_to_disk directory (relative to the
    # config file), one row per prompt or example.
    data: str = ""
    fields: FieldMap = FieldMap()
    # Several datasets with weights instead of ``data`` (rl stages; each read in its own order, over
    # its own epochs; the stage interleaves them by weight, deterministically).
    mixture: list[MixtureSource] = []
    # Read in file order, or shuffled by ``seed`` (a new order each epoch).
    shuffle: bool = True
    seed: int = 0
    steps: NonNegInt = 0
    epochs: NonNegInt = 0
    tokens: NonNegInt = 0
    # This stage's trainer settings, over [trainer] (e.g. {lr = 1e-5, n_samples_per_prompt = 8}).
    trainer: dict[str, Any] = {}
    # RL: a task plugin by import path, or "" for the built-in one that speaks the dataset's rows
    # (prompt or messages; rewards from ``rewards``).
    task: str = ""
    rewards: list[RewardSpec] = []
    sampling: SamplingParams = SamplingParams(max_new_tokens=256)
    max_turns: Annotated[int, Meta(ge=1, le=1000)] = 1
    # A system message put before each row's prompt ("": none).
    system_prompt: str = ""
    # Groups published beyond what the trainer has consumed: bounds the work a slow trainer leaves
    # queued, and how stale the last of it can be.
    max_groups_ahead: PositiveInt = 32
    # sft and midtrain: examples are packed into rows of at most max_seq_len tokens (0: the
    # model's context), positions and attention reset at each example's start, and each step
    # trains about batch_tokens real tokens. sft puts the loss on the tokens of these roles'
    # messages (the template's rendering of each, its end-of-turn included); midtrain on every
    # token of the text.
    max_seq_len: NonNegInt = 0
    batch_tokens: PositiveInt = 8192
    loss_roles: list[Literal["system", "user", "assistant", "tool"]] = msgspec.field(
        default_factory=lambda: ["assistant"])

    def __post_init__(self) -> None:
        if not _STAGE_NAME.match(self.name or self.kind):
            raise ValueError(f"stage name {self.name!r}: letters, digits, '_' and '-' only (it names "
                             f"rollouts and subjects' keys)")
        rules = [rule for rule in ("steps", "epochs", "tokens") if getattr(self, rule)]
        if len(rules) != 1:
            raise ValueError(f"a stage stops by exactly one of steps, epochs or tokens "
                             f"(got {', '.join(rules) or 'none'})")
        if self.kind == "rl" and self.tokens:
            raise ValueError("an rl stage stops by steps or epochs")
        if self.kind == "rl" and not self.task and not self.rewards:
            raise ValueError("an rl stage on a dataset needs rewards (e.g. [[stages.rewards]] name = \"math\")")
        if self.task and self.rewards:
            raise ValueError("a task plugin rewards its own rollouts: give task or rewards, not both")
        if self.mixture:
            if self.kind != "rl" or self.data or self.task:
                raise ValueError("a mixture is an rl stage's data on the built-in dataset task: "
                                 "give mixture instead of data and task")
            if self.epochs:
                raise ValueError("a mixture's datasets each have their own epochs: stop it by steps")
            labels = [source.label for source in self.mixture]
            bad = [label for label in labels if not _STAGE_NAME.match(label)]
            if bad or len(set(labels)) != len(labels):
                raise ValueError(f"mixture names {labels}: each unique, letters, digits, '_' and '-' only "
                                 f"(give name = ... where a file's stem is not)")
        elif not self.data and not self.task:
            raise ValueError("a stage needs data (a dataset file)")
        if self.kind != "rl" and (self.task or self.rewards):
            raise ValueError(f"a {self.kind} stage trains on its data's tokens: it takes no task or rewards")


class EvalConfig(ConfigSection):
    """A held-out evaluation (``[[eval]]``): its prompts are rolled out with their own sampling,
    ``n_samples`` each, and scored by their rewards, never trained on. It runs before training
    (``eval_before_train``), every ``eval_every`` trainer steps, and after the last step."""

    name: str = ""  # "": "eval", numbered when several
    # A dataset of prompts (as an rl stage's), or a task plugin sampling held-out inputs.
    data: str = ""
    fields: FieldMap = FieldMap()
    task: str = ""
    # Prompts per evaluation: the first ``size`` rows in file order (0: all), or ``size`` inputs a
    # task plugin samples (held out) by ``seed``.
    size: NonNegInt = 0
    seed: int = 0
    rewards: list[RewardSpec] = []
    sampling: SamplingParams = SamplingParams(max_new_tokens=256)
    n_samples: PositiveInt = 1
    # The k of pass@k (each at most n_samples); []: 1 and n_samples.
    pass_k: list[PositiveInt] = []
    max_turns: Annotated[int, Meta(ge=1, le=1000)] = 1
    system_prompt: str = ""
    eval_every: NonNegInt = 0
    # The stages whose trainer steps eval_every counts ([]: every stage's; e.g. ["rl"] to leave
    # a long supervised warm start unevaluated).
    stages: list[str] = []
    eval_before_train: bool = True

    def __post_init__(self) -> None:
        if not _STAGE_NAME.match(self.name or "eval"):
            raise ValueError(f"eval name {self.name!r}: letters, digits, '_' and '-' only")
        if not self.data and not self.task:
            raise ValueError("an eval needs data (a dataset file) or a task plugin")
        if self.task and not self.data and not self.size:
            raise ValueError("an eval of a task plugin's own inputs needs size")
        if not self.task and not self.rewards:
            raise ValueError("an eval on a dataset needs rewards")
        if self.task and self.rewards:
            raise ValueError("a task plugin rewards its own rollouts: give task or rewards, not both")
        if any(k > self.n_samples for k in self.pass_k):
            raise ValueError(f"pass_k {self.pass_k}: each k is at most n_samples ({self.n_samples})")


class TrackingConfig(ConfigSection):
    """Experiment trackers a training job reports to: the run's config, per-step scalars and the
    evaluations' sample tables."""

    backends: list[Literal["tensorboard", "wandb", "mlflow"]] = msgspec.field(
        default_factory=lambda: ["tensorboard"])
    project: str = "rollmesh"
    run_name: str = ""  # "": the run directory's name
    # MLflow: "" is sqlite:///<run dir>/mlflow.db (recent MLflow refuses the plain file store).
    mlflow_tracking_uri: str = ""
    # W&B: "" follows WANDB_MODE (online by default); "offline" writes a run `wandb sync` uploads.
    wandb_mode: Literal["", "online", "offline", "disabled"] = ""


def stage_names(stages: list[StageConfig] | list[EvalConfig]) -> list[str]:
    """Each stage's (or eval's) name: its own, else its kind ("eval"), numbered from 2 when one
    repeats."""
    names: list[str] = []
    for stage in stages:
        base = stage.name or getattr(stage, "kind", "eval")
        name, number = base, 1
        while name in names:
            number += 1
            name = f"{base}-{number}"
        names.append(name)
    return names


def stage_trainer_config(base: TrainerConfig, stage: StageConfig) -> TrainerConfig:
    """The trainer settings a stage runs with: ``[trainer]`` with the stage's ``trainer`` table
    over it (tables merged key by key, so ``{megatron = {data_parallel = 2}}`` keeps the rest)."""
    if not stage.trainer:
        return base
    return msgspec.convert(_merged(msgspec.to_builtins(base), stage.trainer), TrainerConfig)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged
