"""rollmesh.engine.models: Hugging Face-compatible model families as plain torch modules.

Llama/Qwen2 dense decoders and Qwen3-MoE/Mixtral sparse ones, built from an HF ``config.json``
and loaded from HF safetensors (sharded or single-file). No Ray, NATS or transformers here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollmesh.moved_names import lazy_exports

# Imported from their modules on first use (as rollmesh.engine's names are, and for the same
# reason): reading a config.json (``read_hf_config``) must not import torch.
if TYPE_CHECKING:
    from rollmesh.engine.models.errors import (
        CheckpointKeysError,
        ModelConfigError,
        UnsupportedModelTypeError,
    )
    from rollmesh.engine.models.families import build_causal_lm
    from rollmesh.engine.models.hf_config import HFModelConfig, MoEConfig, parse_hf_config, read_hf_config
    from rollmesh.engine.models.llama import CausalLM
    from rollmesh.engine.models.loading import (
        load_hf_model,
        load_state_dict_strict,
        read_safetensors,
        split_fused_experts,
    )
    from rollmesh.engine.models.moe import SparseMoeBlock, route_top_k

_PUBLIC_MODULES = {
    "CausalLM": "rollmesh.engine.models.llama",
    "CheckpointKeysError": "rollmesh.engine.models.errors",
    "HFModelConfig": "rollmesh.engine.models.hf_config",
    "MoEConfig": "rollmesh.engine.models.hf_config",
    "ModelConfigError": "rollmesh.engine.models.errors",
    "SparseMoeBlock": "rollmesh.engine.models.moe",
    "UnsupportedModelTypeError": "rollmesh.engine.models.errors",
    "build_causal_lm": "rollmesh.engine.models.families",
    "load_hf_model": "rollmesh.engine.models.loading",
    "load_state_dict_strict": "rollmesh.engine.models.loading",
    "parse_hf_config": "rollmesh.engine.models.hf_config",
    "read_hf_config": "rollmesh.engine.models.hf_config",
    "read_safetensors": "rollmesh.engine.models.loading",
    "route_top_k": "rollmesh.engine.models.moe",
    "split_fused_experts": "rollmesh.engine.models.loading",
}

__all__ = [
    "CausalLM",
    "CheckpointKeysError",
    "HFModelConfig",
    "ModelConfigError",
    "MoEConfig",
    "SparseMoeBlock",
    "UnsupportedModelTypeError",
    "build_causal_lm",
    "load_hf_model",
    "load_state_dict_strict",
    "parse_hf_config",
    "read_hf_config",
    "read_safetensors",
    "route_top_k",
    "split_fused_experts",
]


__getattr__ = lazy_exports(__name__, _PUBLIC_MODULES, cache=globals())


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
