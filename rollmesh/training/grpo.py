"""GRPO: group-relative advantages and the clipped importance-ratio loss.

Knows torch only. Each sample is one trajectory with its exact tokens, a loss mask (1 where the
policy produced the token) and the behaviour logprob of every token, so off-policy tokens (made by
an older weight version) are corrected by the ratio exp(new_logprob - behaviour_logprob).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADVANTAGE_EPS = 1e-6


@dataclass(frozen=True)
class PolicySample:
    tokens: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    advantage: float


def group_advantages(rewards: list[float]) -> list[float] | None:
    """(r - mean) / std within one group; None when every reward is equal (nothing to learn)."""
    if len(rewards) < 2:
        return None
    values = torch.tensor(rewards, dtype=torch.float64)
    std = values.std(unbiased=False)
    if float(std) < ADVANTAGE_EPS:
        return None
    return ((values - values.mean()) / (std + ADVANTAGE_EPS)).tolist()


@dataclass(frozen=True)
class PolicyBatch:
    """Right-padded tensors for a list of samples; position t predicts token t+1."""

    inputs: torch.Tensor  # [B, T-1]
    targets: torch.Tensor  # [B, T-1]
    mask: torch.Tensor  # [B, T-1] float, 1 where the target token is trained
    behaviour_logprobs: torch.Tensor  # [B, T-1]
    advantages: torch.Tensor  # [B]

    @classmethod
    def collate(cls, samples: list[PolicySample], *, pad_id: int) -> "PolicyBatch":
        length = max(len(sample.tokens) for sample in samples)
        tokens = torch.full((len(samples), length), pad_id, dtype=torch.long)
        mask = torch.zeros(len(samples), length)
        old = torch.zeros(len(samples), length)
        for row, sample in enumerate(samples):
            size = len(sample.tokens)
            tokens[row, :size] = torch.tensor(sample.tokens)
            mask[row, :size] = torch.tensor(sample.loss_mask, dtype=torch.float32)
            old[row, :size] = torch.tensor(sample.behaviour_logprobs, dtype=torch.float32)
        return cls(
            inputs=tokens[:, :-1],
            targets=tokens[:, 1:],
            mask=mask[:, 1:],
            behaviour_logprobs=old[:, 1:],
            advantages=torch.tensor([sample.advantage for sample in samples], dtype=torch.float32),
        )


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]


def clipped_policy_loss(
    new_logprobs: torch.Tensor, batch: PolicyBatch, *, clip_eps: float, dual_clip: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate, averaged over trained tokens of the whole batch (token-mean).

    ``dual_clip`` (c > 1) also bounds the other side: with a negative advantage the PPO clip
    leaves a large ratio unbounded, and tokens made by much older versions (admitted long
    rollouts) can have one; their objective is floored at c * advantage (dual-clip PPO)."""
    ratio = torch.exp(new_logprobs - batch.behaviour_logprobs)
    advantages = batch.advantages[:, None]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    objective = torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        objective = torch.where(advantages < 0, torch.maximum(objective, dual_clip * advantages), objective)
    per_token = -objective
    trained = batch.mask.sum().clamp(min=1.0)
    loss = (per_token * batch.mask).sum() / trained
    with torch.no_grad():
        clip_fraction = (((ratio - 1).abs() > clip_eps).float() * batch.mask).sum() / trained
        mean_ratio = (ratio * batch.mask).sum() / trained
    return loss, {"clip_fraction": float(clip_fraction), "mean_ratio": float(mean_ratio)}
