"""rollmesh.train.eval_metrics: mean@n, pass@k (unbiased), majority@n, failures left out."""

from __future__ import annotations

from math import comb

import pytest

from rollmesh.train.eval_metrics import EvalSample, eval_metrics, normalize_answer, pass_at_k


@pytest.mark.parametrize(("n", "c", "k"), [(4, 0, 1), (4, 1, 1), (4, 2, 2), (4, 3, 2), (10, 3, 5),
                                           (16, 1, 8), (4, 4, 4), (1, 1, 1)])
def test_pass_at_k_is_the_unbiased_estimator(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_pass_at_k_of_many_samples_stays_finite() -> None:
    # The binomials of n=2000 overflow a float; the product form does not.
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
    assert pass_at_k(3, 1, 8) == 1.0  # k above n is taken as n: some sample passed


def test_pass_at_k_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError):
        pass_at_k(0, 0, 1)
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def _samples(rewards: dict[int, list[float | None]], answers: dict[int, list[str]] | None = None) -> list[EvalSample]:
    return [EvalSample(prompt=p, sample=i, reward=r, answer=(answers or {}).get(p, [None] * len(rs))[i],
                       failed="" if r is not None else "sandbox_error")
            for p, rs in rewards.items() for i, r in enumerate(rs)]


def test_mean_and_pass_at_k_over_prompts() -> None:
    metrics = eval_metrics(_samples({0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 0.0, 1.0]}), n_samples=4)
    assert metrics["mean@4"] == pytest.approx(4 / 8)
    assert metrics["pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert metrics["pass@4"] == pytest.approx(1.0)
    assert (metrics["prompts"], metrics["samples"], metrics["failed"]) == (2, 8, 0)
    assert "majority@4" not in metrics  # no answers known: nothing to vote with


def test_configured_k_and_threshold() -> None:
    samples = _samples({0: [0.5, 0.9, 0.0, 0.2]})
    assert set(eval_metrics(samples, n_samples=4, pass_k=[2])) >= {"pass@2"}
    assert "pass@1" not in eval_metrics(samples, n_samples=4, pass_k=[2])
    assert eval_metrics(samples, n_samples=4, pass_k=[1])["pass@1"] == 0.0
    assert eval_metrics(samples, n_samples=4, pass_k=[1], threshold=0.5)["pass@1"] == pytest.approx(0.5)


def test_failed_samples_are_counted_and_left_out() -> None:
    # Prompt 0: two of four failed, so it is scored over its two others (pass@4 uses n=2);
    # prompt 1: all failed, so it is left out of every statistic but still a prompt.
    samples = _samples({0: [1.0, None, 0.0, None], 1: [None, None, None, None]})
    metrics = eval_metrics(samples, n_samples=4)
    assert (metrics["prompts"], metrics["samples"], metrics["failed"]) == (2, 2, 6)
    assert metrics["mean@4"] == pytest.approx(0.5)
    assert metrics["pass@1"] == pytest.approx(0.5)
    assert metrics["pass@4"] == pytest.approx(1.0)


def test_nothing_succeeded_leaves_the_rewards_out() -> None:
    metrics = eval_metrics(_samples({0: [None, None]}), n_samples=2)
    assert metrics == {"prompts": 1, "samples": 0, "failed": 2}


def test_majority_scores_the_most_frequent_answer() -> None:
    samples = _samples({0: [0.0, 1.0, 1.0, 0.0], 1: [1.0, 0.0, 0.0, 0.0]},
                       {0: ["7", "8", "8", "9"], 1: ["3", "4", "4", "5"]})
    # Prompt 0 votes "8" (right), prompt 1 votes "4" (wrong) though one sample was right.
    assert eval_metrics(samples, n_samples=4)["majority@4"] == pytest.approx(0.5)


def test_majority_ties_go_to_the_answer_met_first() -> None:
    tie = _samples({0: [0.0, 1.0, 1.0, 0.0]}, {0: ["a", "b", "b", "a"]})
    assert eval_metrics(tie, n_samples=4)["majority@4"] == 0.0
    swapped = _samples({0: [1.0, 0.0, 0.0, 1.0]}, {0: ["b", "a", "a", "b"]})
    assert eval_metrics(swapped, n_samples=4)["majority@4"] == 1.0


def test_majority_ignores_failed_samples() -> None:
    samples = [EvalSample(0, 0, None, None, "sandbox_error"), EvalSample(0, 1, None, None, "sandbox_error"),
               EvalSample(0, 2, 1.0, "x"), EvalSample(0, 3, 0.0, "y")]
    assert eval_metrics(samples, n_samples=4)["majority@4"] == 1.0


def test_normalize_answer() -> None:
    assert normalize_answer("  42 \n", math=False) == "42"
    assert normalize_answer("0.5", math=False) != normalize_answer("1/2", math=False)
    halves = {normalize_answer(text, math=True) for text in ["0.5", "$\\frac{1}{2}$", "so \\boxed{1/2}"]}
    assert halves == {"1/2"}
    assert normalize_answer("no number here", math=True) == "no number here"
    assert normalize_answer("", math=True) == ""
