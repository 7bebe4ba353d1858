"""Pipeline stages of the megatron-core GPTModel, and one forward+backward of a caller's loss
through megatron's own schedules: ``forward_backward_no_pipelining`` at PP=1, the 1F1B
``forward_backward_pipelining_without_interleaving`` at PP>1 (``get_forward_backward_func``).

Knows megatron-core (parallel state, GPTModel, schedules, ``finalize_model_grads``), the
checkpoint package's maps and torch.distributed; nothing of optimizers, Ray or NATS, and of the
loss only its contract: ``loss_fn(logits, microbatch) -> (loss_sum, count, stats)``.

Loss normalisation: the step's loss is sum(loss_sum) / sum(count) over every microbatch of
every data-parallel rank. megatron's per-token path does exactly that
(``calculate_per_token_loss``): each microbatch's backward is of its unscaled ``loss_sum``, the
reduce over DP ranks sums (not averages), and ``finalize_model_grads`` divides the gradients by
the count summed over microbatches and DP ranks. So a token mean ("ppo_clip": loss_sum = sum of
masked per-token losses, count = trained tokens) and a sample mean ("grpo": loss_sum = sum of
per-sample means, count = samples with a trained token) both equal their full-batch value.

Between stages megatron sends [seq, micro_batch, hidden] activations in ``pipeline_dtype``; all
microbatches of one call share one [micro_batch, seq] shape (pad them), so no shape exchange.
Its default p2p (``batch_isend_irecv``, then ``torch.cuda.synchronize``) runs under gloo as it
is, given ``megatron_cpu_shims.install_cpu_shims`` (receive buffers on
``torch.cuda.current_device()``, the synchronize); the schedules' token counter needs
``megatron_optimizer.megatron_cuda_on_cpu``, entered around them (a torch function mode: a
Python call per op, fine for CPU tests, never entered with CUDA).
Tied embeddings across stages: the last stage holds a copy of the word embeddings as its output
layer; ``finalize_model_grads`` all-reduces the two copies' gradients over the embedding group
and the optimizer steps both alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rollmesh.checkpoint.arch_maps import ArchSpec, canonical_megatron_name
from rollmesh.checkpoint.chunk_geometry import Box
from rollmesh.checkpoint.tp_reshard import rank_boxes
from rollmesh.engine.models.hf_config import HFModelConfig
from rollmesh.training.megatron_optimizer import megatron_cuda_on_cpu

LossFn = Callable[[torch.Tensor, "Microbatch"], tuple[torch.Tensor, torch.Tensor | int, dict[str, float]]]


class PipelineLayoutError(ValueError):
    """A model or batch the pipeline cannot split: ``field`` names what is in the way."""

    def __init__(self, reason: str, *, field: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass(frozen=True)
class Microbatch:
    """One microbatch: ``inputs`` [micro_batch, seq] token ids (every stage gets them: the first
    embeds them, the last hands ``extra`` to the loss), ``extra`` whatever the loss needs."""

    inputs: torch.Tensor
    extra: Any = None


@dataclass(frozen=True)
class PipelineStepResult:
    """The same on every rank: the step's loss (module docstring), its count, and the stats the
    loss returned, one dict per microbatch of every DP rank (DP rank-major)."""

    loss: float
    count: float
    microbatch_stats: list[dict[str, float]] = field(default_factory=list)


def stage_layout() -> tuple[bool, bool]:
    """(pre_process, post_process) of this rank's pipeline stage."""
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()


