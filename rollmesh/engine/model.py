"""A tiny decoder-only transformer, built from ModelConfig with random initialization.

Knows torch only. Three entry points share one set of weights:
- ``forward``: full sequences (training, scoring);
- ``prefill``: one prompt, returning its KV as a plain tensor (so it can travel through the Ray
  object store to a decode worker);
- ``decode_step``: one new token for each of B sequences whose KV sits in a slot cache.
Pre-LayerNorm GPT blocks with two position signals: rotary embeddings (relative offsets, so
copying a tool result into the answer is easy to learn) and learned absolute positions (so is
copying a span found at a fixed place in the prompt; with rotary alone the tiny model copied the
prompt's formula into its tool call wrong most of the time). Tied embeddings. Issue 3 replaces this with
HF-compatible Llama/MoE families behind the same calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    max_seq_len: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        shape = cls(
            vocab_size=config.vocab_size,
            d_model=config.d_model,
            n_layers=config.n_layers,
            n_heads=config.n_heads,
            max_seq_len=config.max_seq_len,
        )
        if shape.d_model % shape.n_heads:
            raise ValueError(f"d_model {shape.d_model} is not divisible by n_heads {shape.n_heads}")
        return shape


ROPE_BASE = 10_000.0


def rotary_tables(shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of every position's rotation angles: [max_seq_len, head_dim / 2] each."""
    half = shape.head_dim // 2
    inverse_frequencies = ROPE_BASE ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.arange(shape.max_seq_len, dtype=torch.float32)[:, None] * inverse_frequencies
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary embeddings to x [B, H, T, head_dim]; cos/sin broadcast as [.., T, head_dim/2]."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class Block(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.ln1 = nn.LayerNorm(shape.d_model)
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model)
        self.proj = nn.Linear(shape.d_model, shape.d_model)
        self.ln2 = nn.LayerNorm(shape.d_model)
        self.fc = nn.Linear(shape.d_model, 4 * shape.d_model)
        self.out = nn.Linear(4 * shape.d_model, shape.d_model)

    def split_heads(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [B, H, T, head_dim], with q and k rotated to their positions."""
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(self.shape.d_model, dim=2)
        heads = (batch, length, self.shape.n_heads, self.shape.head_dim)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = attended.shape
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, self.shape.d_model))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyDecoder(nn.Module):
    def __init__(self, shape: ModelShape, *, seed: int = 0) -> None:
        super().__init__()
        self.shape = shape
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(shape.vocab_size, shape.d_model)
        self.pos = nn.Embedding(shape.max_seq_len, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layers))
        self.ln_f = nn.LayerNorm(shape.d_model)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2 scaled init of residual projections
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * shape.n_layers))
            nn.init.normal_(block.out.weight, std=0.02 / math.sqrt(2 * shape.n_layers))
        torch.random.set_rng_state(generator_state)
        cos, sin = rotary_tables(shape)
        # Not persistent: derived from the shape, so weight files carry only learned tensors.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ln_f(hidden) @ self.tok.weight.T  # tied embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Causal logits [B, T, V] for right-padded sequences (padding never affects real tokens)."""
        _, length = input_ids.shape
        cos, sin = self.rope_cos[:length], self.rope_sin[:length]
        x = self.tok(input_ids) + self.pos.weight[:length]
        for block in self.blocks:
            q, k, v = block.split_heads(x, cos, sin)
            x = block.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.logits(x)

    @torch.no_grad()
    def prefill(self, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one prompt; return (last-position logits [V], KV [L, 2, H, T, head_dim])."""
        ids = torch.tensor([input_ids], dtype=torch.long)
        cos, sin = self.rope_cos[: len(input_ids)], self.rope_sin[: len(input_ids)]
        x = self.tok(ids) + self.pos.weight[: len(input_ids)]
        layers = []
        for block in self.blocks:
            q, k, v = block.split_heads(x, cos, sin)
            layers.append(torch.stack((k[0], v[0])))
            x = block.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.logits(x)[0, -1], torch.stack(layers)

    @torch.no_grad()
    def decode_step(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """One token for each of B sequences; returns logits [B, V].

        ``cache`` is [L, 2, B, H, T_max, head_dim] (a view of the first B slots of the worker's
        slot cache); the new token's K/V is written at ``positions[b]`` and attention covers
        positions 0..positions[b] of each row.
        """
        batch = token_ids.shape[0]
        x = self.tok(token_ids)[:, None, :] + self.pos(positions)[:, None, :]
        cos, sin = self.rope_cos[positions][:, None, None, :], self.rope_sin[positions][:, None, None, :]
        span = int(positions.max()) + 1
        rows = torch.arange(batch)
        visible = torch.arange(span)[None, :] <= positions[:, None]  # [B, span]
        mask = visible[:, None, None, :]
        for layer, block in enumerate(self.blocks):
            q, k, v = block.split_heads(x, cos, sin)
            cache[layer, 0, rows, :, positions] = k[:, :, 0]
            cache[layer, 1, rows, :, positions] = v[:, :, 0]
            keys = cache[layer, 0, :, :, :span]
            values = cache[layer, 1, :, :, :span]
            x = block.finish(x, F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))
        return self.logits(x)[:, 0]


def build_model(config) -> TinyDecoder:
    """Build the model from a ModelConfig with deterministic random initialization."""
    return TinyDecoder(ModelShape.from_config(config), seed=config.seed)
