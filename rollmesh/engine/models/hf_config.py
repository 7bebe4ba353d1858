"""Typed model config read from a Hugging Face ``config.json``.

Knows the JSON fields of the llama, qwen2, qwen3_moe and mixtral families and their defaults
(as in transformers 5.x); knows nothing of torch or of checkpoints. Unknown JSON fields are
ignored (HF configs carry many we do not use); fields that would change the maths in a way we do
not implement (rope scaling, sliding windows in Qwen, non-SiLU activations) raise
``ModelConfigError`` rather than giving silently wrong logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from rollmesh.engine.models.errors import (
    SUPPORTED_MODEL_TYPES,
    ModelConfigError,
    UnsupportedModelTypeError,
)

PositiveInt = Annotated[int, Meta(gt=0)]


class MoEConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    num_experts: PositiveInt
    num_experts_per_tok: PositiveInt
    moe_intermediate_size: PositiveInt
    # Renormalise the top-k probabilities to sum to one (always on for Mixtral).
    norm_topk_prob: bool
    # Layers whose feed-forward is the sparse block; the others use the dense MLP.
    sparse_layers: tuple[int, ...]


class HFModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model_type: str
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: PositiveInt
    rms_norm_eps: Annotated[float, Meta(gt=0)]
    rope_theta: Annotated[float, Meta(gt=0)]
    max_position_embeddings: PositiveInt
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    # Qwen3 normalises each head's q and k (RMSNorm over head_dim) before RoPE.
    qk_norm: bool
    # None: full causal attention. Otherwise a key is visible while query - key < sliding_window.
    sliding_window: PositiveInt | None = None
    # The safetensors name of each layer's feed-forward module ("mlp", or Mixtral's
    # "block_sparse_moe"), so hub checkpoints load without renaming.
    feed_forward_name: str = "mlp"
    moe: MoEConfig | None = None
    # The id that ends a generation (the first, when the config lists several); None: none.
    eos_token_id: int | None = None


class _FamilyJson(msgspec.Struct, kw_only=True):
    """The JSON fields all four families share, with transformers' defaults where it has them."""

    model_type: str
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    max_position_embeddings: PositiveInt = 2048
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: PositiveInt | None = None
    # MoE fields; ignored by the dense families.
    num_experts: PositiveInt | None = None
    num_local_experts: PositiveInt | None = None
    num_experts_per_tok: PositiveInt | None = None
    moe_intermediate_size: PositiveInt | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: PositiveInt = 1
    mlp_only_layers: list[int] = []


_DEFAULT_ROPE_THETA = {"llama": 10000.0, "qwen2": 10000.0, "qwen3_moe": 10000.0, "mixtral": 1e6}
_DEFAULT_EPS = {"llama": 1e-6, "qwen2": 1e-6, "qwen3_moe": 1e-6, "mixtral": 1e-5}


