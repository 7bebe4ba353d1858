"""What the HTTP API and the rollout workers need to know of the configured model (its name,
context length, vocabulary, whether it routes experts), read from ``config.json`` alone.

Knows the model directory's ``config.json``; not torch (its callers, the rollout workers and the
Serve app, never build the model), nor the engine that does build it (``paged_model``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ServedModelFacts:
    """What the HTTP API needs to know of the configured model, read without building it."""

    name: str  # the model directory's name
    max_seq_len: int
    vocab_size: int
    routes_experts: bool  # a mixture of experts, with routed experts to report


def describe_served_model(config) -> ServedModelFacts:
    from rollmesh.engine.models import read_hf_config

    hf = read_hf_config(config.path)  # config.json only, read once
    return ServedModelFacts(name=Path(config.path).resolve().name, max_seq_len=hf.max_position_embeddings,
                            vocab_size=hf.vocab_size, routes_experts=hf.moe is not None)
