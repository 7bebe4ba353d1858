"""The plain-torch trainer backend (CPU or one GPU): supervised warm start and GRPO updates.

Knows torch and the model builder; nothing of Ray or NATS. A later megatron-core backend offers
the same methods (``TrainerBackend`` Protocol).
"""

from __future__ import annotations

from typing import Protocol

import torch

from rollmesh.engine.model import build_model
from rollmesh.engine.tokenizer import PAD_ID
from rollmesh.training.grpo import PolicyBatch, PolicySample, clipped_policy_loss, token_logprobs


class TrainerBackend(Protocol):
    def sft_step(self, sequences: list[tuple[list[int], list[int]]], *, lr: float) -> float: ...

    def policy_step(self, samples: list[PolicySample]) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, weights: dict[str, torch.Tensor]) -> None: ...


class TorchTrainerBackend:
    def __init__(self, model_config, trainer_config) -> None:
        self.config = trainer_config
        torch.manual_seed(trainer_config.seed)
        self.model = build_model(model_config)
        self.model.train()
        self.optimizer = self._new_optimizer(trainer_config.lr)
        self._sft_optimizer: torch.optim.Optimizer | None = None

    def _new_optimizer(self, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=self.config.weight_decay)

    def sft_step(self, sequences: list[tuple[list[int], list[int]]], *, lr: float) -> float:
        """One supervised step on (tokens, loss_mask) pairs; loss only where the mask is 1."""
        if self._sft_optimizer is None:
            # The warm start has its own optimizer so RL starts with fresh Adam moments.
            self._sft_optimizer = self._new_optimizer(lr)
        samples = [PolicySample(tokens, mask, [0.0] * len(tokens), 0.0) for tokens, mask in sequences]
        batch = PolicyBatch.collate(samples, pad_id=PAD_ID)
        logprobs = token_logprobs(self.model(batch.inputs), batch.targets)
        loss = -(logprobs * batch.mask).sum() / batch.mask.sum().clamp(min=1.0)
        self._sft_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self._sft_optimizer.step()
        return float(loss.detach())

    def policy_step(self, samples: list[PolicySample]) -> dict[str, float]:
        """``ppo_epochs`` full-batch updates of the clipped GRPO loss on one batch of samples."""
        batch = PolicyBatch.collate(samples, pad_id=PAD_ID)
        stats: dict[str, float] = {}
        for _ in range(self.config.ppo_epochs):
            new_logprobs = token_logprobs(self.model(batch.inputs), batch.targets)
            loss, stats = clipped_policy_loss(new_logprobs, batch, clip_eps=self.config.clip_eps,
                                              dual_clip=self.config.dual_clip)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            self.optimizer.step()
            stats = {**stats, "loss": float(loss.detach()), "grad_norm": float(grad_norm)}
        return stats

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}

    def load_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Resume from saved weights. The optimizer starts afresh: its moments are not in the
        weights file (a restarted trainer loses them, and only them)."""
        self.model.load_state_dict(weights)
        self.optimizer = self._new_optimizer(self.config.lr)
