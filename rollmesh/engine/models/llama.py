"""Llama/Qwen2-style dense decoder as plain torch modules, named as in HF safetensors.

RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, tied or untied embeddings, optional q/k/v
(and o) biases and Qwen3's per-head q/k norms. Parameter names equal the checkpoint's
(``model.layers.N.self_attn.q_proj.weight`` ...) so an HF state dict loads with no renaming.
Knows ``HFModelConfig``; does not know files, transformers, or which feed-forward is sparse:
``CausalLM`` takes a factory for each layer's feed-forward (see ``families.py``).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rollmesh.engine.kv_pages import KvLayout, PagedAttention
from rollmesh.engine.models.hf_config import HFModelConfig

# A layer's feed-forward returns its output, plus the routed expert ids [tokens, top_k] if sparse.
FeedForwardOutput = tuple[torch.Tensor, torch.Tensor | None]
FeedForwardFactory = Callable[[int], nn.Module]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale after casting back, in HF's order, so bf16 rounds alike.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


@functools.lru_cache(maxsize=16)
def _inverse_frequencies(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    # Cached per (shape, device) rather than kept as a module buffer: a model built on the meta
    # device and then loaded with assign=True would otherwise keep a meta buffer.
    # Made outside inference mode, so a training forward may use the cached tensor too.
    with torch.inference_mode(False):
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float) / head_dim))


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] for the half-split ("rotate_half") RoPE layout HF uses."""
    inv_freq = _inverse_frequencies(head_dim, theta, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: HFModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.sliding_window
        hidden, q_out, kv_out = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_out, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_out, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_out, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_out, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        paged: PagedAttention | None = None,
        layer_index: int = 0,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``attn_mask``: boolean [B, 1, T, T], True where a query may attend a key (packed
        rows' block-diagonal causal mask); None: plain causal."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if paged is not None:
            out = paged.attend(layer_index, q, k, v)
            return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
        mask = attn_mask
        if self.sliding_window is not None and seq > self.sliding_window:
            i = torch.arange(seq, device=x.device)
            dist = i[:, None] - i[None, :]
            window = (dist >= 0) & (dist < self.sliding_window)
            mask = window if mask is None else mask & window
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.num_kv_heads != self.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, feed_forward: nn.Module) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Registered under the checkpoint's name ("mlp", or Mixtral's "block_sparse_moe").
        self.feed_forward_name = config.feed_forward_name
        self.add_module(config.feed_forward_name, feed_forward)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        paged: PagedAttention | None = None,
        layer_index: int = 0,
        replay: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> FeedForwardOutput:
        """``replay``: recorded expert ids [B*T, top_k] for a sparse layer (routing replay);
        ``attn_mask``: as ``Attention.forward``'s."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, paged, layer_index, attn_mask)
        feed_forward = getattr(self, self.feed_forward_name)
        h = self.post_attention_layernorm(x)
        out = feed_forward(h) if replay is None else feed_forward(h, replay)
        out, routed = out if isinstance(out, tuple) else (out, None)
        return x + out, routed


class DecoderModel(nn.Module):
    """The ``model.`` prefix of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: HFModelConfig, feed_forward: FeedForwardFactory) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, feed_forward(i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def dense_feed_forward(config: HFModelConfig) -> FeedForwardFactory:
    return lambda _layer: GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)


