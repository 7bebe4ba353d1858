"""One forward+backward of a caller's loss over microbatches through megatron-core's own
schedules: ``forward_backward_no_pipelining`` at PP=1, the 1F1B
``forward_backward_pipelining_without_interleaving`` at PP>1 (``get_forward_backward_func``),
with megatron's DDP reducing the gradients (``finalize_model_grads``).

Knows megatron-core (parallel state, schedules, ``finalize_model_grads``) and torch.distributed;
nothing of models' weights, optimizers, Ray or NATS, and of the loss only its contract:
``loss_fn(logits, microbatch) -> (loss_sum, count, stats)``. The megatron backend runs every
forward and backward through here (PP=1 included); verified on CPU under gloo at TP, PP, DP and
EP layouts up to world 4 (``test_training_megatron_parallel``, ``..._moe``, ``..._backend``).

Loss normalisation: the step's loss is sum(loss_sum) / sum(count) over every microbatch of
every data-parallel rank. megatron's per-token path does exactly that
(``calculate_per_token_loss``, set by ``megatron_model.build_gpt_model``): each microbatch's
backward is of its unscaled ``loss_sum``, the reduce over DP ranks sums (not averages), and
``finalize_model_grads`` divides the gradients by the count summed over microbatches and DP
ranks. So a token mean ("ppo_clip": loss_sum = sum of masked per-token losses, count = trained
tokens) and a sample mean ("grpo": loss_sum = sum of per-sample means, count = samples with a
trained token) both equal their full-batch value. ``finalize_model_grads`` also sums the
sequence-parallel norms', routers' and QK norms' gradients over TP (each TP rank saw part of
their inputs) and the tied embedding's two copies' over the first and last stages; an expert's
gradient is reduced over the expert-data-parallel ranks (its EP rank already saw every EP
rank's tokens through the allgather dispatcher).

Between stages megatron sends [seq, micro_batch, hidden] activations (seq / TP under sequence
parallel) in ``pipeline_dtype``; all microbatches of one call share one [micro_batch, seq] shape
(pad them), so no shape exchange, and every DP rank runs as many microbatches of that shape
(expert layers all-gather tokens across EP ranks, which are DP ranks). Its default p2p
(``batch_isend_irecv``, then ``torch.cuda.synchronize``) runs under gloo as it is, given
``megatron_cpu_shims``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rollmesh.training.errors import PipelineLayoutError
from rollmesh.training.megatron_cpu_shims import megatron_cuda_on_cpu

LossFn = Callable[[torch.Tensor, "Microbatch"], tuple[torch.Tensor, torch.Tensor | int, dict[str, float]]]
# run_stage(stage, microbatch, positions, attention mask or None) -> the stage's output.
RunStage = Callable[[torch.nn.Module, "Microbatch", torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class Microbatch:
    """One microbatch: ``inputs`` [micro_batch, seq] token ids (every stage gets them: the first
    embeds them, the last hands ``extra`` to the loss), ``extra`` whatever the loss needs,
    ``routes`` the experts an MoE stage replays (``MegatronLlama.replay_targets``) or None."""

    inputs: torch.Tensor
    extra: Any = None
    routes: torch.Tensor | None = None


@dataclass(frozen=True)
class PipelineStepResult:
    """The same on every rank: the step's loss (module docstring), its count, and the stats the
    loss returned, one dict per microbatch of every DP rank (DP rank-major)."""

    loss: float
    count: float
    microbatch_stats: list[dict[str, float]] = field(default_factory=list)


def _plain_stage(stage: torch.nn.Module, microbatch: Microbatch, positions: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
    return stage(microbatch.inputs, positions, mask)


def forward_backward(model, microbatches: Sequence[Microbatch], loss_fn: LossFn, *, vocab_size: int,
                     forward_only: bool = False, run_stage: RunStage = _plain_stage) -> PipelineStepResult:
    """One forward (and, unless ``forward_only``, backward) of every microbatch of this DP rank
    through megatron's schedule for this PP size; the last stage calls ``loss_fn`` on the
    full-vocabulary logits [micro_batch, seq, vocab_size] (gathered over TP, padded rows cut
    off; differentiable). ``model``: this stage wrapped by ``megatron_optimizer
    .wrap_data_parallel`` (its gradients are reduced over DP and divided by the global count
    here, ready for the optimizer step); ``run_stage`` runs it on one microbatch (e.g. setting
    its routers first). Stats are broadcast from the last stage to every rank."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    if not microbatches:
        raise PipelineLayoutError("no microbatches", field="microbatches")
    shape = tuple(microbatches[0].inputs.shape)
    if any(tuple(mb.inputs.shape) != shape for mb in microbatches):
        raise PipelineLayoutError(f"microbatches of shapes {sorted({tuple(mb.inputs.shape) for mb in microbatches})}"
                                  " (pad them to one)", field="inputs")
    micro_batch_size, length = shape
    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    device = microbatches[0].inputs.device
    positions = torch.arange(length, device=device)[None].expand(micro_batch_size, length)
    # No mask: plain causal attention, which the stages' core attention
    # (megatron_attention.SdpaAttention) runs itself, without a [seq, seq] mask; a run_stage
    # that packs rows passes its own.
    causal = None

    def reduce(logits_shard: torch.Tensor, microbatch: Microbatch):
        logits = gather_from_tensor_model_parallel_region(logits_shard)[..., :vocab_size]
        loss_sum, count, stats = loss_fn(logits, microbatch)
        count = torch.as_tensor(count).detach().to(torch.int)  # megatron sums counts in an int tensor
        record = {"loss_sum": float(loss_sum.detach()), "count": float(count), "stats": stats}
        return loss_sum, count, record

    def forward_step(data_iterator, stage):
        microbatch = next(data_iterator)
        output = run_stage(stage, microbatch, positions, causal)
        return output, lambda out: reduce(out, microbatch)

    schedule = get_forward_backward_func()
    with megatron_cuda_on_cpu():
        records = schedule(forward_step_func=forward_step, data_iterator=iter(microbatches), model=[model],
                           num_microbatches=len(microbatches), seq_length=length,
                           micro_batch_size=micro_batch_size, forward_only=forward_only)
    return _share_records(records if parallel_state.is_pipeline_last_stage() else None)


def _share_records(records: list[dict] | None) -> PipelineStepResult:
    """Last stage: all DP ranks' records combined; then broadcast over the PP group."""
    from megatron.core import parallel_state

    result = [None]
    if records is not None:
        everyone: list[list[dict] | None] = [None] * parallel_state.get_data_parallel_world_size()
        dist.all_gather_object(everyone, records, group=parallel_state.get_data_parallel_group())
        flat = [record for rank_records in everyone for record in rank_records]
        loss_sum, count = sum(r["loss_sum"] for r in flat), sum(r["count"] for r in flat)
        result = [PipelineStepResult(loss=loss_sum / max(count, 1.0), count=count,
                                     microbatch_stats=[r["stats"] for r in flat])]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(result, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
    return result[0]
