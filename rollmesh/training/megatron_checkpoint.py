"""Megatron ``torch_dist`` checkpoints written from a Hugging Face-named state dict, so the
resharder (``ResharderLogic``, format ``"megatron_torch_dist"``) converts what the torch
trainer saves, and a Megatron-LM run could start from it.

Knows the checkpoint package's architecture maps (``arch_maps``: HF names -> canonical per-layer,
per-expert Megatron tensors), Megatron-LM's argument names and save-root layout, and
torch.distributed.checkpoint; nothing of models, optimizers, Ray or NATS.

What is written is what megatron-core (0.16, local layer spec, one rank) and Megatron-LM write;
megatron-core's own ``dist_checkpointing.load`` (default strictness) loads it into a local-spec
``GPTModel`` whose logits match the HF model's (checked by hand: a test would need a ~30 s
process group; the tests compare the stored keys with the names megatron-core writes):

    OUT/latest_checkpointed_iteration.txt     "<iteration>", written last
    OUT/iter_NNNNNNN/.metadata, __0_0.distcp  DCP (``dcp.save(no_dist=True)``), keys below
    OUT/iter_NNNNNNN/common.pt                {"args": Namespace, "checkpoint_version", "iteration"}
    OUT/iter_NNNNNNN/metadata.json            megatron-core's backend record (torch_dist, torch)

Keys: per-layer parameters stacked on a leading layer axis (``decoder.layers.<param>``
[layers, ...]); the layer norms under megatron-core's fused names (``input_layernorm`` as
``self_attention.linear_qkv.layer_norm_weight``, ``pre_mlp_layernorm`` as
``mlp.linear_fc1.layer_norm_weight``: megatron-core's local spec maps them so for checkpoint
compatibility with the TE spec); MoE experts grouped as ``decoder.layers.mlp.experts.experts.
linear_fc{1,2}.weight`` [layers, experts, ...]; vocabulary tables padded with zero rows to
Megatron-LM's ``padded_vocab_size`` (a multiple of ``make_vocab_size_divisible_by``, 128).
The local spec's linear layers' ``_extra_state`` objects are written as megatron-core writes
them (``<layer param>._extra_state/shard_<offsets>_<shape>``, a ``torch.save``d ``[None]``):
they carry nothing, but megatron-core's default (strict) load fails on a missing key. Not
written: optimizer and RNG state (the trainer keeps its own; see ``TorchTrainerBackend``).

Only HF models the maps express exactly are accepted, so that ``export_to_hf`` gives back the
same tensors and the same ``config.json`` hyperparameters (``UnmappableModelError`` otherwise).
Memory: one stacked copy of the weights is built (a parameter at a time from the caller's
state dict), besides the caller's own.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from rollmesh.checkpoint.arch_maps import ArchSpec, build_arch_map, expert_index
from rollmesh.checkpoint.atomic_dir import staged_directory, write_file_atomically
from rollmesh.checkpoint.errors import CheckpointWriteError
from rollmesh.checkpoint.megatron_args import COMMON_FILE, LATEST_FILE, ModelDescription
from rollmesh.engine.models.hf_config import HFModelConfig, parse_hf_config
from rollmesh.training.errors import ConflictingArgsError, StateDictMismatchError, UnmappableModelError

FORMAT = "megatron_torch_dist"
# Megatron-LM's checkpoint_version for the current layouts (QKV interleaved per query group).
CHECKPOINT_VERSION = 3.0
# megatron-core's metadata.json: which backends wrote the sharded and the common parts.
MCORE_METADATA_FILE = "metadata.json"
MCORE_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                  "common_backend": "torch", "common_backend_version": 1}
# Megatron-LM's default --make-vocab-size-divisible-by (times the TP degree, 1 here).
VOCAB_DIVISIBLE_BY = 128

# Canonical (local spec) per-layer names -> the names megatron-core stores them under.
_STORED_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                 "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def describe_hf_model(model: HFModelConfig | Mapping[str, Any] | ModelDescription, *,
                      dtype: torch.dtype = torch.float32, path: str = "") -> ModelDescription:
    """The ``ModelDescription`` (``ArchSpec`` plus hyperparameters) of an HF model: the
    engine's ``HFModelConfig``, a ``config.json`` dict, or a description (returned as it is)."""
    if isinstance(model, ModelDescription):
        return model
    config = model if isinstance(model, HFModelConfig) else parse_hf_config(dict(model), path=path or None)
    _check_mappable(config, path)
    moe = config.moe
    vocab = config.vocab_size
    spec = ArchSpec(
        family=config.model_type,  # type: ignore[arg-type]  # parse_hf_config admits only FAMILIES
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads, num_query_groups=config.num_key_value_heads,
        head_dim=config.head_dim, ffn_hidden_size=config.intermediate_size, vocab_size=vocab,
        padded_vocab_size=-(-vocab // VOCAB_DIVISIBLE_BY) * VOCAB_DIVISIBLE_BY,
        tie_embeddings=config.tie_word_embeddings,
        num_experts=moe.num_experts if moe else 0,
        moe_ffn_hidden_size=moe.moe_intermediate_size if moe else 0)
    return ModelDescription(spec=spec, norm_epsilon=config.rms_norm_eps, rope_theta=config.rope_theta,
                            max_position_embeddings=config.max_position_embeddings,
                            moe_top_k=moe.num_experts_per_tok if moe else 0, dtype=dtype)


def _check_mappable(config: HFModelConfig, path: str) -> None:
    def refuse(field: str, reason: str) -> UnmappableModelError:
        return UnmappableModelError(reason, model_type=config.model_type, field=field, path=path)

    # The maps carry only Qwen2's QKV bias: no o_proj or MLP bias tensors exist on either side.
    if config.o_proj_bias or (config.qkv_bias and config.model_type != "qwen2"):
        raise refuse("attention_bias", "attention biases have no Megatron tensor in the maps")
    if config.mlp_bias:
        raise refuse("mlp_bias", "MLP biases have no Megatron tensor in the maps")
    if config.sliding_window is not None:
        raise refuse("sliding_window", "the exported config.json would lose the attention window")
    moe = config.moe
    if moe is None:
        return
    if moe.sparse_layers != tuple(range(config.num_hidden_layers)):
        # describe_model refuses a moe_layer_freq with dense layers; the maps have no dense MLP there.
        raise refuse("mlp_only_layers", f"sparse layers {list(moe.sparse_layers)} are not every layer")
    if not moe.norm_topk_prob:
        # Megatron's softmax router without pre-softmax renormalises the top k; the export says so.
        raise refuse("norm_topk_prob", "Megatron's router renormalises the top-k probabilities")


def megatron_args(model: ModelDescription, *, extra_args: Mapping[str, Any] | None = None,
                  path: str = "") -> argparse.Namespace:
    """Megatron-LM's ``args`` for the model (what ``describe_model`` reads back), plus
    ``extra_args`` (run settings: lr, seed...), which may not contradict the architecture."""
    spec = model.spec
    moe = spec.num_experts > 0
    values: dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        group_query_attention=spec.num_query_groups != spec.num_heads, num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim, ffn_hidden_size=spec.ffn_hidden_size, vocab_size=spec.vocab_size,
        padded_vocab_size=spec.padded_vocab_size, make_vocab_size_divisible_by=VOCAB_DIVISIBLE_BY,
        untie_embeddings_and_output_weights=not spec.tie_embeddings, normalization="RMSNorm",
        norm_epsilon=model.norm_epsilon, position_embedding_type="rope", rotary_base=model.rope_theta,
        rotary_percent=1.0, swiglu=True, add_bias_linear=False, add_qkv_bias=spec.family == "qwen2",
        qk_layernorm=spec.family == "qwen3_moe", max_position_embeddings=model.max_position_embeddings,
        params_dtype=model.dtype, bf16=model.dtype == torch.bfloat16, fp16=model.dtype == torch.float16,
        num_experts=spec.num_experts if moe else None,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        ckpt_format="torch_dist")
    if moe:
        # The router HF's Mixtral and Qwen3-MoE (norm_topk_prob) compute: softmax over the top-k
        # logits, every layer sparse, no shared experts or expert bias.
        values.update(moe_router_topk=model.moe_top_k, moe_ffn_hidden_size=spec.expert_ffn,
                      moe_router_pre_softmax=False, moe_router_score_function="softmax", moe_layer_freq=1,
                      moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False,
                      moe_shared_expert_intermediate_size=None, moe_router_num_groups=None)
    extra = dict(extra_args or {})
    conflicts = sorted(name for name, value in extra.items() if name in values and values[name] != value)
    if conflicts:
        raise ConflictingArgsError(names=conflicts, path=path)
    return argparse.Namespace(**{**extra, **values})


