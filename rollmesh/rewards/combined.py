"""Rewards loaded from their specs and combined with weights: ``check_reward_specs``,
``load_reward`` and ``CombinedReward``.

Knows the reward types, the built-ins and importlib; nothing of Ray, NATS or the agent loop. A
spec (``rollmesh.run_config.RewardSpec``) names a built-in (``name``) or a function by import path
(``fn = "package.module:function"``, called as ``function(sample, **args)``). A reward whose
function raises (a bug, a server down) is a ``RewardUnavailableError``, never a zero: only the
reward itself decides that an answer is worth nothing.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollmesh.rewards.builtin import BUILTIN_REWARDS, check_builtin_args
from rollmesh.rewards.errors import RewardError, RewardLoadError, RewardUnavailableError
from rollmesh.rewards.reward_input import RewardInput, RewardScore, score_of
from rollmesh.run_config import RewardSpec

RewardFunction = Callable[..., Any]


def load_reward(spec: RewardSpec) -> RewardFunction:
    """The function ``spec`` names, its ``args`` checked against it; raises ``RewardLoadError``."""
    if spec.name:
        if spec.name not in BUILTIN_REWARDS:
            raise RewardLoadError(spec.label, f"no built-in reward {spec.name!r} "
                                              f"(built-ins: {', '.join(sorted(BUILTIN_REWARDS))})")
        problem = check_builtin_args(spec.name, spec.args)
        if problem:
            raise RewardLoadError(spec.label, problem)
        return BUILTIN_REWARDS[spec.name]
    module_name, _, attribute = spec.fn.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # not found, or the module itself fails to import
        raise RewardLoadError(spec.label, f"module {module_name!r} does not import: {exc!r}") from exc
    function = getattr(module, attribute, None)
    if function is None:
        raise RewardLoadError(spec.label, f"module {module_name!r} has no attribute {attribute!r}")
    if not callable(function):
        raise RewardLoadError(spec.label, f"{spec.fn} is a {type(function).__name__}, not a function")
    try:
        inspect.signature(function).bind(None, **spec.args)
    except TypeError as exc:
        raise RewardLoadError(spec.label, f"{spec.fn} cannot be called as function(sample, **args) "
                                          f"with args {sorted(spec.args)}: {exc}") from exc
    except ValueError:  # no signature to read (a builtin): it is tried at the first call
        pass
    return function


def check_reward_specs(specs: Sequence[RewardSpec]) -> None:
    """Load every reward of ``specs`` once, so one that cannot load fails at config load."""
    for spec in specs:
        load_reward(spec)


def reward_labels(specs: Sequence[RewardSpec]) -> list[str]:
    """Each reward's metric name: its label, numbered from 2 when a label repeats (two
    ``exact_match`` with different args)."""
    labels: list[str] = []
    for spec in specs:
        label, number = spec.label, 1
        while label in labels:
            number += 1
            label = f"{spec.label}-{number}"
        labels.append(label)
    return labels


@dataclass(frozen=True)
class _Loaded:
    label: str
    weight: float
    args: dict[str, Any]
    function: RewardFunction


class CombinedReward:
    """The weighted sum of ``specs``' rewards; each reward's own total is a component under its
    label, with a dict reward's keys as ``<label>/<key>``."""

    def __init__(self, specs: Sequence[RewardSpec]) -> None:
        if not specs:
            raise RewardLoadError("", "no rewards given")
        self.rewards = [_Loaded(label, spec.weight, dict(spec.args), load_reward(spec))
                        for label, spec in zip(reward_labels(specs), specs)]

    def score(self, sample: RewardInput) -> RewardScore:
        """Raises ``RewardInputError`` (the row lacks what a reward checks) or
        ``RewardUnavailableError`` (a reward could not be computed)."""
        total, components = 0.0, {}
        for reward in self.rewards:
            try:
                value = reward.function(sample, **reward.args)
            except RewardError:
                raise
            except Exception as exc:  # the user's function failed: not the model's fault
                raise RewardUnavailableError(reward.label, f"raised {exc!r}") from exc
            try:
                score = score_of(value, label=reward.label)
            except ValueError as exc:
                raise RewardUnavailableError(reward.label, str(exc)) from exc
            total += reward.weight * score.total
            components[reward.label] = score.total
            components.update(score.components)
        return RewardScore(total, components)
