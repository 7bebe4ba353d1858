"""The megatron backend's transformer layer spec and its core attention: Transformer Engine's
layer spec when ``transformer_engine`` imports, megatron-core's local spec otherwise, and in both
a core attention on ``torch.nn.functional.scaled_dot_product_attention`` (``SdpaAttention``), so
attention scores are never materialised as [batch, heads, seq, seq]. The choice is logged.

Knows megatron-core's layer specs and core-attention contract (``DotProductAttention``'s
constructor and forward), torch's sdpa and structlog; nothing of weights, losses, Ray or NATS.

Why sdpa in place of megatron's ``DotProductAttention`` (local spec): that one computes the full
fp32-or-bf16 score tensor, [b, h, s, s] per layer (32 heads x 8k positions: 4 GiB a layer in
bf16), which realistic RL sequence lengths cannot hold. sdpa runs FlashAttention/cuDNN kernels on
CUDA for the plain causal case (the mask is None: ``is_causal``) and the memory-efficient kernel
under an explicit mask (packed rows' block-diagonal mask: a bool [b, 1, s, s], no heads, no
scores); on the CPU its math fallback gives megatron's result (tested to 1e-5 in the logits).
Why sdpa in the Transformer Engine spec too, not TE's ``TEDotProductAttention``: TE fixes the
mask type per layer spec (causal), and the supervised steps' packed rows need a block-diagonal
mask, which TE reads only in its packed THD format; the spec's fused norm + linear layers are
TE's. The TE path is written against megatron-core 0.16's spec and not run here (no TE, no GPU).
"""

from __future__ import annotations

import importlib.util

import structlog
import torch
import torch.nn.functional as F

_log = structlog.get_logger("rollmesh.training.megatron_attention")


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine`` imports here (it needs CUDA; an import that fails for a
    missing CUDA library counts as absent)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - TE raises OSError/RuntimeError/ImportError for a bad CUDA setup
        return False
    return True


def _core_attention_base():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


class SdpaAttention(_core_attention_base()):
    """megatron-core's core attention contract (``DotProductAttention``: constructor, per-rank
    heads, GQA groups, softmax scale) with the arithmetic of ``scaled_dot_product_attention``.

    ``attention_mask``: None for plain causal attention (sdpa's ``is_causal``: the flash kernels
    on CUDA), or megatron's bool mask [b or 1, 1, sq, sk] with True = masked."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaAttention takes neither packed_seq_params nor attention_bias")
        if self.config.softmax_type != "vanilla":
            raise ValueError(f"SdpaAttention computes the vanilla softmax, not {self.config.softmax_type!r}")
        # [s, b, heads, dim] -> [b, heads, s, dim]; GQA's groups repeated per query head, as
        # megatron's DotProductAttention does (query head i reads group i // (heads / groups)).
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # megatron divides its scale by the layer number under query-key layer scaling and has
        # its softmax multiply it back: the product is the plain 1/sqrt(dim).
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        mask = None if attention_mask is None else ~attention_mask  # sdpa: True = attend
        context = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=attention_mask is None,
            dropout_p=self.attention_dropout.p if self.training else 0.0, scale=scale)
        # [b, heads, s, dim] -> [s, b, heads * dim]
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], -1)


def gpt_layer_spec(*, num_experts: int | None, qk_layernorm: bool, norm):
    """The transformer layer spec (and the layer-norm class of the block's final norm): TE's
    when it imports, else the local spec with ``norm`` (the caller's sequence-parallel-aware
    RMSNorm) for every norm; either way ``SdpaAttention`` as the core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if transformer_engine_available():
        from megatron.core.extensions.transformer_engine import TENorm

        layer = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                           qk_layernorm=qk_layernorm)
        final_norm = TENorm
        spec_name = "transformer_engine"
    else:
        # The local spec's rotary embedding is non-interleaved (rotate_half), as HF's is.
        layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                         qk_layernorm=qk_layernorm, normalization="RMSNorm")
        layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
        if qk_layernorm:
            layer.submodules.self_attention.submodules.q_layernorm = norm
            layer.submodules.self_attention.submodules.k_layernorm = norm
        final_norm = norm
        spec_name = "local"
    layer.submodules.self_attention.submodules.core_attention = SdpaAttention
    _log.info("megatron_layer_spec", spec=spec_name, core_attention="torch_sdpa")
    return layer, final_norm, spec_name

