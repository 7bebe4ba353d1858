"""Weights for small random MoE models whose routing means something, shared by the routing-replay
tests and ``benchmarks/router_replay.py``.

Knows torch only. HF's initialisation gives near-uniform router scores, where replay changes
almost nothing; one-hot scores never disagree between precisions. Router logits of unit scale
sit between the two, as a trained router's do, and every value is rounded to bf16 so an engine's
bf16 copy of the model holds exactly the trainer's fp32 numbers.
"""

from __future__ import annotations

import torch


def init_unit_router_weights(model: torch.nn.Module, hidden_size: int) -> torch.nn.Module:
    """Fill ``model``'s parameters in place (norms near 1, routers of unit-scale logits, the rest
    N(0, 0.1)), each rounded to bf16; returns the model in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.normal_(0, hidden_size ** -0.5)
            else:
                p.normal_(0, 0.1)
            p.copy_(p.bfloat16().float())
    return model.eval()
