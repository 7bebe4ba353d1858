"""The megatron-core trainer backend: policy updates of an HF model of the engine's families
(Llama, Qwen2, Qwen3-MoE, Mixtral; ``megatron_model``) at any TP x PP x DP layout, with expert
parallel (EP, taken from the DP ranks) for MoE models, under any torch.distributed backend
(gloo on CPU, nccl on GPUs). Verified on CPU under gloo against the torch backend (stats and
weights after the step): TP=2; PP=2 (tied and untied); DP=2 with the distributed optimizer;
TP=2 x PP=2; PP=2 x DP=2; MoE at DP=2 x EP=2, TP=2 (sequence parallel), TP=2 x DP=2 x EP=2 and
PP=2, with routing replay, also under activation recompute; a bit-for-bit resume from
``training_state`` with either optimizer (``test_training_megatron_ranks``); bf16 with fp32
main parameters, and with the chunked optimizer offload, at TP=2 (``test_training_megatron_bf16``).
Not run yet: MoE at PP x TP or PP x EP, and anything on GPUs (``test_training_megatron_cuda``
and ``scripts/gpu/smoke.sh`` are written for them).

Devices (``megatron_devices``): the model is built on the CPU, then moved to the rank's device
(GPU LOCAL_RANK, or the CPU), before megatron's DDP puts its gradient buffers beside it; every
microbatch (inputs, the loss's tensors, replay routes, packed positions and masks) is moved there
too, so collectives run on device tensors (NCCL's only kind). On CUDA megatron's RNG tracker is
seeded first (its forwards fork the "model-parallel-rng" state). What leaves a rank is moved to
the CPU by ``megatron_ranks``. ``trainer.precision = "bf16"``: bf16 parameters with megatron's
fp32 main parameters (``megatron_optimizer``); ``trainer.optimizer_offload`` then keeps that
fp32 state in host memory (``megatron_offload``, dense models).

Knows megatron-core through ``megatron_model`` (the stage, its weights and routers),
``megatron_pipeline`` (forward/backward) and ``megatron_optimizer`` (DDP, optimizer), the loss
of ``losses.py`` and the replay rule of ``router_replay``; nothing of Ray or NATS. One instance
per rank, in processes the caller spawned, with torch.distributed and ``parallel_state``
initialised; every method is then a collective: all ranks call it together with the same
arguments. It offers the torch backend's methods (``TrainerBackend``), and the weights it hands
out (``state_dict``) are whole, HF-named tensors, so publishing is unchanged.

How a step runs:
- Data parallel: every rank gets the whole batch and collates it (so all agree on its padded
  length), then trains only its DP rank's contiguous share (``router_replay.rank_sample_indices``);
  megatron's DDP reduces the gradients (``megatron_pipeline``: DP, expert-DP, sequence-parallel
  norms over TP, tied embeddings across stages) and its optimizer (``trainer.megatron
  .distributed_optimizer`` picks the distributed one) clips by the global norm and steps.
- Microbatches: one per DP rank at PP=1; at PP>1 each DP rank's share splits into PP
  microbatches (fewer when it has fewer samples), enough for 1F1B to keep every stage busy once
  the pipeline is full. All DP ranks run the same number of microbatches of one shape (the
  largest share's), padded with blank samples (mask 0: they count in no loss, count or stat).
  No ``trainer`` knob sizes them: the batch is the trainer's, and these are the fewest
  microbatches that fill the pipeline.
- Every forward and backward goes through ``megatron_pipeline.forward_backward`` (PP=1 too).
  The last stage gathers the logits over TP to the full vocabulary and runs ``losses
  .policy_loss`` per microbatch in megatron's (sum, count) form, so the loss is the torch
  backend's over the whole batch (token mean for "ppo_clip", mean of per-sample means for
  "grpo"); the entropy term reads the full-vocabulary logits. Stats are merged over
  microbatches and DP ranks (token means weighted by trained tokens, counts summed).
  megatron's ``vocab_parallel_cross_entropy`` would keep only a vocabulary slice per rank, less
  memory for big vocabularies, but the entropy term would need its own vocab-parallel form.
- Decoupled PPO's proximal logprobs are the first epoch's (as ``losses.policy_epochs``); the KL
  reference's come from a forward-only pass with the reference shards swapped in.
- Supervised steps on packed rows (``packing``): each microbatch carries its rows' positions and
  block-diagonal causal mask, and the stage runs RoPE at those positions (``MegatronLlama
  .run_stage``). Not megatron's packed THD format (``PackedSeqParams``): that needs Transformer
  Engine's attention, absent on the CPU path and untestable here, so it is not used even where
  Transformer Engine is installed; the dense mask costs O(T^2) attention per row instead.
- Routing replay (R3): an MoE model's forwards route to the samples' recorded experts when
  ``router_replay.batch_rows`` finds them (the torch backend's rule; stat ``router_replay``).
  Every rank checks every sample's rows (cheap, and a bad row fails every rank alike instead of
  leaving the others in a collective) but widens only its own samples' rows, and under
  sequence parallel only its own positions (``MegatronLlama.replay_targets``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from rollmesh.engine.models import read_safetensors
from rollmesh.training.grpo import PolicyBatch, PolicySample
from rollmesh.training.losses import LossName, LossSettings, policy_loss, tempered, token_logprobs
from rollmesh.training.lr_schedule import set_lr, warmup_lr
from rollmesh.training.megatron_checkpoint import FORMAT as MEGATRON_FORMAT
from rollmesh.training.megatron_checkpoint import save_megatron_checkpoint
from rollmesh.training.megatron_devices import current_device, seed_model_parallel_rng
from rollmesh.training.megatron_model import MegatronLlama, UnsupportedMegatronModelError
from rollmesh.training.megatron_offload import MegatronOffloadAdamW, peak_device_bytes
from rollmesh.training.megatron_optimizer import (
    build_adamw,
    load_optimizer_state,
    optimizer_state,
    step,
    wrap_data_parallel,
    zero_grads,
)
from rollmesh.training.megatron_pipeline import LossFn, Microbatch, PipelineStepResult, forward_backward
from rollmesh.training.packing import PackedBatch, PackedRow, as_rows, block_causal_mask, collate_rows
from rollmesh.training.router_replay import batch_rows, rank_sample_indices

# policy_loss's stats that are counts (summed over microbatches); the others are means.
_COUNTED_STATS = frozenset({"trained_tokens", "stale_tokens", "samples_trained", "infra_failed_samples"})


@dataclasses.dataclass(frozen=True)
class _Piece:
    """A microbatch's samples for the loss: its index in the step, its rows of the batch; for
    packed rows also their positions [B, T] and attention mask [B, 1, T, T] (True = masked)."""

    index: int
    batch: PolicyBatch
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None


class MegatronTrainerBackend:
    def __init__(self, model_config, trainer_config, *, recompute: bool | None = None) -> None:
        from megatron.core import parallel_state

        if recompute is None:
            recompute = trainer_config.megatron.recompute_activations
        self.config = trainer_config
        self.model_config = model_config
        self.loss_settings = LossSettings.from_config(trainer_config)
        self.distributed_optimizer = trainer_config.megatron.distributed_optimizer
        self.dp, self.dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        torch.manual_seed(trainer_config.seed)
        self.device = current_device()
        seed_model_parallel_rng(trainer_config.seed)
        self.dtype = torch.bfloat16 if trainer_config.precision == "bf16" else torch.float32
        self.offload = trainer_config.optimizer_offload
        self.net = MegatronLlama(model_config.path, recompute=recompute, dtype=self.dtype, device=self.device)
        if self.offload and self.net.spec.num_experts:
            raise UnsupportedMegatronModelError("trainer.optimizer_offload takes dense models only "
                                                "(training/megatron_offload.py)", field="num_experts",
                                                path=str(model_config.path))
        self.net.load_hf_state_dict(read_safetensors(model_config.path, dtype=torch.float32))
        # This stage in megatron's DDP: what forward_backward runs and the optimizers step.
        self.model = wrap_data_parallel(self.net.model, distributed_optimizer=self.distributed_optimizer,
                                        grad_reduce_in_fp32=not self.offload)
        self.model.train()
        eos = self.net.hf_config.eos_token_id
        # As the torch backend: any valid embedding row (padded positions are never targets).
        self.pad_id = eos if eos is not None and 0 <= eos < self.net.spec.vocab_size else 0
        self.optimizer = self._new_optimizer(trainer_config.lr)
        self._sft_optimizer = None
        self._policy_steps = 0  # since the RL optimizer was made: the lr warmup's position
        # The KL reference: a copy of this rank's shards, taken at the first policy step.
        self._reference: dict[str, torch.Tensor] | None = None

    def _new_optimizer(self, lr: float):
        if self.offload:
            return MegatronOffloadAdamW(self.model, lr=lr, weight_decay=self.config.weight_decay,
                                        clip_grad=self.config.grad_clip, device=self.device)
        return build_adamw([self.model], lr=lr, weight_decay=self.config.weight_decay,
                           clip_grad=self.config.grad_clip, distributed_optimizer=self.distributed_optimizer,
                           dtype=self.dtype)

    def sft_step(self, sequences: list[PackedRow] | list[tuple[list[int], list[int]]], *,
                 lr: float) -> dict[str, float] | float:
        """One supervised step; loss only where the mask is 1 (its token mean over the whole
        batch). ``PackedRow`` s (``packing``): rows run with reset positions and a block-diagonal
        causal mask (a megatron mask: the CPU path has no Transformer Engine for the packed THD
        format), and the torch backend's {"loss", "tokens", "trained_tokens", "rows"} come back
        (no "grad_norm": megatron's optimizer step keeps it). Plain (tokens, loss_mask) pairs: one
        row each, run plain causal as before, and the loss alone comes back."""
        if self._sft_optimizer is None:
            self._sft_optimizer = self._new_optimizer(lr)  # RL keeps its own, fresh moments
        self._reference = None
        rows = as_rows(sequences)
        packed = collate_rows(rows, pad_id=self.pad_id)
        zeros = torch.zeros_like(packed.mask)
        batch = PolicyBatch(inputs=packed.inputs, targets=packed.targets, mask=packed.mask,
                            behaviour_logprobs=zeros, advantages=torch.zeros(len(rows)))
        several = any(len(row.segment_lengths) > 1 for row in rows)
        microbatches = self._microbatches(batch, None, packed if several else None)

        def loss_fn(logits: torch.Tensor, microbatch: Microbatch):
            piece: PolicyBatch = microbatch.extra.batch
            logprobs = token_logprobs(logits[:, : piece.targets.shape[1]], piece.targets)
            return -(logprobs * piece.mask).sum(), int(piece.mask.sum()), {}

        zero_grads([self.model], self._sft_optimizer)
        result = self._pass(microbatches, loss_fn)
        step(self._sft_optimizer)
        if not any(isinstance(item, PackedRow) for item in sequences):
            return result.loss
        return {"loss": result.loss, "tokens": float(packed.tokens), "trained_tokens": float(packed.trained_tokens),
                "rows": float(len(rows))}

    def policy_step(self, samples: list[PolicySample], *,
                    current_version: int | None = None) -> dict[str, float]:
        """``ppo_epochs`` full-batch updates of the configured loss (as the torch backend's
        ``losses.policy_epochs``), each rank training its DP share; an MoE model replays the
        samples' recorded experts in every forward when ``replay_rows`` finds them (stat
        ``router_replay``)."""
        set_lr(self.optimizer, warmup_lr(self.config.lr, self._policy_steps, self.config.lr_warmup_steps))
        self._policy_steps += 1
        settings = self.loss_settings
        batch = PolicyBatch.collate(samples, pad_id=self.pad_id)
        rows = self.replay_rows(samples)
        microbatches = self._microbatches(batch, rows)
        reference = self._reference_logprobs(microbatches) if settings.kl_coef > 0 else {}
        proximal: dict[int, torch.Tensor] = {}  # the first epoch's logprobs, per microbatch

        def loss_fn(logits: torch.Tensor, microbatch: Microbatch):
            index, piece = microbatch.extra.index, microbatch.extra.batch
            logits = tempered(logits[:, : piece.targets.shape[1]], piece.temperatures)
            new_logprobs = token_logprobs(logits, piece.targets)
            # The first epoch's: decoupled PPO's proximal logprobs, and logprob_mismatch's.
            proximal.setdefault(index, new_logprobs.detach())
            loss, stats = policy_loss(
                new_logprobs, piece, settings, proximal_logprobs=proximal.get(index),
                reference_logprobs=reference.get(index), current_version=current_version,
                logits=logits if settings.entropy_coef > 0 else None)
            # policy_loss's means are sum / max(count, 1): times count, the sum (0 when count is 0).
            count = stats["trained_tokens"] if settings.loss == "ppo_clip" else stats["samples_trained"]
            return loss * count, int(count), stats

        for _ in range(self.config.ppo_epochs):  # the last epoch's stats, as policy_epochs reports
            zero_grads([self.model], self.optimizer)
            result = self._pass(microbatches, loss_fn)
            grad_norm = step(self.optimizer)
        return {**_merged_stats(result, settings.loss), "loss": result.loss, "grad_norm": grad_norm,
                "router_replay": float(rows is not None)}

    def replay_rows(self, samples: list[PolicySample]) -> list[np.ndarray] | None:
        """The samples' recorded experts, checked, one compact array per sample
        (``batch_rows``), or None: a dense model, ``router_replay`` off, or a trained sample
        without rows. Each rank widens only its own samples' (``_microbatches``)."""
        shape = self.net.routing_shape
        if shape is None or not self.config.router_replay:
            return None
        return batch_rows(samples, num_experts=self.net.spec.num_experts, routing_shape=shape)

    def _microbatches(self, batch: PolicyBatch, rows: list[np.ndarray] | None,
                      packed: PackedBatch | None = None) -> list[Microbatch]:
        """This DP rank's share of ``batch`` as microbatches of one shape on every DP rank,
        padded with blank samples (module docstring), each with its replay targets and, given
        the ``packed`` rows ``batch`` was made of, their positions and block-diagonal mask."""
        total = batch.inputs.shape[0]
        share = list(rank_sample_indices(total, rank=self.dp_rank, world_size=self.dp))
        largest = -(-total // self.dp)
        count = 1 if self.net.pp == 1 else max(1, min(self.net.pp, largest))
        size = -(-max(largest, 1) // count)
        length = self.net.padded_length(batch.inputs.shape[1])
        out = []
        for index in range(count):
            picked = share[index * size:(index + 1) * size]
            piece = _blank_padded(batch, picked, size)
            routes = None
            if rows is not None:
                blank = np.zeros((0, *self.net.routing_shape), dtype=np.uint8)
                routes = self.net.replay_targets([rows[i] for i in picked] + [blank] * (size - len(picked)), length)
            inputs = F.pad(piece.inputs, (0, length - piece.inputs.shape[1]), value=self.pad_id)
            positions = mask = None
            if packed is not None:
                positions, mask = (t.to(self.device) for t in _packed_layout(packed, picked, size, length))
            out.append(Microbatch(inputs.to(self.device), _Piece(index, _on(piece, self.device), positions, mask),
                                  routes))
        return out

    def _pass(self, microbatches: list[Microbatch], loss_fn: LossFn, *,
              forward_only: bool = False) -> PipelineStepResult:
        """One pass of every microbatch through the pipeline (a backward too, unless
        ``forward_only``), the routers set per microbatch."""
        self.net.clear_routes()
        with torch.set_grad_enabled(not forward_only):
            return forward_backward(self.model, microbatches, loss_fn, vocab_size=self.net.spec.vocab_size,
                                    forward_only=forward_only, run_stage=self._run_stage)

    def _run_stage(self, stage: torch.nn.Module, microbatch: Microbatch, positions: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """The pipeline's plain positions and causal mask, or a packed microbatch's own."""
        own = getattr(microbatch.extra, "positions", None)
        if own is not None:
            positions, mask = own, microbatch.extra.mask
        return self.net.run_stage(stage, microbatch, positions, mask)

    def _reference_logprobs(self, microbatches: list[Microbatch]) -> dict[int, torch.Tensor]:
        """The KL reference's target logprobs per microbatch (on the last stage; empty elsewhere)."""
        params = self.net.params
        if self._reference is None:
            self._reference = {name: p.detach().clone() for name, p in params.items()}
        recorded: dict[int, torch.Tensor] = {}

        def record(logits: torch.Tensor, microbatch: Microbatch):
            piece = microbatch.extra.batch
            logits = tempered(logits[:, : piece.targets.shape[1]], piece.temperatures)
            recorded[microbatch.extra.index] = token_logprobs(logits, piece.targets)
            return torch.zeros(()), 0, {}

        # Swap the reference shards in for one forward-only pass, then the live ones back (the
        # same tensors: with the distributed optimizer they are views of DDP's buffer).
        live = {name: p.data for name, p in params.items()}
        try:
            for name, p in params.items():
                p.data = self._reference[name]
            self._pass(microbatches, record, forward_only=True)
        finally:
            for name, p in params.items():
                p.data = live[name]
        return recorded

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole HF-named tensors, gathered from every rank onto every rank (a collective)."""
        return self.net.hf_state_dict()

    def load_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Resume from whole HF-named weights: each rank keeps its shards. Fresh optimizer and
        KL reference, as in the torch backend."""
        self.net.load_hf_state_dict(weights)
        self.optimizer = self._new_optimizer(self.config.lr)
        self._policy_steps = 0
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

    def _layout(self) -> dict[str, int | bool]:
        net = self.net
        return {"tp_rank": net.rank, "tp": net.tp, "pp_rank": net.pp_rank, "pp": net.pp, "ep_rank": net.ep_rank,
                "ep": net.ep, "dp_rank": self.dp_rank, "dp": self.dp,
                "distributed_optimizer": self.distributed_optimizer}

    def training_state(self) -> dict[str, Any]:
        """This rank's own state, no collective: its optimizer's (its shards' moments; the
        distributed optimizer's shard of them), RNG state, KL reference shards and layout."""
        return {"optimizer": optimizer_state(self.optimizer), "torch_rng": torch.get_rng_state(),
                "reference": self._reference, "policy_steps": self._policy_steps, **self._layout()}

    def load_training_state(self, state: dict[str, Any]) -> None:
        """Restore this rank's ``training_state`` (same layout and optimizer) after
        ``load_state_dict``."""
        here = self._layout()
        for field in ("tp", "pp", "ep", "dp"):
            saved = (state.get(f"{field}_rank", 0), state.get(field, 1))
            if saved != (here[f"{field}_rank"], here[field]):
                raise UnsupportedMegatronModelError(
                    f"training state of {field.upper()} rank {saved[0]}/{saved[1]} loaded on "
                    f"{here[f'{field}_rank']}/{here[field]}", field=field, path=str(self.model_config.path))
        if state.get("distributed_optimizer", False) != self.distributed_optimizer:
            raise UnsupportedMegatronModelError("training state of the other optimizer (distributed or not)",
                                                field="distributed_optimizer", path=str(self.model_config.path))
        load_optimizer_state(self.optimizer, state["optimizer"])
        self._policy_steps = state.get("policy_steps", self.config.lr_warmup_steps)
        torch.set_rng_state(state["torch_rng"])
        reference = state.get("reference")  # sent over as CPU tensors (megatron_ranks)
        self._reference = None if reference is None else {name: t.to(self.device) for name, t in reference.items()}

    def device_memory(self, *, reset: bool = True) -> dict[str, Any]:
        """This rank's device and its peak allocated bytes since the last reset (None off CUDA),
        then (``reset``) a new peak window: what ``trainer.optimizer_offload`` saves is read here."""
        peak = peak_device_bytes(self.device)
        if reset and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return {"device": str(self.device), "peak_bytes": peak}


def _on(batch: PolicyBatch, device: torch.device) -> PolicyBatch:
    """``batch`` with every tensor on ``device``."""
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                         if getattr(batch, f.name) is not None})


def _blank_padded(batch: PolicyBatch, picked: list[int], size: int) -> PolicyBatch:
    """The ``picked`` samples of ``batch`` and blank ones after them up to ``size``: all zeros
    (token 0 is a valid id; mask 0: they train nothing and count nowhere)."""
    def rows(tensor: torch.Tensor) -> torch.Tensor:
        blank = tensor.new_zeros((size - len(picked), *tensor.shape[1:]))
        return torch.cat([tensor[picked], blank])

    return dataclasses.replace(batch, **{f.name: rows(getattr(batch, f.name)) for f in dataclasses.fields(batch)
                                         if getattr(batch, f.name) is not None})


def _packed_layout(packed: PackedBatch, picked: list[int], size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [size, length] and megatron's mask [size, 1, length, length] (True = masked) of
    the ``picked`` packed rows, blank rows after them: positions 0.., one segment of padding
    (as ``packing`` pads: never a target, and no query row is fully masked)."""
    def rows(tensor: torch.Tensor, fill: int) -> torch.Tensor:
        tensor = torch.cat([tensor[picked], tensor.new_full((size - len(picked), tensor.shape[1]), fill)])
        return F.pad(tensor, (0, length - tensor.shape[1]), value=fill)

    positions = rows(packed.positions, 0)
    segments = rows(packed.segments, -1)
    padding = segments == -1
    # Padding positions count on from 0 (any values do); real ones keep theirs.
    ramp = torch.arange(length).expand(size, length)
    positions = torch.where(padding, ramp, positions)
    return positions, ~block_causal_mask(segments)


def _merged_stats(result: PipelineStepResult, loss: LossName) -> dict[str, float]:
    """``policy_loss``'s stats of the whole batch from its microbatches': counts summed, token
    means weighted by trained tokens, GRPO's surrogate (a sample mean) by trained samples."""
    parts = result.microbatch_stats
    out = {}
    for key in parts[0]:
        if key in _COUNTED_STATS:
            out[key] = sum(part[key] for part in parts)
            continue
        weight = "samples_trained" if key == "surrogate" and loss == "grpo" else "trained_tokens"
        out[key] = sum(part[key] * part[weight] for part in parts) / max(sum(part[weight] for part in parts), 1.0)
    return out
