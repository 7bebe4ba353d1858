"""The demo's reward record: window means, the summary it prints, and the plot it writes."""

from __future__ import annotations

import pytest

from rollmesh.demo.curve import RewardCurve, window_mean

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_window_mean_averages_the_first_or_last_fraction():
    values = [0.0] * 10 + [1.0] * 10
    assert window_mean(values, 0.1, last=False) == 0.0
    assert window_mean(values, 0.1, last=True) == 1.0
    assert window_mean(values, 0.75, last=True) == pytest.approx(10 / 15)


def test_window_mean_uses_at_least_one_value_and_is_zero_for_none():
    assert window_mean([0.3, 0.9], 0.1, last=True) == 0.9
    assert window_mean([0.3, 0.9], 0.1, last=False) == 0.3
    assert window_mean([], 0.1, last=True) == 0.0


def test_summary_reports_first_and_last_windows_evaluations_and_extras():
    curve = RewardCurve(step_rewards=[0.1] * 10 + [0.8] * 10, evaluations=[(0, 0.05), (10, 0.4), (20, 0.7)])
    summary = curve.summary(rollouts=320, weight_versions=21, seconds=12.5)

    assert summary["first_window_reward"] == pytest.approx(0.1)
    assert summary["last_window_reward"] == pytest.approx(0.8)
    assert (summary["eval_reward_first"], summary["eval_reward_last"]) == (0.05, 0.7)
    assert (summary["steps"], summary["rollouts"], summary["weight_versions"]) == (20, 320, 21)
    assert summary["reward_per_step"] == curve.step_rewards
    assert summary["evaluations"] == [{"step": 0, "reward": 0.05}, {"step": 10, "reward": 0.4},
                                      {"step": 20, "reward": 0.7}]
    assert summary["seconds"] == 12.5


def test_summary_of_an_empty_curve_is_all_zero():
    summary = RewardCurve().summary(rollouts=0, weight_versions=0)
    assert summary["first_window_reward"] == summary["last_window_reward"] == 0.0
    assert summary["eval_reward_first"] == summary["eval_reward_last"] == 0.0
    assert summary["steps"] == 0 and summary["evaluations"] == []


@pytest.mark.parametrize("steps", [0, 12])
def test_plot_writes_a_png(tmp_path, steps):
    curve = RewardCurve(step_rewards=[i / max(steps, 1) for i in range(steps)],
                        evaluations=[(0, 0.1), (steps, 0.6)] if steps else [])
    path = curve.plot(tmp_path / "reward_curve.png")
    assert path == tmp_path / "reward_curve.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
