"""A tiny decoder-only transformer, built from ModelConfig with random initialization.

Knows torch and the paged KV cache. Two entry points share one set of weights:
- ``forward``: full sequences (training, scoring);
- ``forward_paged``: the inference engine's call (``paged_model.PagedCausalModel``), for new
  tokens whose context sits in a paged KV pool: a prompt, the rest of a session's next turn, or
  one token of each of B decoding sequences.
Pre-LayerNorm GPT blocks with two position signals: rotary embeddings (relative offsets, so
copying a tool result into the answer is easy to learn) and learned absolute positions (so is
copying a span found at a fixed place in the prompt; with rotary alone the tiny model copied the
prompt's formula into its tool call wrong most of the time). Tied embeddings. It is the demo's
model (``model.family = "tiny"``); the Hugging Face families in ``engine.models`` serve through
the same ``forward_paged``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rollmesh.engine.kv_pages import KvLayout, PagedAttention
from rollmesh.engine.tokenizer import EOS_ID


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

    # -- the inference engine's view (``rollmesh.engine.paged_model.PagedCausalModel``) -------

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.shape.max_seq_len

    sliding_window = None
    routing_shape = None  # dense: no routed experts
    eos_token_id = EOS_ID

    def kv_layout(self) -> KvLayout:
        return KvLayout(
            num_layers=self.shape.n_layers, num_kv_heads=self.shape.n_heads,
            head_dim=self.shape.head_dim, dtype=self.tok.weight.dtype,
        )

    def forward_paged(
        self, input_ids: torch.Tensor, paged: PagedAttention, *, last_only: bool = False
    ) -> tuple[torch.Tensor, None]:
        """Logits [B, T or 1, V] for ``input_ids`` [B, T] at ``paged.positions``."""
        positions = paged.positions.to(input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        for layer, block in enumerate(self.blocks):
            q, k, v = block.split_heads(x, cos, sin)
            x = block.finish(x, paged.attend(layer, q, k, v))
        if last_only:
            x = x[:, -1:]
        return self.logits(x), None


def build_model(config) -> TinyDecoder:
    """Build the model from a ModelConfig with deterministic random initialization."""
    return TinyDecoder(ModelShape.from_config(config), seed=config.seed)