def read_hf_config(path: str | Path) -> HFModelConfig:
    """Read ``config.json`` (or the directory holding it) into an ``HFModelConfig``."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read: {exc}", field="$", path=str(path)) from exc
    return parse_hf_config(raw, path=str(path))


def parse_hf_config(raw: dict[str, Any], *, path: str | None = None) -> HFModelConfig:
    """Build an ``HFModelConfig`` from a decoded HF config dict; raise ``ModelConfigError``."""
    if not isinstance(raw, dict):
        raise ModelConfigError("expected a JSON object", field="$", path=path)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelTypeError(model_type, path=path)
    try:
        js = msgspec.convert(raw, _FamilyJson, strict=False)
    except msgspec.ValidationError as exc:
        # msgspec's message ends in "- at `$.field`"; keep it whole, it names the path.
        field = str(exc).rpartition("`$.")[2].rstrip("`") or "$"
        raise ModelConfigError(str(exc), field=field, path=path) from exc

    def fail(field: str, reason: str) -> ModelConfigError:
        return ModelConfigError(reason, field=field, path=path)

    if js.hidden_act != "silu":
        raise fail("hidden_act", f"{js.hidden_act!r} is not supported (only 'silu')")
    kv_heads = js.num_key_value_heads or js.num_attention_heads
    if js.num_attention_heads % kv_heads:
        raise fail("num_key_value_heads", f"{kv_heads} does not divide {js.num_attention_heads} heads")
    head_dim = js.head_dim or js.hidden_size // js.num_attention_heads
    if head_dim % 2:
        raise fail("head_dim", f"{head_dim} is odd; RoPE needs an even head size")
    rope_theta = _rope_theta(js, fail)

    sliding_window = None
    if model_type == "mixtral":
        sliding_window = js.sliding_window
    elif js.use_sliding_window:
        # Qwen's per-layer windows (max_window_layers / layer_types) are not implemented.
        raise fail("use_sliding_window", "sliding-window attention is not supported for " + model_type)

    moe = _moe_config(model_type, js, fail)
    eos = js.eos_token_id[0] if isinstance(js.eos_token_id, list) and js.eos_token_id else js.eos_token_id
    return HFModelConfig(
        eos_token_id=eos if isinstance(eos, int) else None,
        model_type=model_type,
        vocab_size=js.vocab_size,
        hidden_size=js.hidden_size,
        intermediate_size=js.intermediate_size,
        num_hidden_layers=js.num_hidden_layers,
        num_attention_heads=js.num_attention_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=js.rms_norm_eps if "rms_norm_eps" in raw else _DEFAULT_EPS[model_type],
        rope_theta=rope_theta,
        max_position_embeddings=js.max_position_embeddings,
        tie_word_embeddings=js.tie_word_embeddings,
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four.
        qkv_bias=True if model_type == "qwen2" else js.attention_bias,
        o_proj_bias=js.attention_bias if model_type in ("llama", "qwen3_moe") else False,
        mlp_bias=js.mlp_bias if model_type == "llama" else False,
        qk_norm=model_type == "qwen3_moe",
        sliding_window=sliding_window,
        feed_forward_name="block_sparse_moe" if model_type == "mixtral" else "mlp",
        moe=moe,
    )


def _rope_theta(js: _FamilyJson, fail) -> float:
    # transformers 5 writes rope_parameters={"rope_type", "rope_theta"}; 4.x wrote a top-level
    # rope_theta plus an optional rope_scaling dict. Accept both, refuse any scaling.
    params = js.rope_parameters or js.rope_scaling or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        field = "rope_parameters" if js.rope_parameters else "rope_scaling"
        raise fail(field, f"rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", js.rope_theta)
    theta = _DEFAULT_ROPE_THETA[js.model_type] if theta is None else theta
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise fail("rope_theta", f"expected a positive number, got {theta!r}")
    return float(theta)


def _moe_config(model_type: str, js: _FamilyJson, fail) -> MoEConfig | None:
    if model_type not in ("qwen3_moe", "mixtral"):
        return None
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts; hub configs say num_experts.
    num_experts = js.num_experts or js.num_local_experts or (128 if model_type == "qwen3_moe" else 8)
    top_k = js.num_experts_per_tok or (8 if model_type == "qwen3_moe" else 2)
    if top_k > num_experts:
        raise fail("num_experts_per_tok", f"{top_k} is more than the {num_experts} experts")
    if num_experts > 65536:
        raise fail("num_experts", f"{num_experts} experts do not fit the uint16 routed-expert ids")
    if model_type == "mixtral":
        return MoEConfig(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=js.intermediate_size,
            norm_topk_prob=True,
            sparse_layers=tuple(range(js.num_hidden_layers)),
        )
    sparse = tuple(
        i
        for i in range(js.num_hidden_layers)
        if i not in js.mlp_only_layers and (i + 1) % js.decoder_sparse_step == 0
    )
    return MoEConfig(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=js.moe_intermediate_size or 768,
        norm_topk_prob=js.norm_topk_prob,
        sparse_layers=sparse,
    )
