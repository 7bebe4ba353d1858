"""rollmesh.engine.models: Hugging Face-compatible model families as plain torch modules.

Llama/Qwen2 dense decoders and Qwen3-MoE/Mixtral sparse ones, built from an HF ``config.json``
and loaded from HF safetensors (sharded or single-file). No Ray, NATS or transformers here.
"""

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
