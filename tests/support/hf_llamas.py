"""Tiny random Hugging Face Llamas for the trainer backends' tests, saved as real checkpoints.

Weights are drawn with a fixed seed: norms near 1 (so a converter that dropped them would show),
everything else N(0, 0.1).
"""

from __future__ import annotations

from pathlib import Path

import torch


def save_random_llama(config: dict, directory: Path) -> Path:
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
    model.save_pretrained(directory)
    return directory