class CausalLM(nn.Module):
    """Decoder plus LM head. ``forward(input_ids [B, T]) -> logits [B, T, V]``, full causal."""

    def __init__(self, config: HFModelConfig, feed_forward: FeedForwardFactory | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, feed_forward or dense_feed_forward(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head if the config ties them; call after loading."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, routed_experts: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_with_routes(input_ids, routed_experts, positions=positions, attn_mask=attn_mask)[0]

    def forward_with_routes(
        self, input_ids: torch.Tensor, routed_experts: torch.Tensor | None = None, *,
        positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, T, V] and, for MoE models, routed expert ids [B, T, sparse layers, top_k].

        Expert ids are uint8 when there are at most 256 experts, else uint16; rows follow
        ``config.moe.sparse_layers``. Dense models return None for the routes. ``routed_experts``
        (same layout, any integer dtype) replays recorded ids instead of each router's top k
        (see ``rollmesh.training.router_replay``); the routes returned are then those ids.

        Packed rows (``rollmesh.training.packing``): ``positions`` [B, T] (reset per example) and
        ``attn_mask`` [B, 1, T, T] boolean, True where a query may attend a key; by default
        positions 0..T-1 and a plain causal mask.
        """
        batch, seq = input_ids.shape
        x = self.model.embed_tokens(input_ids)
        if positions is None:
            cos, sin = rope_cos_sin(torch.arange(seq, device=input_ids.device), self.config.head_dim,
                                    self.config.rope_theta, x.dtype)
        else:  # [B*T, D] -> [B, 1, T, D]: broadcast over the heads, as forward_paged does
            cos, sin = rope_cos_sin(positions.reshape(-1), self.config.head_dim, self.config.rope_theta, x.dtype)
            cos, sin = cos.view(batch, 1, seq, -1), sin.view(batch, 1, seq, -1)
        replays = self.layer_replays(routed_experts)
        routes = []
        for layer, replay in zip(self.model.layers, replays):
            x, routed = layer(x, cos, sin, replay=replay, attn_mask=attn_mask)
            if routed is not None:
                routes.append(routed.view(batch, seq, -1))
        logits = self.lm_head(self.model.norm(x))
        return logits, self._stack_routes(routes)

    def layer_replays(self, routed_experts: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Each layer's replayed ids [B*T, top_k] from [B, T, sparse layers, top_k]; None for
        dense layers, and for every layer when ``routed_experts`` is None."""
        replays: list[torch.Tensor | None] = [None] * len(self.model.layers)
        if routed_experts is None:
            return replays
        moe = self.config.moe
        if moe is None:
            raise ValueError(f"{self.config.model_type} is dense: it has no experts to replay")
        if routed_experts.dim() != 4 or routed_experts.shape[2:] != self.routing_shape:
            raise ValueError(f"routed experts {tuple(routed_experts.shape)}, expected "
                             f"[B, T, {len(moe.sparse_layers)}, {moe.num_experts_per_tok}]")
        for slot, layer in enumerate(moe.sparse_layers):
            replays[layer] = routed_experts[:, :, slot].reshape(-1, moe.num_experts_per_tok)
        return replays

    def _stack_routes(self, routes: list[torch.Tensor]) -> torch.Tensor | None:
        if not routes:
            return None
        moe = self.config.moe
        id_dtype = torch.uint8 if moe is not None and moe.num_experts <= 256 else torch.uint16
        return torch.stack(routes, dim=2).to(id_dtype)

    # -- the inference engine's view (``rollmesh.engine.paged_model.PagedCausalModel``) -------

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def sliding_window(self) -> int | None:
        return self.config.sliding_window

    @property
    def eos_token_id(self) -> int:
        # -1 matches no token: a config without an EOS generates to its budget.
        return -1 if self.config.eos_token_id is None else self.config.eos_token_id

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        moe = self.config.moe
        return None if moe is None else (len(moe.sparse_layers), moe.num_experts_per_tok)

    def kv_layout(self) -> KvLayout:
        return KvLayout(
            num_layers=self.config.num_hidden_layers,
            num_kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim,
            dtype=self.model.embed_tokens.weight.dtype,
        )

    def forward_paged(
        self, input_ids: torch.Tensor, paged: PagedAttention, *, last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for ``input_ids`` [B, T] at ``paged.positions``, their K/V written to the pool.

        ``last_only`` keeps only the last position's logits ([B, 1, V]): a prefill needs no more.
        Routes, for MoE models, are [B, T, sparse layers, top_k] as in ``forward_with_routes``.
        """
        batch, seq = input_ids.shape
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(paged.positions.reshape(-1).to(input_ids.device),
                                self.config.head_dim, self.config.rope_theta, x.dtype)
        # [B*T, D] -> [B, 1, T, D]: broadcast over the heads of q and k.
        cos, sin = cos.view(batch, 1, seq, -1), sin.view(batch, 1, seq, -1)
        routes = []
        for index, layer in enumerate(self.model.layers):
            x, routed = layer(x, cos, sin, paged, index)
            if routed is not None:
                routes.append(routed.view(batch, seq, -1))
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x)), self._stack_routes(routes)
