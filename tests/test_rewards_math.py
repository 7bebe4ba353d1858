"""The ``math`` reward: math-verify answer checks in worker processes, under a per-check timeout.

Real worker processes and the real math-verify. The timeout tests use a check (below, imported by
the worker by its import path) that hangs or dies on a marked answer, so they do not depend on how
fast sympy is: a hang never returns, whatever the timeout."""

from __future__ import annotations

import os
import threading

import pytest

from rollmesh.rewards.errors import RewardInputError, RewardUnavailableError
from rollmesh.rewards.math_answer import MathChecker, math_reward
from rollmesh.rewards.math_worker import check_answer
from rollmesh.rewards.reward_input import RewardInput

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

# Generous: a check that should finish is never cut on a loaded machine.
PATIENT_S = 60.0


def hang_or_die_or_check(gold: str, answer: str) -> bool:
    """Runs in the worker process: "hang" never returns, "die" ends the process."""
    if answer == "hang":
        threading.Event().wait()
    if answer == "die":
        os._exit(3)
    return check_answer(gold, answer)


@pytest.fixture(scope="module")
def checker():
    checker = MathChecker(max_workers=2)
    yield checker
    checker.close()


def sample(final_text: str, answer: str | None) -> RewardInput:
    return RewardInput(row={"question": "?"}, answer=answer, messages=[], final_text=final_text)


@pytest.mark.parametrize(("answer", "final_text"), [
    ("42", "The answer is 42."),
    ("42", "so we get $\\boxed{42}$"),
    ("1/2", "\\boxed{\\frac{1}{2}}"),
    ("\\frac{1}{2}", "0.5"),
    ("$\\frac{3}{4}$", "It is $3/4$."),
    ("x^2+1", "$1 + x^2$"),
])
def test_math_reward_is_one_for_an_answer_that_is_mathematically_the_gold(checker, answer, final_text):
    assert math_reward(sample(final_text, answer), timeout_s=PATIENT_S, checker=checker) == 1.0


@pytest.mark.parametrize(("answer", "final_text"), [
    ("42", "The answer is 41."),
    ("1/2", "\\boxed{\\frac{1}{3}}"),
    ("x^2+1", "$x^2 - 1$"),
    ("42", "I do not know"),
    ("42", ""),
])
def test_math_reward_is_zero_for_a_wrong_or_missing_answer(checker, answer, final_text):
    assert math_reward(sample(final_text, answer), timeout_s=PATIENT_S, checker=checker) == 0.0


@pytest.mark.parametrize("answer", [None, "  "])
def test_math_reward_refuses_a_row_without_an_answer_as_the_rows_fault(checker, answer):
    with pytest.raises(RewardInputError, match="no answer") as raised:
        math_reward(sample("42", answer), checker=checker)
    assert raised.value.reward == "math"


def test_a_check_past_its_timeout_scores_zero_and_its_worker_is_replaced_and_scores_again():
    checker = MathChecker(check="test_rewards_math:hang_or_die_or_check", max_workers=1)
    try:
        assert checker.check("1/2", "0.5", timeout_s=PATIENT_S) is True
        assert checker.started == 1
        assert math_reward(sample("hang", "1/2"), timeout_s=0.2, checker=checker) == 0.0
        assert checker.check("1/2", "0.5", timeout_s=PATIENT_S) is True
        assert checker.check("1/2", "0.25", timeout_s=PATIENT_S) is False
        assert checker.started == 2, "the hung worker was killed and one new worker serves on"
    finally:
        checker.close()


def test_a_worker_that_dies_during_a_check_is_a_reward_unavailable_error_and_the_next_check_runs():
    checker = MathChecker(check="test_rewards_math:hang_or_die_or_check", max_workers=1)
    try:
        with pytest.raises(RewardUnavailableError, match="died during a check") as raised:
            checker.check("1", "die", timeout_s=PATIENT_S)
        assert raised.value.reward == "math"
        assert checker.check("1", "1", timeout_s=PATIENT_S) is True
        assert checker.started == 2
    finally:
        checker.close()


def test_a_worker_that_cannot_start_is_a_reward_unavailable_error():
    checker = MathChecker(check="no_such_module_for_rollmesh:check", max_workers=1)
    with pytest.raises(RewardUnavailableError, match="did not get ready"):
        checker.check("1", "1", timeout_s=PATIENT_S)


def test_checks_from_several_threads_share_the_workers_and_each_gets_its_own_verdict(checker):
    pairs = [("1/2", "0.5", True), ("2", "3", False), ("10", "\\boxed{10}", True), ("7", "8", False)] * 2
    verdicts: dict[int, bool | None] = {}

    def run(number: int, gold: str, answer: str) -> None:
        verdicts[number] = checker.check(gold, answer, timeout_s=PATIENT_S)

    threads = [threading.Thread(target=run, args=(number, gold, answer))
               for number, (gold, answer, _) in enumerate(pairs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert verdicts == {number: expected for number, (_, _, expected) in enumerate(pairs)}
    assert checker.started <= checker.max_workers