def stored_slot(megatron_name: str) -> tuple[str, tuple[int, ...]]:
    """Where a canonical Megatron tensor goes: (the stored key, its index on the stored key's
    leading axes). ``decoder.layers.3.mlp.linear_fc2.weight`` -> (``decoder.layers.mlp.
    linear_fc2.weight``, (3,)); expert 5 of layer 3's fc1 -> (``decoder.layers.mlp.experts.
    experts.linear_fc1.weight``, (3, 5)); a tensor outside the layers -> (its name, ())."""
    grouped = expert_index(megatron_name)
    name, experts = (grouped[0], (grouped[1],)) if grouped is not None else (megatron_name, ())
    match = _PER_LAYER.match(name)
    if match is None:
        return name, experts
    param = _STORED_NAMES.get(match.group(2), match.group(2))
    return f"decoder.layers.{param}", (int(match.group(1)), *experts)


def megatron_state_dict(hf_state_dict: Mapping[str, torch.Tensor], spec: ArchSpec, *,
                        path: str = "") -> dict[str, torch.Tensor]:
    """The stored Megatron tensors of an HF state dict (names as ``stored_slot`` gives them).
    Each canonical tensor is made and copied into its stacked slot in turn, so at most one is
    alive besides the stacked result. A tied model's ``lm_head.weight`` (the embedding) is
    ignored; any other tensor the maps do not consume is refused."""
    arch = build_arch_map(spec)
    needed = set(arch.hf_names())
    ignored = {"lm_head.weight"} if spec.tie_embeddings else set()
    missing, unexpected = sorted(needed - hf_state_dict.keys()), sorted(hf_state_dict.keys() - needed - ignored)
    if missing or unexpected:
        raise StateDictMismatchError(missing=missing, unexpected=unexpected, path=path)
    out: dict[str, torch.Tensor] = {}
    for rule in arch.rules:
        tensor = rule.inverse([hf_state_dict[name].detach().cpu() for name in rule.hf_names])
        stored, index = stored_slot(rule.megatron_name)
        if not index:
            out[stored] = tensor.contiguous()
            continue
        if stored not in out:
            lead = (spec.num_layers, spec.num_experts)[: len(index)]
            out[stored] = torch.empty(*lead, *tensor.shape, dtype=tensor.dtype)
        out[stored][index] = tensor
    return out


