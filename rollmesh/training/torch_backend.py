"""The plain-torch trainer backend (CPU or one GPU): supervised warm start and policy updates.

Knows torch and the model builder; nothing of Ray or NATS. The loss itself is ``losses.py``; this
module runs the forward passes it needs (new, proximal, reference logprobs). A later megatron-core
backend offers the same methods (``TrainerBackend`` Protocol).
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch

from rollmesh.engine.model import build_model
from rollmesh.engine.tokenizer import PAD_ID
from rollmesh.training.grpo import PolicyBatch, PolicySample
from rollmesh.training.losses import LossSettings, policy_loss, token_logprobs


class TrainerBackend(Protocol):
    def sft_step(self, sequences: list[tuple[list[int], list[int]]], *, lr: float) -> float: ...

    def policy_step(self, samples: list[PolicySample], *,
                    current_version: int | None = None) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, weights: dict[str, torch.Tensor]) -> None: ...

    def training_state(self) -> dict[str, Any]: ...

    def load_training_state(self, state: dict[str, Any]) -> None: ...


class TorchTrainerBackend:
    def __init__(self, model_config, trainer_config) -> None:
        self.config = trainer_config
        self.loss_settings = LossSettings.from_config(trainer_config)
        torch.manual_seed(trainer_config.seed)
        self.model = build_model(model_config)
        self.model.train()
        self.optimizer = self._new_optimizer(trainer_config.lr)
        self._sft_optimizer: torch.optim.Optimizer | None = None
        # The KL reference: a frozen copy of the weights RL started from, taken at the first
        # policy step (after the warm start), only when kl_coef > 0. It costs one more copy of
        # the weights, without gradients or optimizer moments (a quarter more than the weights,
        # gradients and two AdamW moments training holds), and one no-grad forward per step.
        self._reference: torch.nn.Module | None = None

    def _new_optimizer(self, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=self.config.weight_decay)

    def sft_step(self, sequences: list[tuple[list[int], list[int]]], *, lr: float) -> float:
        """One supervised step on (tokens, loss_mask) pairs; loss only where the mask is 1."""
        if self._sft_optimizer is None:
            # The warm start has its own optimizer so RL starts with fresh Adam moments.
            self._sft_optimizer = self._new_optimizer(lr)
        self._reference = None  # RL has not started yet: the reference is taken after this
        samples = [PolicySample(tokens, mask, [0.0] * len(tokens), 0.0) for tokens, mask in sequences]
        batch = PolicyBatch.collate(samples, pad_id=PAD_ID)
        logprobs = token_logprobs(self.model(batch.inputs), batch.targets)
        loss = -(logprobs * batch.mask).sum() / batch.mask.sum().clamp(min=1.0)
        self._sft_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self._sft_optimizer.step()
        return float(loss.detach())

    def policy_step(self, samples: list[PolicySample], *,
                    current_version: int | None = None) -> dict[str, float]:
        """``ppo_epochs`` full-batch updates of the configured loss on one batch of samples.

        ``current_version``: the weight version being trained, which ``max_token_lag`` measures
        token ages against."""
        settings = self.loss_settings
        batch = PolicyBatch.collate(samples, pad_id=PAD_ID)
        reference = self._reference_logprobs(batch) if settings.kl_coef > 0 else None
        proximal: torch.Tensor | None = None
        stats: dict[str, float] = {}
        for _ in range(self.config.ppo_epochs):
            logits = self.model(batch.inputs)
            new_logprobs = token_logprobs(logits, batch.targets)
            if settings.decoupled and proximal is None:
                # The first epoch's forward runs on the weights before this step's update: the
                # proximal policy, for free (full-batch updates; minibatches would need a pass).
                proximal = new_logprobs.detach()
            loss, stats = policy_loss(
                new_logprobs, batch, settings, proximal_logprobs=proximal,
                reference_logprobs=reference, logits=logits if settings.entropy_coef > 0 else None,
                current_version=current_version)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            self.optimizer.step()
            stats = {**stats, "loss": float(loss.detach()), "grad_norm": float(grad_norm)}
        return stats

    def _reference_logprobs(self, batch: PolicyBatch) -> torch.Tensor:
        if self._reference is None:
            self._reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        with torch.no_grad():
            return token_logprobs(self._reference(batch.inputs), batch.targets)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}

    def load_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Resume from saved weights. The optimizer starts afresh: its moments are not in the
        weights file (a restarted trainer loses them, and only them). So does the KL reference:
        it is not saved either, and is taken again from the resumed weights."""
        self.model.load_state_dict(weights)
        self.optimizer = self._new_optimizer(self.config.lr)
        self._reference = None

    def training_state(self) -> dict[str, Any]:
        """What an exact resume needs besides the weights: the optimizer's moments and step
        counts, the RNG states, and the KL reference's weights when there is one."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "reference": None if self._reference is None else self._reference.state_dict(),
        }

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Restore ``training_state`` after ``load_state_dict`` of the same step's weights."""
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("reference") is not None:
            self._reference = copy.deepcopy(self.model).requires_grad_(False).eval()
            self._reference.load_state_dict(state["reference"])