def build_stage_model(config: HFModelConfig, spec: ArchSpec):
    """This rank's stage of a float32, CPU-initialised local-spec GPTModel shaped like
    ``config`` (random weights), TP and PP sizes from ``parallel_state``: layers split evenly,
    embeddings on the first stage, final norm and output layer on the last. Configured for
    ``forward_backward`` (per-token loss, float32 activations between stages)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if spec.num_layers % pp:
        raise PipelineLayoutError(f"{spec.num_layers} layers do not split evenly over {pp} stages",
                                  field="num_hidden_layers")
    transformer = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0,  # as megatron_model.build_gpt_model: no CPU RNG
        params_dtype=torch.float32, use_cpu_initialization=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        calculate_per_token_loss=True)  # module docstring: the loss's normaliser is summed
    pre_process, post_process = stage_layout()
    # A tied model's last stage copies the first stage's embedding over the embedding group at
    # construction (megatron moves it with .cuda() first: megatron_cuda_on_cpu).
    with megatron_cuda_on_cpu():
        return GPTModel(config=transformer, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                        vocab_size=spec.padded_vocab_size, max_sequence_length=config.max_position_embeddings,
                        position_embedding_type="rope", rotary_base=config.rope_theta,
                        share_embeddings_and_output_weights=spec.tie_embeddings,
                        pre_process=pre_process, post_process=post_process)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):  # DistributedDataParallel / Float16Module wrappers
        model = model.module
    return model


def stage_parameter_names(model: torch.nn.Module, spec: ArchSpec) -> dict[str, torch.nn.Parameter]:
    """{canonical whole-model Megatron name (``megatron_shapes``'s keys): parameter} of this
    stage: local layer i is global layer ``layer_number - 1``; a tied model's last-stage output
    layer is the copy of ``embedding.word_embeddings.weight``."""
    gpt = _unwrap(model)
    layer_numbers = [layer.layer_number for layer in gpt.decoder.layers]
    out: dict[str, torch.nn.Parameter] = {}
    for name, param in gpt.named_parameters():
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{layer_numbers[int(local)] - 1}.{rest}"
        elif name == "output_layer.weight" and spec.tie_embeddings:
            name = "embedding.word_embeddings.weight"
        out[canonical_megatron_name(name)] = param
    return out


def _region(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    return tensor[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]


def load_stage_weights(model: torch.nn.Module, spec: ArchSpec, canonical: dict[str, torch.Tensor]) -> None:
    """Copy whole canonical Megatron tensors (``ArchMap.to_megatron`` of HF weights) into this
    stage's parameters, this TP rank's box of each, in place."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in stage_parameter_names(model, spec).items():
            whole = canonical[name]
            boxes = rank_boxes(name, Box((0,) * whole.dim(), tuple(whole.shape)), rank, tp)
            # Several boxes (SwiGLU fc1: rank r's gate rows, then its up rows) stack on dim 0.
            param.copy_(torch.cat([_region(whole, box) for box in boxes]).reshape(param.shape))


def gather_stage_weights(model: torch.nn.Module, spec: ArchSpec,
                         shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """This stage's parameters as whole canonical tensors, gathered over TP (a collective of the
    TP group; every TP rank gets them)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, param in stage_parameter_names(model, spec).items():
        shard = param.detach()
        whole_box = Box((0,) * len(shapes[name]), shapes[name])
        if rank_boxes(name, whole_box, 0, tp) == [whole_box]:
            out[name] = shard.clone()  # replicated over TP
            continue
        shards = [torch.empty_like(shard) for _ in range(tp)]
        dist.all_gather(shards, shard.contiguous(), group=group)
        whole = torch.empty(shapes[name], dtype=shard.dtype)
        for rank, piece in enumerate(shards):
            offset = 0
            for box in rank_boxes(name, whole_box, rank, tp):
                _region(whole, box).copy_(piece.narrow(0, offset, box.sizes[0]))
                offset += box.sizes[0]
        out[name] = whole
    return out


def forward_backward(model, microbatches: Sequence[Microbatch], loss_fn: LossFn, *, vocab_size: int,
                     forward_only: bool = False) -> PipelineStepResult:
    """One forward (and, unless ``forward_only``, backward) of every microbatch of this DP rank
    through megatron's schedule for this PP size; the last stage calls ``loss_fn`` on the
    full-vocabulary logits [micro_batch, seq, vocab_size] (gathered over TP, padded rows cut
    off; differentiable). ``model``: this stage wrapped by ``megatron_optimizer
    .wrap_data_parallel`` (its gradients are reduced over DP and divided by the global count
    here, ready for the optimizer step). Stats are broadcast from the last stage to every rank."""
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
    # True = masked. Passed explicitly: megatron's default causal mask is built on "cuda".
    causal = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool, device=device), diagonal=1)

    def reduce(logits_shard: torch.Tensor, microbatch: Microbatch):
        logits = gather_from_tensor_model_parallel_region(logits_shard)[..., :vocab_size]
        loss_sum, count, stats = loss_fn(logits, microbatch)
        count = torch.as_tensor(count).detach().to(torch.int)  # megatron sums counts in an int tensor
        record = {"loss_sum": float(loss_sum.detach()), "count": float(count), "stats": stats}
        return loss_sum, count, record

    def forward_step(data_iterator, stage):
        microbatch = next(data_iterator)
        output = stage(microbatch.inputs, positions, causal)
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
