"""The demo's record of rewards: per-step training reward, periodic evaluations, the summary.

Knows nothing of Ray or NATS; matplotlib only to draw ``reward_curve.png``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def window_mean(values: list[float], fraction: float, *, last: bool) -> float:
    """Mean of the first (or last) ``fraction`` of ``values``, at least one value."""
    if not values:
        return 0.0
    size = max(1, round(len(values) * fraction))
    window = values[-size:] if last else values[:size]
    return sum(window) / len(window)


@dataclass
class RewardCurve:
    step_rewards: list[float] = field(default_factory=list)
    # (trainer step at which the evaluation was requested, mean reward)
    evaluations: list[tuple[int, float]] = field(default_factory=list)

    def summary(self, *, rollouts: int, weight_versions: int, **extra: Any) -> dict[str, Any]:
        return {
            "first_window_reward": window_mean(self.step_rewards, 0.1, last=False),
            "last_window_reward": window_mean(self.step_rewards, 0.1, last=True),
            "eval_reward_first": self.evaluations[0][1] if self.evaluations else 0.0,
            "eval_reward_last": self.evaluations[-1][1] if self.evaluations else 0.0,
            "steps": len(self.step_rewards),
            "rollouts": rollouts,
            "weight_versions": weight_versions,
            "reward_per_step": self.step_rewards,
            "evaluations": [{"step": step, "reward": reward} for step, reward in self.evaluations],
            **extra,
        }

    def plot(self, path: Path, *, title: str = "rollmesh demo: molar mass with a sandboxed calculator",
             reward_label: str = "reward (exact answer via the calculator tool)") -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(8, 4.5))
        steps = list(range(1, len(self.step_rewards) + 1))
        axes.plot(steps, self.step_rewards, color="#9ecae1", linewidth=1, label="training reward (per step)")
        if len(self.step_rewards) >= 5:
            width = max(2, len(self.step_rewards) // 10)
            smooth = [sum(self.step_rewards[max(0, i - width + 1): i + 1]) / len(self.step_rewards[max(0, i - width + 1): i + 1])
                      for i in range(len(self.step_rewards))]
            axes.plot(steps, smooth, color="#08519c", linewidth=2, label=f"training reward ({width}-step mean)")
        if self.evaluations:
            axes.plot([s for s, _ in self.evaluations], [r for _, r in self.evaluations], "o-",
                      color="#e6550d", label="held-out eval reward")
        axes.set_xlabel("RL step")
        axes.set_ylabel(reward_label)
        rewards = self.step_rewards + [reward for _, reward in self.evaluations]
        if rewards and (min(rewards) < 0 or max(rewards) > 1):  # a reward beyond [0, 1]: its own scale
            axes.set_ylim(min(rewards) - 0.05, max(rewards) + 0.05)
        else:
            axes.set_ylim(-0.02, 1.02)
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend(loc="lower right")
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        return path
