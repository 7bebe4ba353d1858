"""The plain-torch trainer backend (CPU or one GPU): supervised warm start and policy updates.

Knows torch, the model builders and the checkpoint writers; nothing of Ray or NATS. The loss
itself is ``losses.py``; this module runs the forward passes it needs (new, proximal, reference
logprobs). The megatron-core backend offers the same methods (``TrainerBackend`` Protocol) from
its rank processes (``megatron_ranks``); ``build_trainer_backend`` picks by ``trainer.backend``.

Models: the inference engine's own ``CausalLM`` (Llama, Qwen2, Qwen3-MoE, Mixtral) loaded from
the model directory ``model.path``, so
the weights keep the HF names the inference workers load and published versions stage there
as they are. HF models train in float32 whatever ``model.dtype`` says: that is the serving
dtype (the workers' ``WeightStager`` casts on staging), and AdamW updates in bf16 would round
small steps away. ``trainer.precision = "bf16"`` trains bf16 weights against fp32 master weights
and moments instead (``optimizer_adamw``), the precision of large-scale training, and
``trainer.optimizer_offload`` keeps that fp32 state in host memory (``optimizer_offload``). MoE models replay the inference engine's expert choices (``router_replay``)
when every trained sample carries them.

Padding: batches are right-padded, and a padded position is never a target (mask 0) nor, in a
causal model, seen by a real one, so the pad id only has to be a valid embedding row: the
checkpoint's ``eos_token_id``, else 0. Supervised steps take packed rows (``packing``): the
model gets each row's reset positions and block-diagonal causal mask, so a packed row trains what
its examples would train one by one.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, overload

import torch
from torch import nn

from rollmesh.engine.memory_release import MemoryMoveStats, StorageSwap
from rollmesh.engine.models import CausalLM, CheckpointKeysError, load_hf_model
from rollmesh.training.errors import TrainerOffloadedError
from rollmesh.training.grpo import PolicyBatch, PolicySample
from rollmesh.training.losses import LossSettings, policy_epochs, tempered, token_logprobs
from rollmesh.training.lr_schedule import set_lr, warmup_lr
from rollmesh.training.megatron_checkpoint import FORMAT as MEGATRON_FORMAT
from rollmesh.training.megatron_checkpoint import save_megatron_checkpoint
from rollmesh.training.optimizer_adamw import AdamWConfig, MixedPrecisionAdamW
from rollmesh.training.optimizer_offload import ChunkedOffloadAdamW
from rollmesh.training.packing import PackedBatch, PackedRow, as_rows, collate_rows
from rollmesh.training.router_replay import batch_rows, forward_with_replay, replay_tensor

# What ``trainer.precision`` picks (``TorchTrainerBackend._new_optimizer``).
Optimizer = torch.optim.AdamW | MixedPrecisionAdamW | ChunkedOffloadAdamW


class TrainerBackend(Protocol):
    # PackedRows -> {"loss", "tokens", "trained_tokens", ...}; (tokens, mask) pairs -> the loss.
    def sft_step(self, sequences: list[PackedRow] | list[tuple[list[int], list[int]]], *,
                 lr: float) -> dict[str, float] | float: ...

    def policy_step(self, samples: list[PolicySample], *,
                    current_version: int | None = None) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, weights: dict[str, torch.Tensor]) -> None: ...

    def save_checkpoint(self, out_dir: Path, *, iteration: int, weight_version: int = 0) -> tuple[Path, str]: ...

    def training_state(self) -> dict[str, Any]: ...

    def load_training_state(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def build_trainer_backend(model_config, trainer_config, *, log_dir: Path | None = None) -> TrainerBackend:
    """The backend ``trainer_config.backend`` names: this class, or the megatron backend's rank
    processes (``megatron_ranks.MegatronRanks``; their output goes to ``log_dir``)."""
    if trainer_config.backend == "megatron":
        from rollmesh.training.megatron_ranks import MegatronRanks

        return MegatronRanks(model_config, trainer_config, log_dir=log_dir)
    return TorchTrainerBackend(model_config, trainer_config)


def build_trainable_model(model_config) -> nn.Module:
    """The model ``model_config`` names, with trainable float32 weights (module docstring)."""
    return load_hf_model(model_config.path, dtype=torch.float32).requires_grad_(True)


def training_pad_id(model: CausalLM) -> int:
    """The id right-padding is filled with (module docstring): any valid embedding row."""
    eos = model.config.eos_token_id
    return eos if eos is not None and 0 <= eos < model.config.vocab_size else 0


def load_hf_weights_in_place(model: CausalLM, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named ``weights`` into ``model``'s own parameters after checking names and
    shapes exactly (``CheckpointKeysError``). In place, unlike the engine's loader (which swaps
    in new tensors): the optimizers hold these parameter objects. A tied model's
    ``lm_head.weight`` may be absent (HF omits it) and, if present, is ignored, as the engine does."""
    weights = dict(weights)
    expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        weights.pop("lm_head.weight", None)
    missing, unexpected = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    mismatched = sorted(f"{name} {tuple(weights[name].shape)} != {tuple(shape)}"
                        for name, shape in expected.items() if name in weights and weights[name].shape != shape)
    if missing or unexpected or mismatched:
        raise CheckpointKeysError(path=None, missing=missing, unexpected=unexpected, mismatched=mismatched)
    model.load_state_dict(weights, strict=False)


