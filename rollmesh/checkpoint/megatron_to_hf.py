"""Megatron-core ``torch_dist`` checkpoint -> Hugging Face directory, through an architecture map.

Knows the torch_dist reader, the architecture maps and the HF writer. Each Megatron tensor (or
each layer of a layer-stacked one) is read by byte range, mapped to its HF tensors and written as
safetensors shards with ``model.safetensors.index.json`` and a ``config.json`` carrying every
hyperparameter that changes the numbers (norm epsilon, RoPE base, GQA groups, experts, top-k).
This first converter holds the HF tensors of the whole model before writing (fine for the small
models it is tested on); the bounded, planned, parallel executor replaces that loop.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rollmesh.checkpoint.arch_maps import ArchSpec, build_arch_map
from rollmesh.checkpoint.errors import CheckpointReadError
from rollmesh.checkpoint.hf_writer import write_hf_checkpoint
from rollmesh.checkpoint.torch_dist_reader import TorchDistCheckpoint, layer_sources

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
    if spec.family == "mixtral":
        config.update(num_local_experts=spec.num_experts, num_experts_per_tok=moe_top_k)
    if spec.family == "qwen3_moe":
        config.update(num_experts=spec.num_experts, num_experts_per_tok=moe_top_k,
                      moe_intermediate_size=spec.expert_ffn, decoder_sparse_step=1, norm_topk_prob=True)
    return config


def convert_torch_dist_to_hf(src: str | Path, dst: str | Path, spec: ArchSpec, *, config: dict[str, Any],
                             max_shard_bytes: int, dtype: torch.dtype | None = None,
                             progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Write the HF directory ``dst``; returns its file names. Weights keep the checkpoint's
    dtype unless ``dtype`` says otherwise. ``progress(done, total)`` follows the Megatron tensors."""
    checkpoint = TorchDistCheckpoint(src)
    checkpoint.check()
    sources = layer_sources(checkpoint)

    return _write_hf(src, dst, spec, set(sources), lambda name: checkpoint.read_source(sources[name]), config=config, max_shard_bytes=max_shard_bytes,
                     dtype=dtype, progress=progress)


def convert_legacy_to_hf(src: str | Path, dst: str | Path, spec: ArchSpec, *, config: dict[str, Any],
                         max_shard_bytes: int, dtype: torch.dtype | None = None,
                         progress: Callable[[int, int], None] | None = None) -> list[str]:
    """The same for Megatron-LM's legacy per-rank files (``legacy_reader``): every rank's file
    is loaded (the format has no index to read parts by), merged, then mapped."""
    from rollmesh.checkpoint.legacy_reader import LegacyCheckpoint

    megatron = LegacyCheckpoint(src).global_state()
    return _write_hf(src, dst, spec, set(megatron), megatron.pop, config=config, max_shard_bytes=max_shard_bytes,
                     dtype=dtype, progress=progress)


def _write_hf(src: str | Path, dst: str | Path, spec: ArchSpec, available: set[str],
              read: Callable[[str], torch.Tensor], *, config: dict[str, Any], max_shard_bytes: int,
              dtype: torch.dtype | None, progress: Callable[[int, int], None] | None) -> list[str]:
    """Check the checkpoint's tensors fit ``spec``, map each one ``read`` gives, write ``dst``."""
    arch = build_arch_map(spec)
    names = arch.megatron_names()
    missing = sorted(set(names) - available)
    unknown = sorted(available - set(names))
    if missing or unknown:
        raise CheckpointReadError(f"the checkpoint does not fit a {spec.family} model: missing {missing[:5]}, "
                                  f"unexpected {unknown[:5]}", path=str(src))
    state: dict[str, torch.Tensor] = {}
    for done, name in enumerate(names, start=1):
        for hf_name, hf_tensor in arch.to_hf(name, read(name)).items():
            state[hf_name] = hf_tensor.to(dtype) if dtype is not None else hf_tensor
        if progress is not None:
            progress(done, len(names))
    return write_hf_checkpoint(state, Path(dst), max_shard_bytes=max_shard_bytes, config=config)
