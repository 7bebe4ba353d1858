"""The megatron-core trainer backend: policy updates of an HF model of the engine's families
(Llama, Qwen2, Qwen3-MoE, Mixtral; ``megatron_model``), tensor parallel (TP) and, for MoE models,
expert parallel (EP), under any torch.distributed backend (gloo on CPU, nccl on GPUs).

Knows megatron-core through ``megatron_model``, the loss of ``losses.py`` and the replay rule of
``router_replay``; nothing of Ray or NATS. One instance per rank, in processes the caller
spawned, with torch.distributed and ``parallel_state`` initialised; every method is then a
collective: all ranks call it together with the same arguments. It offers the torch backend's
methods (``TrainerBackend``), and the weights it hands out (``state_dict``) are whole, HF-named
tensors, so publishing is unchanged.

Choices, and what is left out:
- Logits are gathered over TP to the full vocabulary, then ``losses.policy_epochs`` (its
  ``token_logprobs`` and ``policy_loss``) runs exactly as in the torch backend (same numbers, entropy term included).
  megatron's ``vocab_parallel_cross_entropy`` would keep only a vocabulary slice per rank, less
  memory for big vocabularies, but the entropy term would need its own vocab-parallel form.
- Every rank trains the whole batch: no data parallel. megatron counts the EP ranks as
  data-parallel ranks of the dense parameters; here they see the same samples, so their dense
  gradients are equal (averaged anyway, so the replicas cannot drift by rounding), and the
  allgather dispatcher hands each expert every EP rank's copy of the tokens: its gradient is
  EP times the batch's and is divided by EP (``_finalize_gradients``, megatron's
  ``finalize_model_grads`` for this layout, which also sums the gradients of sequence-parallel
  norms, the routers and the QK norms over TP: each TP rank saw only part of their inputs).
- Routing replay (R3): an MoE model's forwards route to the samples' recorded experts when
  ``router_replay.batch_rows`` finds them (the torch backend's rule; stat ``router_replay``),
  through megatron-core's ``RouterReplay``; the gate weights still come from the trainer's
  router. ``recompute=True`` (constructor) recomputes each layer's activations in the
  backward, replaying the same experts there.
- A plain torch AdamW over each rank's local (sharded) parameters: AdamW is elementwise, so the
  shards step exactly as the whole tensors would. megatron's distributed optimizer (sharding the
  moments over data-parallel ranks) is out of scope, as is pipeline parallelism.
- Gradient clipping by the global norm: squared norms summed over all ranks, each replicated
  parameter counted once (on TP rank 0 of data-parallel rank 0); then torch's clip rule
  (max_norm / (norm + 1e-6)).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from rollmesh.engine.models import read_safetensors
from rollmesh.training.grpo import PolicyBatch, PolicySample
from rollmesh.training.losses import LossSettings, policy_epochs, token_logprobs
from rollmesh.training.megatron_checkpoint import FORMAT as MEGATRON_FORMAT
from rollmesh.training.megatron_checkpoint import save_megatron_checkpoint
from rollmesh.training.megatron_model import MegatronLlama, UnsupportedMegatronModelError
from rollmesh.training.router_replay import batch_rows


class MegatronTrainerBackend:
    def __init__(self, model_config, trainer_config, *, recompute: bool | None = None) -> None:
        if recompute is None:
            recompute = trainer_config.megatron.recompute_activations
        if model_config.family != "hf":
            raise UnsupportedMegatronModelError("the megatron backend trains HF models only",
                                                field="family", path=str(model_config.hf_path))
        self.config = trainer_config
        self.model_config = model_config
        self.loss_settings = LossSettings.from_config(trainer_config)
        torch.manual_seed(trainer_config.seed)
        self.net = MegatronLlama(model_config.hf_path, recompute=recompute)
        self.net.load_hf_state_dict(read_safetensors(model_config.hf_path, dtype=torch.float32))
        self.net.model.train()
        eos = self.net.hf_config.eos_token_id
        # As the torch backend: any valid embedding row (padded positions are never targets).
        self.pad_id = eos if eos is not None and 0 <= eos < self.net.spec.vocab_size else 0
        self.optimizer = self._new_optimizer(trainer_config.lr)
        self._sft_optimizer: torch.optim.Optimizer | None = None
        # The KL reference: a copy of this rank's shards, taken at the first policy step.
        self._reference: dict[str, torch.Tensor] | None = None

    def _parameters(self) -> list[torch.nn.Parameter]:
        return list(self.net.model.parameters())

    def _new_optimizer(self, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self._parameters(), lr=lr, weight_decay=self.config.weight_decay)

    def _finalize_gradients(self) -> None:
        """Make every rank's gradients those of the whole batch (module docstring)."""
        from megatron.core import parallel_state

        named = [(name, p.grad) for name, p in self.net.params.items() if p.grad is not None]
        partial = [g for name, g in named if "q_layernorm" in name or "k_layernorm" in name
                   or (self.net.sequence_parallel and getattr(self.net.params[name], "sequence_parallel", False))]
        _all_reduce_sum(partial, parallel_state.get_tensor_model_parallel_group())
        if self.net.ep > 1:
            dense = [g for name, g in named if not self.net.is_expert(name)]
            _all_reduce_sum(dense, parallel_state.get_data_parallel_group())
            for g in dense:
                g.div_(parallel_state.get_data_parallel_world_size())
            for name, g in named:
                if self.net.is_expert(name):
                    g.div_(self.net.ep)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip every rank's gradients by the norm of the whole model's gradient; returns it."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        first_dp = parallel_state.get_data_parallel_rank() == 0
        first_expert_dp = parallel_state.get_expert_data_parallel_rank() == 0
        # Each distinct shard once: an expert's on its own EP rank (split over expert TP), a
        # replicated parameter's on TP rank 0 (their gradients are equal on every rank).
        grads = [(p.grad, first_expert_dp if self.net.is_expert(name)
                  else first_dp and param_is_not_tensor_parallel_duplicate(p))
                 for name, p in self.net.params.items() if p.grad is not None]
        squares = sum((g.double().pow(2).sum() for g, own in grads if own), torch.zeros((), dtype=torch.float64))
        dist.all_reduce(squares)
        norm = float(squares.sqrt())
        coef = min(max_norm / (norm + 1e-6), 1.0)
        if coef < 1.0:
            for g, _ in grads:
                g.mul_(coef)
        return norm

    def sft_step(self, sequences: list[tuple[list[int], list[int]]], *, lr: float) -> float:
        """One supervised step on (tokens, loss_mask) pairs; loss only where the mask is 1."""
        if self._sft_optimizer is None:
            self._sft_optimizer = self._new_optimizer(lr)  # RL starts with fresh moments
        self._reference = None
        samples = [PolicySample(tokens, mask, [0.0] * len(tokens), 0.0) for tokens, mask in sequences]
        batch = PolicyBatch.collate(samples, pad_id=self.pad_id)
        logprobs = token_logprobs(self.net.logits(batch.inputs), batch.targets)
        loss = -(logprobs * batch.mask).sum() / batch.mask.sum().clamp(min=1.0)
        self._sft_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._finalize_gradients()
        self.clip_grad_norm(self.config.grad_clip)
        self._sft_optimizer.step()
        return float(loss.detach())

    def policy_step(self, samples: list[PolicySample], *,
                    current_version: int | None = None) -> dict[str, float]:
        """``ppo_epochs`` full-batch updates of the configured loss (as the torch backend's); an
        MoE model replays the samples' recorded experts in every forward when ``replay_rows``
        finds them (stat ``router_replay``)."""
        settings = self.loss_settings
        batch = PolicyBatch.collate(samples, pad_id=self.pad_id)
        rows = self.replay_rows(samples)
        reference = self._reference_logprobs(batch, rows) if settings.kl_coef > 0 else None

        def update(loss: torch.Tensor) -> float:
            self.optimizer.zero_grad(set_to_none=True)
            self.net.prepare_backward()
            loss.backward()
            self._finalize_gradients()
            grad_norm = self.clip_grad_norm(self.config.grad_clip)
            self.optimizer.step()
            return grad_norm

        stats = policy_epochs(batch, settings, epochs=self.config.ppo_epochs,
                              logits=lambda: self.net.logits(batch.inputs, rows), update=update,
                              reference_logprobs=reference, current_version=current_version)
        return {**stats, "router_replay": float(rows is not None)}

    def replay_rows(self, samples: list[PolicySample]) -> list[np.ndarray] | None:
        """The samples' recorded experts, checked, one array per sample (``batch_rows``), or
        None: a dense model, ``router_replay`` off, or a trained sample without rows. Every rank
        keeps the compact rows of the whole batch (it trains every sample) and widens only its
        own positions (``MegatronLlama.logits``)."""
        shape = self.net.routing_shape
        if shape is None or not self.config.router_replay:
            return None
        return batch_rows(samples, num_experts=self.net.spec.num_experts, routing_shape=shape)

    def _reference_logprobs(self, batch: PolicyBatch, rows: list[np.ndarray] | None = None) -> torch.Tensor:
        params = dict(self.net.model.named_parameters())
        if self._reference is None:
            self._reference = {name: p.detach().clone() for name, p in params.items()}
        # Swap the reference shards in for one no-grad forward, then the live ones back.
        live = {name: p.data for name, p in params.items()}
        try:
            for name, p in params.items():
                p.data = self._reference[name]
            with torch.no_grad():
                return token_logprobs(self.net.logits(batch.inputs, rows), batch.targets)
        finally:
            for name, p in params.items():
                p.data = live[name]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole HF-named tensors, gathered from every rank (a collective)."""
        return self.net.hf_state_dict()

    def load_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Resume from whole HF-named weights: each rank keeps its shards. Fresh optimizer and
        KL reference, as in the torch backend."""
        self.net.load_hf_state_dict(weights)
        self.optimizer = self._new_optimizer(self.config.lr)
        self._reference = None

    def save_checkpoint(self, out_dir: Path, *, iteration: int, weight_version: int = 0) -> tuple[Path, str]:
        """The torch backend's Megatron-LM save root of the gathered weights, written by global
        rank 0 (one rank's file, TP 1: the resharder converts it to any layout)."""
        weights = self.state_dict()
        run_args = {"lr": self.config.lr, "weight_decay": self.config.weight_decay,
                    "clip_grad": self.config.grad_clip, "seed": self.config.seed}
        path = Path(out_dir) / f"iter_{iteration:07d}"
        if dist.get_rank() == 0:
            path = save_megatron_checkpoint(weights, self.net.hf_config, out_dir, iteration=iteration,
                                            extra_args=run_args)
        dist.barrier()
        return path, MEGATRON_FORMAT

    def training_state(self) -> dict[str, Any]:
        """This rank's optimizer moments (of its shards), RNG state and KL reference shards."""
        return {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                "reference": self._reference, "tp_rank": self.net.rank, "tp": self.net.tp,
                "ep_rank": self.net.ep_rank, "ep": self.net.ep}

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Restore this rank's ``training_state`` (same TP x EP layout) after ``load_state_dict``."""
        for field, here in (("tp", (self.net.rank, self.net.tp)), ("ep", (self.net.ep_rank, self.net.ep))):
            saved = (state.get(f"{field}_rank", 0), state.get(field, 1))
            if saved != here:
                raise UnsupportedMegatronModelError(
                    f"training state of {field.upper()} rank {saved[0]}/{saved[1]} loaded on {here[0]}/{here[1]}",
                    field=field, path=str(self.model_config.hf_path))
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self._reference = state.get("reference")


def _all_reduce_sum(grads: list[torch.Tensor], group) -> None:
    """Sum ``grads`` over ``group`` in place, in one flat collective."""
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(reduced)