class TorchTrainerBackend:
    def __init__(self, model_config, trainer_config) -> None:
        self.config = trainer_config
        self.model_config = model_config
        self.loss_settings = LossSettings.from_config(trainer_config)
        torch.manual_seed(trainer_config.seed)
        self.model = build_trainable_model(model_config)
        if trainer_config.precision == "bf16":
            self.model.to(torch.bfloat16)
        self.model.train()
        self.pad_id = training_pad_id(self.model)
        self.optimizer = self._new_optimizer(trainer_config.lr)
        self._sft_optimizer: Optimizer | None = None
        # Policy steps since the RL optimizer was made: the lr warmup's position (lr_schedule).
        self._policy_steps = 0
        # The KL reference: a frozen copy of the weights RL started from, taken at the first
        # policy step (after the warm start), only when kl_coef > 0. It costs one more copy of
        # the weights, without gradients or optimizer moments (a quarter more than the weights,
        # gradients and two AdamW moments training holds), and one no-grad forward per step.
        self._reference: torch.nn.Module | None = None
        # Between steps the accelerator may be lent (offload / reload): what was moved to the host.
        self._swap = StorageSwap()

    def _new_optimizer(self, lr: float) -> Optimizer:
        """torch's AdamW (fp32), or the mixed-precision AdamW whose fp32 state stays on the device
        or, with ``optimizer_offload``, in host memory (``trainer.precision = "bf16"``)."""
        if self.config.precision == "fp32":
            return torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=self.config.weight_decay)
        settings = AdamWConfig(lr=lr, weight_decay=self.config.weight_decay)
        device = next(self.model.parameters()).device
        optimizer = ChunkedOffloadAdamW if self.config.optimizer_offload else MixedPrecisionAdamW
        return optimizer(self.model.named_parameters(), config=settings, device=device)

    def _apply(self, optimizer: Optimizer, loss: torch.Tensor) -> float:
        """Backward, clip to ``grad_clip`` by the global norm, step; returns the norm."""
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if isinstance(optimizer, torch.optim.Optimizer):
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip))
        else:
            grad_norm = optimizer.clip_grad_norm(self.config.grad_clip)  # in fp32, applied by step
        optimizer.step()
        return grad_norm

    @overload
    def sft_step(self, sequences: list[PackedRow], *, lr: float) -> dict[str, float]: ...

    @overload
    def sft_step(self, sequences: list[tuple[list[int], list[int]]], *, lr: float) -> float: ...

    def sft_step(self, sequences, *, lr: float):
        """One supervised step; loss only where the mask is 1, its mean over the trained tokens.

        ``PackedRow`` s (``packing``): returns {"loss", "tokens" (real, padding excluded),
        "trained_tokens", "rows", "grad_norm"}. Plain (tokens, loss_mask) pairs (the demo's warm
        start): each is a one-example row, and the loss alone comes back, as a float."""
        self._check_resident("sft_step")
        self._pin_threads()
        if self._sft_optimizer is None:
            # The warm start has its own optimizer so RL starts with fresh Adam moments.
            self._sft_optimizer = self._new_optimizer(lr)
        self._reference = None  # RL has not started yet: the reference is taken after this
        loss, batch = self.sft_loss(as_rows(sequences))
        grad_norm = self._apply(self._sft_optimizer, loss)
        if not any(isinstance(item, PackedRow) for item in sequences):
            return float(loss.detach())
        return {"loss": float(loss.detach()), "tokens": float(batch.tokens),
                "trained_tokens": float(batch.trained_tokens), "rows": float(len(sequences)),
                "grad_norm": grad_norm}

    def sft_loss(self, rows: list[PackedRow]) -> tuple[torch.Tensor, PackedBatch]:
        """The differentiable SFT loss of ``rows`` (token mean over trained targets) and their
        batch. Every row runs with its positions reset per example and a block-diagonal causal
        mask, so no token sees another example; a batch of one-example rows runs plain causal
        (the same arithmetic, and sdpa's causal kernel instead of a dense mask)."""
        batch = collate_rows(rows, pad_id=self.pad_id)
        device = next(self.model.parameters()).device
        inputs = batch.inputs.to(device)
        if all(len(row.segment_lengths) == 1 for row in rows):
            logits = self.model(inputs)
        else:
            logits = self.model(inputs, positions=batch.positions.to(device), attn_mask=batch.attention.to(device))
        mask = batch.mask.to(device)
        logprobs = token_logprobs(logits, batch.targets.to(device))
        return -(logprobs * mask).sum() / mask.sum().clamp(min=1.0), batch

    def policy_step(self, samples: list[PolicySample], *,
                    current_version: int | None = None) -> dict[str, float]:
        """``ppo_epochs`` full-batch updates of the configured loss on one batch of samples.

        ``current_version``: the weight version being trained, which ``max_token_lag`` measures
        token ages against. An MoE model routes every forward (new, proximal, reference) to the
        samples' recorded experts when ``replay_routes`` finds them (stat ``router_replay``)."""
        self._check_resident("policy_step")
        self._pin_threads()
        if self._sft_optimizer is not None:
            # RL after a warm start: fresh moments, and (bf16) master weights taken from the
            # warm-started weights, not from the ones the RL optimizer was built on.
            self._sft_optimizer = None
            self.optimizer = self._new_optimizer(self.config.lr)
            self._policy_steps = 0
        set_lr(self.optimizer, warmup_lr(self.config.lr, self._policy_steps, self.config.lr_warmup_steps))
        self._policy_steps += 1
        settings = self.loss_settings
        batch = PolicyBatch.collate(samples, pad_id=self.pad_id)
        routes = self.replay_routes(samples, batch.inputs.shape[1])
        reference = self._reference_logprobs(batch, routes) if settings.kl_coef > 0 else None

        stats = policy_epochs(batch, settings, epochs=self.config.ppo_epochs,
                              logits=lambda: self._logits(self.model, batch.inputs, routes),
                              update=lambda loss: self._apply(self.optimizer, loss),
                              reference_logprobs=reference, current_version=current_version)
        return {**stats, "router_replay": float(routes is not None)}

    def replay_routes(self, samples: Sequence[PolicySample], seq_len: int) -> torch.Tensor | None:
        """The samples' recorded experts as ``routed_experts`` [B, seq_len, sparse layers, top_k],
        or None: a dense model, ``router_replay`` off, or a trained sample without rows (then the
        whole batch routes by the trainer's router; a half-replayed batch would mix the two).
        An infrastructure-failed sample trains nothing: its rows are neither needed nor read.
        Rows are checked (``RouterReplayError``: shape, ids, one row per input position)."""
        shape = getattr(self.model, "routing_shape", None)
        if shape is None or not self.config.router_replay:
            return None
        rows = batch_rows(samples, num_experts=self.model.config.moe.num_experts, routing_shape=shape)
        if rows is None:
            return None
        return replay_tensor(rows, seq_len, device=next(self.model.parameters()).device)

    @staticmethod
    def _logits(model: nn.Module, inputs: torch.Tensor, routes: torch.Tensor | None) -> torch.Tensor:
        if routes is None:
            return model(inputs)
        return forward_with_replay(model, inputs, routes)[0]

    def _reference_logprobs(self, batch: PolicyBatch, routes: torch.Tensor | None = None) -> torch.Tensor:
        if self._reference is None:
            self._reference = copy.deepcopy(self.model).requires_grad_(False).eval()
        with torch.no_grad():
            logits = tempered(self._logits(self._reference, batch.inputs, routes), batch.temperatures)
            return token_logprobs(logits, batch.targets)

    def state_dict(self) -> dict[str, torch.Tensor]:
        self._check_resident("state_dict")
        return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}

    def load_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Resume from saved weights. The optimizer starts afresh: its moments are not in the
        weights file (a restarted trainer loses them, and only them). So does the KL reference:
        it is not saved either, and is taken again from the resumed weights. The weights have HF
        names (what ``state_dict`` gives and the inference workers load)."""
        load_hf_weights_in_place(self.model, weights)
        self.optimizer = self._new_optimizer(self.config.lr)
        self._policy_steps = 0  # fresh moments warm up again
        self._reference = None

    def save_checkpoint(self, out_dir: Path, *, iteration: int, weight_version: int = 0) -> tuple[Path, str]:
        """Save the weights under ``out_dir`` for the resharder; (the path for ``CheckpointSaved``,
        its format): a Megatron-LM save root (``iter_NNNNNNN``, torch_dist, format
        "megatron_torch_dist"; ``megatron_checkpoint``). Reads the live weights: call it between
        steps, never during one. ``weight_version`` is the megatron backend's concern."""
        self._check_resident("save_checkpoint")
        weights = {name: tensor.detach() for name, tensor in self.model.state_dict().items()}
        run_args = {"lr": self.config.lr, "weight_decay": self.config.weight_decay,
                    "clip_grad": self.config.grad_clip, "seed": self.config.seed}
        path = save_megatron_checkpoint(weights, self.model.config, out_dir, iteration=iteration,
                                        extra_args=run_args)
        return path, MEGATRON_FORMAT

    def _pin_threads(self) -> None:
        # Steps run on whichever executor thread asyncio.to_thread picks, and OpenMP keeps a
        # thread count per thread, set when that thread first computed: pin it here, so a
        # step's arithmetic (bit for bit) never depends on which thread ran it.
        torch.set_num_threads(self.config.torch_threads)

    def training_state(self) -> dict[str, Any]:
        """What an exact resume needs besides the weights: the optimizer's moments and step
        counts, the RNG states, and the KL reference's weights when there is one."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "policy_steps": self._policy_steps,
            "torch_rng": torch.get_rng_state(),
            "reference": None if self._reference is None else self._reference.state_dict(),
        }

    def close(self) -> None:
        """Nothing to release: the model lives in this process."""

    # -- lending the accelerator between steps (the GPU scheduler) -------------------------------

    @property
    def offloaded(self) -> bool:
        return self._swap.offloaded

    def offload(self) -> MemoryMoveStats:
        """Between steps: the weights, the optimizers' state and the KL reference to host memory
        (pinned), gradients dropped (the next step recomputes them), the device's cached blocks
        returned, so the GPU scheduler can lend the accelerator (``scheduler.lend_role_accelerators``).
        Storage is emptied in place, so the optimizers keep their references. On CPU it all lives
        in host memory already: a no-op that still runs and reports (0 bytes moved). Steps, saves
        and weight reads raise ``TrainerOffloadedError`` until ``reload``."""
        optimizers = [self.optimizer, *([self._sft_optimizer] if self._sft_optimizer is not None else [])]
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        tensors = [*self.model.parameters(), *self.model.buffers()]
        if self._reference is not None:
            tensors += [*self._reference.parameters(), *self._reference.buffers()]
        for optimizer in optimizers:
            tensors += _optimizer_tensors(optimizer)
        return self._swap.offload(tensors)

    def reload(self) -> MemoryMoveStats:
        """Everything ``offload`` moved back on the device, where it was."""
        return self._swap.reload()

    def _check_resident(self, operation: str) -> None:
        if self._swap.offloaded:
            raise TrainerOffloadedError(operation)

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Restore ``training_state`` after ``load_state_dict`` of the same step's weights."""
        self.optimizer.load_state_dict(state["optimizer"])
        # A state saved before the warmup existed: its optimizer is past any warmup.
        self._policy_steps = state.get("policy_steps", self.config.lr_warmup_steps)
        torch.set_rng_state(state["torch_rng"])
        if state.get("reference") is not None:
            self._reference = copy.deepcopy(self.model).requires_grad_(False).eval()
            self._reference.load_state_dict(state["reference"])


def _optimizer_tensors(optimizer: Optimizer) -> list[torch.Tensor]:
    """The state tensors an optimizer holds (moments, fp32 master weights; host-resident ones
    are skipped by the move)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return [tensor for state in optimizer.named_state().values() for tensor in state]
