"""Import-path rewards of tests/test_train_evaluation.py, imported by the session mesh's rollout
workers (tests/ is on their PYTHONPATH; conftest's mesh lists them in rollout.reward_functions)."""

from __future__ import annotations

from rollmesh.rewards.reward_input import RewardInput


def always_one(sample: RewardInput) -> float:
    """1.0 whatever the model said: every sample that is scored passes."""
    return 1.0


def final_text_length(sample: RewardInput) -> float:
    """The length of the final answer the reward saw (weight 0: logged, not counted), so a test
    can compare it with the completion an evaluation's table shows."""
    return float(len(sample.final_text))
