"""GRPO's data side: trajectories as policy samples, group-relative advantages, padded batches.

Knows torch and the wire's TokenTrace; the losses that consume a batch live in ``losses.py``. Each sample is one
trajectory with its exact tokens, a loss mask (1 where the policy produced the token), the
behaviour logprob of every token (from the inference engine) and the weight version that produced
it, so the loss can correct, or mask, tokens made by older weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# torch is imported where tensors are made: the trainer's module (which the launcher imports for
# the actor class) reaches this file through admission, long before a sample exists.
if TYPE_CHECKING:
    import numpy as np
    import torch

from rollmesh.messages import NO_VERSION, TokenTrace

ADVANTAGE_EPS = 1e-6


@dataclass(frozen=True)
class PolicySample:
    """One trajectory to train on: a TokenTrace's four lists (``from_trace``) and an advantage.
    ``logprobs`` are the behaviour logprobs (of the policy that sampled each token)."""

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    advantage: float
    # One weight version per token (NO_VERSION for tokens the policy did not generate); None:
    # unknown (demonstrations, tests), never stale.
    versions: list[int] | None = None
    # An infrastructure failure: the sample trains nothing and counts in no normalisation.
    infra_failed: bool = False
    # The temperature its tokens were sampled at (``losses.tempered``); 0 (greedy) counts as 1.
    temperature: float = 1.0
    # Routing replay (MoE): the experts the inference engine chose at each training input
    # position, [len(tokens) - 1, sparse layers, top_k] as ``router_replay.compact_rows`` keeps
    # them (uint8/uint16); None for a dense model or when none were recorded. Left out of ==
    # (an array has no single truth value).
    routed_experts: np.ndarray | None = field(default=None, compare=False)

    @classmethod
    def from_trace(cls, trace: TokenTrace, advantage: float, *, temperature: float = 1.0,
                   routed_experts: np.ndarray | None = None) -> PolicySample:
        return cls(trace.ids, trace.loss_mask, trace.logprobs, advantage, versions=trace.versions,
                   temperature=temperature, routed_experts=routed_experts)


def group_advantages(rewards: list[float]) -> list[float] | None:
    """(r - mean) / std within one group; None when every reward is equal (nothing to learn)."""
    if len(rewards) < 2:
        return None
    import torch

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
    mask: torch.Tensor  # [B, T-1] float, 1 where the target token is trained (the loss mask)
    behaviour_logprobs: torch.Tensor  # [B, T-1]
    advantages: torch.Tensor  # [B]
    versions: torch.Tensor | None = None  # [B, T-1] long, the target token's version; None: unknown
    infra_failed: torch.Tensor | None = None  # [B] bool; None: no sample failed
    # [B] float, each sample's sampling temperature (``losses.tempered``); None: all 1.
    temperatures: torch.Tensor | None = None

    @classmethod
    def collate(cls, samples: list[PolicySample], *, pad_id: int) -> "PolicyBatch":
        import torch

        length = max(len(sample.tokens) for sample in samples)
        tokens = torch.full((len(samples), length), pad_id, dtype=torch.long)
        mask = torch.zeros(len(samples), length)
        old = torch.zeros(len(samples), length)
        versions = torch.full((len(samples), length), NO_VERSION, dtype=torch.long)
        for row, sample in enumerate(samples):
            size = len(sample.tokens)
            tokens[row, :size] = torch.tensor(sample.tokens)
            mask[row, :size] = torch.tensor(sample.loss_mask, dtype=torch.float32)
            old[row, :size] = torch.tensor(sample.logprobs, dtype=torch.float32)
            if sample.versions is not None:
                versions[row, :size] = torch.tensor(sample.versions, dtype=torch.long)
        return cls(
            inputs=tokens[:, :-1],
            targets=tokens[:, 1:],
            mask=mask[:, 1:],
            behaviour_logprobs=old[:, 1:],
            advantages=torch.tensor([sample.advantage for sample in samples], dtype=torch.float32),
            versions=versions[:, 1:],
            infra_failed=torch.tensor([sample.infra_failed for sample in samples], dtype=torch.bool),
            temperatures=(None if all(sample.temperature == 1.0 for sample in samples)
                          else torch.tensor([sample.temperature for sample in samples], dtype=torch.float32)),
        )