def extra_state_objects(spec: ArchSpec) -> dict[str, io.BytesIO]:
    """The empty ``_extra_state`` records megatron-core's local-spec linears save: one per
    layer (and per expert), keyed by the ShardedObject's unique key (offsets ``_`` shape)."""
    layers, experts = spec.num_layers, spec.num_experts
    linears = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    if not experts:
        linears += ["mlp.linear_fc1", "mlp.linear_fc2"]
    keys = [f"decoder.layers.{linear}._extra_state/shard_{layer}_{layers}"
            for layer in range(layers) for linear in linears]
    keys += [f"decoder.layers.mlp.experts.experts.{fc}._extra_state/shard_{layer}.{expert}_{layers}.{experts}"
             for layer in range(layers) for expert in range(experts) for fc in ("linear_fc1", "linear_fc2")]
    objects = {}
    for key in keys:
        record = io.BytesIO()
        torch.save([None], record)  # megatron-core saves [each shard's data]; a local linear's is None
        record.seek(0)
        objects[key] = record
    return objects


class _PackedObjectsPlanner(DefaultSavePlanner):
    """DCP's planner as megatron-core's ``MCoreSavePlanner`` configures it: keys not flattened
    (no ``planner_data`` in ``.metadata``) and byte records written as they are. The default
    ``torch.save``s a BytesIO again, a record megatron-core's loader cannot unpack."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def transform_object(self, write_item: Any, object: Any) -> Any:  # noqa: A002 - DCP's name
        return object


def iteration_dir(out_dir: str | Path, iteration: int) -> Path:
    return Path(out_dir) / f"iter_{iteration:07d}"


def save_megatron_checkpoint(
    hf_state_dict: Mapping[str, torch.Tensor],
    spec_or_hf_config: HFModelConfig | Mapping[str, Any] | ModelDescription,
    out_dir: str | Path,
    *,
    iteration: int,
    extra_args: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``hf_state_dict`` (HF names) as Megatron-LM's save root ``out_dir``: the iteration
    folder ``iter_NNNNNNN`` (published atomically, replacing one of the same iteration), then
    ``latest_checkpointed_iteration.txt``. Returns the iteration folder (the path to put in
    ``CheckpointSaved``: the tracker file moves on with later saves, the folder does not)."""
    if iteration < 0:
        raise ValueError(f"iteration {iteration} is negative")
    out_dir = Path(out_dir)
    final = iteration_dir(out_dir, iteration)
    # params_dtype: the weights' own (the trainer's float32, unless it trains in another).
    dtype = next(iter(hf_state_dict.values())).dtype
    model = describe_hf_model(spec_or_hf_config, dtype=dtype, path=str(final))
    args = megatron_args(model, extra_args=extra_args, path=str(final))
    tensors = megatron_state_dict(hf_state_dict, model.spec, path=str(final))
    with staged_directory(final) as staging:
        try:
            with warnings.catch_warnings():  # "assuming ... a single process": as intended
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save({**tensors, **extra_state_objects(model.spec)}, checkpoint_id=str(staging),
                         planner=_PackedObjectsPlanner(), no_dist=True)
        except (RuntimeError, ValueError) as exc:  # DCP wraps a writer's OSError in its own
            raise CheckpointWriteError(f"torch.distributed.checkpoint.save failed: {exc}", path=str(final)) from exc
        torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration},
                   staging / COMMON_FILE)
        # Last, as megatron-core does: its loader takes a folder with metadata.json as complete.
        (staging / MCORE_METADATA_FILE).write_text(json.dumps(MCORE_METADATA))
    write_file_atomically(out_dir / LATEST_FILE, str(iteration).encode())
    return final
