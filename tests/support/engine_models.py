"""The demo model directory as the engine tests run it: the demo's Qwen2 loaded by the engine's
own loader, with weights redrawn from a seed, and its tokenizer.

The demo directory's weights are transformers' initialisation (std 0.02): near-flat logits, where
float noise between a batched and a single-row path can flip a greedy token. Redrawn O(0.1-1)
weights make a model that babbles diverse tokens with clear greedy margins, which is what
comparisons of token streams need; another seed gives the new weights of a weight swap.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from rollmesh.chat.model_dir import ModelDirectory
from rollmesh.engine.decode import DecodeEngine
from rollmesh.engine.models import CausalLM, load_hf_model


def babbling_model(model_dir: Path, seed: int = 0) -> CausalLM:
    """The directory's model with every weight redrawn from ``seed`` (norms near 1, the rest
    N(0, 0.3)); tied embeddings stay tied."""
    model = load_hf_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.2 * noise if "norm" in name else 0.3 * noise)
    return model


@functools.lru_cache(maxsize=4)
def model_tokenizer(model_dir: Path) -> ModelDirectory:
    """The directory's tokenizer (the engine's ``Detokenizer``), loaded once per directory."""
    return ModelDirectory.load(model_dir)


def prefer_tokens(model: CausalLM, token_ids: slice | list[int], *, by: float = 100.0,
                  from_call: int = 0) -> CausalLM:
    """Make ``model`` add ``by`` to the logits of ``token_ids`` in every ``forward_paged`` call
    from the ``from_call``-th on (0: the prefill already), the way a trained model would want
    (or, negative, avoid) them; survives weight swaps; returns the model."""
    original = model.forward_paged
    calls = itertools.count()

    def forward_paged(*args, **kwargs):
        logits, routes = original(*args, **kwargs)
        if next(calls) >= from_call:
            logits = logits.clone()
            logits[..., token_ids] += by
        return logits, routes

    model.forward_paged = forward_paged  # an instance attribute shadows the method
    return model


@dataclass(frozen=True)
class EngineModels:
    """One model directory's babbling models, tokenizer and decode engines (as a decode worker
    builds them: with the directory's tokenizer)."""

    directory: Path

    @property
    def tokenizer(self) -> ModelDirectory:
        return model_tokenizer(self.directory)

    def model(self, seed: int = 0) -> CausalLM:
        return babbling_model(self.directory, seed)

    def engine(self, model: CausalLM, **kwargs) -> DecodeEngine:
        return DecodeEngine(model, tokenizer=self.tokenizer, **kwargs)
