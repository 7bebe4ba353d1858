"""The built-in rewards, by the name a ``[[stages.rewards]]`` entry gives: ``math``,
``exact_match``, and ``http``, ``judge`` and ``code_tests`` (each in a module of its own).

Knows the reward types and the math checker; nothing of Ray, NATS or the agent loop. Each is
``function(sample, **args) -> float``; ``check_builtin_args`` checks a spec's ``args`` at config
load, so a typo fails before any training starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollmesh.rewards import code_tests_reward, http_reward, judge_reward
from rollmesh.rewards.errors import RewardInputError
from rollmesh.rewards.math_answer import DEFAULT_TIMEOUT_S, math_reward
from rollmesh.rewards.reward_input import RewardInput


def math_equal(sample: RewardInput, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 when math-verify finds the final answer equal to the row's answer (``\\boxed{}``,
    fractions, LaTeX and plain expressions alike), else 0.0; a check past ``timeout_s`` is 0.0."""
    return math_reward(sample, timeout_s=timeout_s)


def exact_match(sample: RewardInput, *, case_sensitive: bool = True) -> float:
    """1.0 when the final answer is the row's answer, surrounding whitespace aside, else 0.0."""
    if sample.answer is None:
        raise RewardInputError("exact_match", "the row has no answer to compare with")
    final, answer = sample.final_text.strip(), sample.answer.strip()
    if not case_sensitive:
        final, answer = final.casefold(), answer.casefold()
    return 1.0 if final == answer else 0.0


BUILTIN_REWARDS: dict[str, Callable[..., Any]] = {
    "math": math_equal, "exact_match": exact_match, "http": http_reward.http_reward,
    "judge": judge_reward.judge_reward, "code_tests": code_tests_reward.code_tests_reward,
}
# Each argument a built-in takes, with the types it accepts.
_ARG_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "math": {"timeout_s": (int, float)},
    "exact_match": {"case_sensitive": (bool,)},
    "http": http_reward.ARG_TYPES, "judge": judge_reward.ARG_TYPES, "code_tests": code_tests_reward.ARG_TYPES,
}
# The checks beyond types (required arguments, ranges) of the built-ins that have some.
_ARG_CHECKS: dict[str, Callable[[dict[str, Any]], str]] = {
    "http": http_reward.check_args, "judge": judge_reward.check_args, "code_tests": code_tests_reward.check_args,
}


def check_builtin_args(name: str, args: dict[str, Any]) -> str:
    """What is wrong with ``args`` for the built-in ``name`` ("" when nothing is)."""
    accepted = _ARG_TYPES[name]
    for key, value in args.items():
        if key not in accepted:
            return f"unknown argument {key!r} (it takes {', '.join(sorted(accepted)) or 'none'})"
        types = accepted[key]
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            return f"argument {key!r} must be {' or '.join(t.__name__ for t in types)}, not {value!r}"
    if name == "math" and args.get("timeout_s", DEFAULT_TIMEOUT_S) <= 0:
        return f"argument 'timeout_s' must be above 0, not {args['timeout_s']!r}"
    check = _ARG_CHECKS.get(name)
    return check(args) if check is not None else ""
