"""The tensor transforms between Megatron-core and Hugging Face layouts, each with its inverse.

Knows torch only. Megatron stores (in ``torch_dist``, TP-invariantly):
- attention QKV fused and interleaved per query group: for each of G groups, its ``heads/G`` Q
  heads, then its one K head, then its one V head (``head_dim`` rows each); HF keeps
  ``q_proj``/``k_proj``/``v_proj`` apart;
- the SwiGLU ``linear_fc1`` as ``[gate; up]`` halves; HF keeps ``gate_proj``/``up_proj``;
- embeddings and the output layer padded to a vocabulary multiple; HF keeps the true vocabulary;
- grouped experts stacked on a leading expert axis; HF keeps one tensor per expert.
Every function here is exact (slicing and concatenation only), so a round trip is bit-identical.
"""

from __future__ import annotations

import torch


def deinterleave_qkv(fused: torch.Tensor, *, groups: int, heads: int, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron ``linear_qkv`` (weight [rows, hidden] or bias [rows]) -> HF q, k, v."""
    per_group = heads // groups
    if heads % groups or fused.shape[0] != groups * (per_group + 2) * head_dim:
        raise ValueError(f"a fused QKV of {fused.shape[0]} rows does not fit {heads} heads in "
                         f"{groups} groups of head_dim {head_dim}")
    tail = fused.shape[1:]
    view = fused.reshape(groups, per_group + 2, head_dim, *tail)
    q, k, v = torch.split(view, [per_group, 1, 1], dim=1)
    return (q.reshape(heads * head_dim, *tail), k.reshape(groups * head_dim, *tail),
            v.reshape(groups * head_dim, *tail))


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, groups: int, heads: int,
                   head_dim: int) -> torch.Tensor:
    """The inverse of ``deinterleave_qkv``."""
    per_group = heads // groups
    tail = q.shape[1:]
    fused = torch.cat([q.reshape(groups, per_group, head_dim, *tail),
                       k.reshape(groups, 1, head_dim, *tail),
                       v.reshape(groups, 1, head_dim, *tail)], dim=1)
    return fused.reshape(groups * (per_group + 2) * head_dim, *tail)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU ``linear_fc1`` [2F, hidden] (or [E, 2F, hidden]) -> gate, up."""
    axis = fc1.dim() - 2
    if fc1.shape[axis] % 2:
        raise ValueError(f"an fc1 of {fc1.shape[axis]} rows cannot hold gate and up halves")
    gate, up = torch.chunk(fc1, 2, dim=axis)
    return gate, up


def join_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=gate.dim() - 2)


def strip_vocab_padding(table: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if table.shape[0] < vocab_size:
        raise ValueError(f"a vocabulary table of {table.shape[0]} rows holds fewer than {vocab_size}")
    return table[:vocab_size]


def pad_vocab(table: torch.Tensor, padded_size: int) -> torch.Tensor:
    """The inverse of ``strip_vocab_padding``: zero rows up to ``padded_size``."""
    missing = padded_size - table.shape[0]
    if missing < 0:
        raise ValueError(f"cannot pad {table.shape[0]} rows down to {padded_size}")
    return torch.cat([table, table.new_zeros(missing, *table.shape[1:])]) if missing else table
