"""Rewards without a worker process: what a reward's value means (``score_of``), ``exact_match``,
rewards by import path and their load errors, and the weighted combination of a stage's rewards.
The reward functions named by import path are this module's own (``test_rewards:...``)."""

from __future__ import annotations

import math

import pytest

from rollmesh.rewards.builtin import exact_match
from rollmesh.rewards.combined import CombinedReward, check_reward_specs, load_reward
from rollmesh.rewards.errors import RewardInputError, RewardLoadError, RewardUnavailableError
from rollmesh.rewards.reward_input import RewardInput, RewardScore, score_of
from rollmesh.run_config import RewardSpec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

NOT_A_FUNCTION = 3


def length_bonus(sample: RewardInput, *, per_char: float = 0.01) -> float:
    return per_char * len(sample.final_text)


def graded(sample: RewardInput) -> dict[str, float]:
    return {"format": 0.5, "correct": 1.0 if sample.final_text == sample.answer else 0.0}


def with_total(sample: RewardInput) -> dict[str, float]:
    return {"reward": 0.25, "style": 3.0}


def broken(sample: RewardInput) -> float:
    raise ConnectionError("reward server down")


def says_maybe(sample: RewardInput) -> object:
    return "maybe"


def sample(final_text: str = "42", answer: str | None = "42") -> RewardInput:
    return RewardInput(row={"prompt": "6*7?", "answer": answer}, answer=answer, messages=[], final_text=final_text)


# --- score_of ----------------------------------------------------------------------------------

def test_a_float_reward_is_its_own_total_with_no_components():
    assert score_of(0.75) == RewardScore(0.75, {}) and score_of(1) == RewardScore(1.0, {})


def test_a_dict_reward_totals_its_values_and_logs_each_under_the_rewards_label():
    assert score_of({"format": 0.5, "correct": 1.0}, label="judge") == \
        RewardScore(1.5, {"judge/format": 0.5, "judge/correct": 1.0})


def test_a_dict_reward_with_a_reward_key_takes_it_as_its_total():
    assert score_of({"reward": 0.25, "style": 3.0}, label="mine") == RewardScore(0.25, {"mine/style": 3.0})


@pytest.mark.parametrize("value", ["1.0", None, [1.0], {"a": "x"}, {1: 1.0}, math.nan, math.inf, {"a": math.nan}])
def test_a_reward_value_that_is_not_a_finite_float_or_a_dict_of_them_is_refused(value):
    with pytest.raises(ValueError):
        score_of(value)


# --- exact_match -------------------------------------------------------------------------------

@pytest.mark.parametrize(("final_text", "answer", "case_sensitive", "expected"), [
    ("42", "42", True, 1.0),
    ("  42\n", " 42 ", True, 1.0),
    ("Paris", "paris", True, 0.0),
    ("Paris", "paris", False, 1.0),
    ("42.0", "42", True, 0.0),
    ("", "42", True, 0.0),
])
def test_exact_match_compares_the_final_text_with_the_answer_whitespace_stripped(final_text, answer,
                                                                                 case_sensitive, expected):
    assert exact_match(sample(final_text, answer), case_sensitive=case_sensitive) == expected


def test_exact_match_refuses_a_row_without_an_answer():
    with pytest.raises(RewardInputError, match="no answer"):
        exact_match(sample("42", None))


# --- loading -----------------------------------------------------------------------------------

def test_an_import_path_reward_is_called_with_the_sample_and_its_args():
    function = load_reward(RewardSpec(fn="test_rewards:length_bonus", args={"per_char": 0.5}))
    assert function is length_bonus and function(sample("abcd"), per_char=0.5) == 2.0


@pytest.mark.parametrize(("spec", "reason"), [
    (RewardSpec(fn="no_such_module_for_rollmesh:f"), "does not import"),
    (RewardSpec(fn="test_rewards:no_such_function"), "has no attribute 'no_such_function'"),
    (RewardSpec(fn="test_rewards:NOT_A_FUNCTION"), "not a function"),
    (RewardSpec(fn="test_rewards:length_bonus", args={"per_word": 1}), "cannot be called"),
    (RewardSpec(name="bleu"), "no built-in reward 'bleu'"),
    (RewardSpec(name="exact_match", args={"ignore_case": True}), "unknown argument 'ignore_case'"),
    (RewardSpec(name="exact_match", args={"case_sensitive": "no"}), "must be bool"),
    (RewardSpec(name="math", args={"timeout_s": 0}), "above 0"),
])
def test_a_reward_that_cannot_load_is_a_load_error_naming_it_and_why(spec, reason):
    with pytest.raises(RewardLoadError, match=reason) as raised:
        check_reward_specs([RewardSpec(name="exact_match"), spec])
    assert raised.value.spec_label == spec.label


def test_specs_that_all_load_pass_the_check():
    check_reward_specs([RewardSpec(name="math", args={"timeout_s": 2}), RewardSpec(name="exact_match"),
                        RewardSpec(fn="test_rewards:graded", weight=0.5)])


# --- CombinedReward ----------------------------------------------------------------------------

def test_combined_reward_is_the_weighted_sum_and_logs_each_rewards_own_total():
    combined = CombinedReward([RewardSpec(name="exact_match", weight=2.0),
                               RewardSpec(fn="test_rewards:length_bonus", weight=0.5, args={"per_char": 0.25}),
                               RewardSpec(fn="test_rewards:graded", weight=1.0)])
    score = combined.score(sample("42", "42"))
    assert score.total == pytest.approx(2.0 * 1.0 + 0.5 * 0.5 + 1.0 * 1.5)
    assert score.components == {"exact_match": 1.0, "length_bonus": 0.5, "graded": 1.5,
                                "graded/format": 0.5, "graded/correct": 1.0}


def test_combined_reward_numbers_a_label_that_repeats():
    combined = CombinedReward([RewardSpec(name="exact_match"),
                               RewardSpec(name="exact_match", args={"case_sensitive": False})])
    assert combined.score(sample("ABC", "abc")).components == {"exact_match": 0.0, "exact_match-2": 1.0}


def test_a_dict_rewards_own_total_is_its_reward_key():
    score = CombinedReward([RewardSpec(fn="test_rewards:with_total", weight=4.0)]).score(sample())
    assert (score.total, score.components) == (1.0, {"with_total": 0.25, "with_total/style": 3.0})


@pytest.mark.parametrize(("fn", "reason"), [("test_rewards:broken", "ConnectionError"),
                                            ("test_rewards:says_maybe", "float or a dict")])
def test_a_reward_function_that_raises_or_returns_no_number_is_unavailable_never_a_zero(fn, reason):
    combined = CombinedReward([RewardSpec(name="exact_match"), RewardSpec(fn=fn)])
    with pytest.raises(RewardUnavailableError, match=reason) as raised:
        combined.score(sample())
    assert raised.value.reward == fn.rpartition(":")[2]


def test_a_row_without_an_answer_under_exact_match_is_the_rows_fault():
    with pytest.raises(RewardInputError):
        CombinedReward([RewardSpec(name="exact_match")]).score(sample("42", None))
