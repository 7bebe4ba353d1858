"""Which torch module a given HF config builds. Knows the model classes, not files.

Dense families (llama, qwen2) get ``CausalLM`` with SwiGLU MLPs; MoE families (qwen3_moe,
mixtral) get the same decoder with ``SparseMoeBlock`` on their sparse layers.
"""

from __future__ import annotations

from rollmesh.engine.models.hf_config import HFModelConfig
from rollmesh.engine.models.llama import CausalLM
from rollmesh.engine.models.moe import moe_feed_forward


def build_causal_lm(config: HFModelConfig) -> CausalLM:
    """Build an uninitialised-weights model; build under ``torch.device("meta")`` to skip init."""
    if config.moe is not None:
        return CausalLM(config, moe_feed_forward(config))
    return CausalLM(config)
