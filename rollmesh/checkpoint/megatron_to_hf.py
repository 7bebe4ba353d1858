"""What every Megatron -> Hugging Face conversion shares, and the legacy-format converter.

Knows the architecture maps, the legacy reader and the HF writer. ``hf_config`` is the
``config.json`` carrying every hyperparameter that changes the numbers (norm epsilon, RoPE base,
GQA groups, experts, top-k); ``check_tensors_fit`` refuses a checkpoint whose tensors are not
those of the architecture, by name and shape. ``convert_legacy_to_hf`` loads and merges every
rank file, since the legacy format has no index to read parts by; torch_dist checkpoints go
through the planned, bounded converter (``convert_executor``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from rollmesh.checkpoint.arch_maps import ArchMap, ArchSpec, build_arch_map, megatron_shapes
from rollmesh.checkpoint.errors import CheckpointReadError
from rollmesh.checkpoint.hf_writer import write_hf_checkpoint

_HF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                     "mixtral": ("MixtralForCausalLM", "mixtral"), "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe")}


def hf_config(spec: ArchSpec, *, norm_epsilon: float, rope_theta: float, max_position_embeddings: int,
              dtype: torch.dtype, moe_top_k: int = 0) -> dict[str, Any]:
    architecture, model_type = _HF_ARCHITECTURES[spec.family]
    config: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type, "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_query_groups, "head_dim": spec.head_dim,
        "intermediate_size": spec.ffn_hidden_size, "vocab_size": spec.vocab_size, "rms_norm_eps": norm_epsilon,
        "rope_theta": rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu", "dtype": str(dtype).removeprefix("torch."),
    }
    # Megatron's router (softmax score, top-k then softmax over the k, the default without
    # pre-softmax) gives each token its k experts' softmax probabilities renormalised to sum to 1:
    # Mixtral's routing, and Qwen3-MoE's with norm_topk_prob. (describe_model refuses the others.)
    if spec.family == "mixtral":  # Mixtral's experts are sized by intermediate_size
        config.update(num_local_experts=spec.num_experts, num_experts_per_tok=moe_top_k,
                      intermediate_size=spec.expert_ffn)
    if spec.family == "qwen3_moe":  # every layer sparse; its q/k norms share rms_norm_eps
        config.update(num_experts=spec.num_experts, num_experts_per_tok=moe_top_k,
                      moe_intermediate_size=spec.expert_ffn, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=True, attention_bias=False)
    return config


def convert_legacy_to_hf(src: str | Path, dst: str | Path, spec: ArchSpec, *, config: dict[str, Any],
                         max_shard_bytes: int, dtype: torch.dtype | None = None,
                         progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Megatron-LM's legacy per-rank files (``legacy_reader``) -> the HF directory ``dst``: every
    rank's file is loaded (the format has no index to read parts by), merged, then mapped.
    ``progress(done_bytes, total_bytes)`` follows the mapped Megatron tensors."""
    from rollmesh.checkpoint.legacy_reader import LegacyCheckpoint

    megatron = LegacyCheckpoint(src).global_state()
    arch = build_arch_map(spec)
    check_tensors_fit(arch, {name: tuple(tensor.shape) for name, tensor in megatron.items()}, src)
    total, done = sum(t.numel() * t.element_size() for t in megatron.values()), 0
    state: dict[str, torch.Tensor] = {}
    for name in arch.megatron_names():
        tensor = megatron.pop(name)
        done += tensor.numel() * tensor.element_size()
        for hf_name, hf_tensor in arch.to_hf(name, tensor).items():
            state[hf_name] = hf_tensor.to(dtype) if dtype is not None else hf_tensor
        if progress is not None:
            progress(done, total)
    return write_hf_checkpoint(state, Path(dst), max_shard_bytes=max_shard_bytes, config=config)


def check_tensors_fit(arch: ArchMap, shapes: Mapping[str, tuple[int, ...]], src: str | Path) -> None:
    """Raise unless the checkpoint holds exactly the Megatron tensors of ``arch``, each of the
    shape the saved arguments give it (``shapes``: canonical name -> global shape). A shape that
    differs means an argument saved wrong, or unset and derived otherwise than the model was
    built (``kv_channels``, ``ffn_hidden_size``...): refused here rather than met as a reshape
    error halfway through the conversion, or as a config.json transformers cannot load."""
    names = set(arch.megatron_names())
    missing, unknown = sorted(names - set(shapes)), sorted(set(shapes) - names)
    if missing or unknown:
        raise CheckpointReadError(f"the checkpoint does not fit a {arch.spec.family} model: missing {missing[:5]}, "
                                  f"unexpected {unknown[:5]}", path=str(src))
    expected = megatron_shapes(arch.spec)
    wrong = [f"{name} is {list(shapes[name])}, not {list(expected[name])}" for name in arch.megatron_names()
             if tuple(shapes[name]) != expected[name]]
    if wrong:
        raise CheckpointReadError(f"tensor shapes differ from those the saved arguments give a {arch.spec.family} "
                                  f"model: {'; '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}", path=str(src))
