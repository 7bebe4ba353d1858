"""Sparse mixture-of-experts feed-forward (Qwen3-MoE and Mixtral) with a top-k router.

Router: softmax over all experts in float32, take the top k, optionally renormalise the k
weights (Qwen3-MoE's ``norm_topk_prob``; Mixtral always does, which is the softmax over the k
selected logits). The block returns its output and the routed expert ids per token so callers
can report them. Routing replay (training): given recorded expert ids, the block uses them instead
of its own top k, but the weights still come from its own router probabilities gathered at those
ids, normalised as above, so the router keeps its gradient. Parameter names are the per-expert
safetensors names (``mlp.experts.E.gate_proj`` / Mixtral's ``block_sparse_moe.experts.E.w1``);
transformers 5.x fuses experts in memory but writes this layout to disk (see ``loading.py``).
Knows ``HFModelConfig``; does not know files or the attention side of the layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollmesh.engine.models.hf_config import HFModelConfig
from rollmesh.engine.models.llama import FeedForwardFactory, FeedForwardOutput, GatedMLP


class MixtralExpert(nn.Module):
    """Mixtral's expert naming: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def route_top_k(
    router_logits: torch.Tensor, top_k: int, *, normalize: bool, replay: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights and ids [tokens, top_k] from router logits [tokens, experts].

    ``replay`` [tokens, top_k] (any integer dtype): use these expert ids instead of the top k;
    the weights are still this router's probabilities at those ids, differentiable.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    if replay is None:
        weights, ids = torch.topk(probs, top_k, dim=-1)
    else:
        if replay.shape != (router_logits.shape[0], top_k):
            # A [tokens, k'] of the wrong width would gather k' experts without complaint.
            raise ValueError(f"replayed expert ids {tuple(replay.shape)}, expected "
                             f"({router_logits.shape[0]}, {top_k})")
        ids = replay.to(device=probs.device, dtype=torch.long)
        weights = probs.gather(-1, ids)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class SparseMoeBlock(nn.Module):
    def __init__(self, config: HFModelConfig) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError(f"{config.model_type} config has no MoE section")
        self.top_k = moe.num_experts_per_tok
        self.normalize = moe.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        expert = MixtralExpert if config.model_type == "mixtral" else GatedMLP
        self.experts = nn.ModuleList(
            expert(config.hidden_size, moe.moe_intermediate_size) for _ in range(moe.num_experts)
        )

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> FeedForwardOutput:
        """Output shaped like ``x`` and the expert ids used [tokens, top_k]; ``replay``
        [tokens, top_k] (tokens = all of ``x`` but the last dimension) forces those ids."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, ids = route_top_k(self.gate(tokens), self.top_k, normalize=self.normalize,
                                   replay=replay)
        out = torch.zeros_like(tokens)
        # Loop over the experts that got tokens: gather, run, scatter-add weighted outputs.
        # Fine for reference-sized batches; a grouped GEMM is the throughput path.
        for expert_id in torch.unique(ids).tolist():
            token_idx, slot = torch.where(ids == expert_id)
            y = self.experts[expert_id](tokens[token_idx]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out.reshape(shape), ids


def moe_feed_forward(config: HFModelConfig) -> FeedForwardFactory:
    """Sparse block on ``config.moe.sparse_layers``, dense SwiGLU MLP elsewhere."""
    moe = config.moe
    if moe is None:
        raise ValueError(f"{config.model_type} config has no MoE section")
    sparse = set(moe.sparse_layers)

    def build(layer: int) -> nn.Module:
        if layer in sparse:
            return SparseMoeBlock(config)
        return GatedMLP(config.hidden_size, config.intermediate_size)

    return build
