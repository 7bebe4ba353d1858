"""What the engine needs of a model, and which model and tokenizer a config builds.

Knows torch, the Hugging Face families and the chat package's ``ModelDirectory`` (the tokenizer);
not the engine's scheduling. Any ``PagedCausalModel`` can be prefilled, decoded, disaggregated
and hot-swapped by the same engine code: the HF Llama/Qwen2/Qwen3-MoE/Mixtral ``CausalLM``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from rollmesh.engine.kv_pages import KvLayout, PagedAttention
from rollmesh.engine.protocols import Detokenizer
from rollmesh.moved_names import forward_moved_names


class PagedCausalModel(Protocol):
    vocab_size: int
    max_seq_len: int
    # None for full causal attention; otherwise keys more than this far back are hidden.
    sliding_window: int | None
    # (sparse layers, top_k) for MoE models, None for dense ones.
    routing_shape: tuple[int, int] | None
    # config.json's eos, which ends a generation only for an engine given no tokenizer (-1: none).
    eos_token_id: int

    def kv_layout(self) -> KvLayout: ...

    def forward_paged(
        self, input_ids: torch.Tensor, paged: PagedAttention, *, last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def build_inference_model(config) -> nn.Module:
    """The model of the Hugging Face directory ``model.path`` (config.json + safetensors)."""
    from rollmesh.engine.models import load_hf_model  # imports safetensors only when used

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
    return load_hf_model(config.path, dtype=dtype)


def load_tokenizer(config) -> Detokenizer:
    """The tokenizer of the model directory ``model.path``: the engine's end-of-turn ids, its
    vocabulary (padded embedding rows are never sampled) and the text stop strings match in."""
    from rollmesh.chat.model_dir import ModelDirectory  # transformers, only when used

    return ModelDirectory.load(config.path)


# Deprecated: moved to rollmesh.engine.served_model (it needs no torch; this module does).
__getattr__ = forward_moved_names(__name__, {"ServedModelFacts": "rollmesh.engine.served_model",
                                             "describe_served_model": "rollmesh.engine.served_model"})
