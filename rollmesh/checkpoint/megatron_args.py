"""What a Megatron checkpoint says about its model: where it is, its format, and the arguments
saved with it (``args`` in ``common.pt``), turned into an ``ArchSpec`` and HF hyperparameters.

Knows Megatron-LM's save layout (a save root with ``latest_checkpointed_iteration.txt`` and
``iter_NNNNNNN`` folders), its argument names, and torch.load; nothing of tensors' contents.
Arguments are read through ``saved_arguments``, and only those that apply to the model: other
Megatron front ends save None for options a model does not use (MoE options of a dense model).
MoE checkpoints are read only when their router computes what the HF families do (softmax score,
top-k then renormalised, every layer an MoE layer, no shared experts), and any checkpoint only
with the HF families' rotary embedding (whole, not interleaved, scaled or interpolated); the rest
are refused by name rather than converted into a model that computes differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollmesh.checkpoint.arch_maps import FAMILIES, ArchSpec, Family
from rollmesh.checkpoint.errors import CheckpointReadError
from rollmesh.checkpoint.saved_arguments import SavedArguments

LATEST_FILE = "latest_checkpointed_iteration.txt"
COMMON_FILE = "common.pt"


def resolve_iteration_dir(src: str | Path) -> Path:
    """An iteration folder: ``src`` itself, or the latest one of a save root."""
    src = Path(src)
    latest = src / LATEST_FILE
    if latest.is_file():
        tag = latest.read_text().strip()
        folder = src / (f"iter_{int(tag):07d}" if tag.isdigit() else tag)
        if not folder.is_dir():
            raise CheckpointReadError(f"{LATEST_FILE} names {folder.name}, which is missing", path=str(src))
        return folder
    if not src.is_dir():
        raise CheckpointReadError("no such checkpoint directory", path=str(src))
    return src


def detect_format(folder: Path) -> str:
    """"torch_dist" or "megatron_legacy"."""
    if (folder / ".metadata").is_file():
        return "torch_dist"
    if any(folder.glob("mp_rank_*")):
        return "megatron_legacy"
    raise CheckpointReadError("neither a torch_dist checkpoint (.metadata) nor legacy mp_rank_* shards",
                              path=str(folder))


def saved_args(folder: Path) -> Any:
    """The training arguments saved with the checkpoint (Megatron-LM's ``args``: in the legacy
    files, in ``common.pt``, or as an object inside a torch_dist checkpoint), or None."""
    if detect_format(folder) == "megatron_legacy":
        from rollmesh.checkpoint.legacy_reader import LegacyCheckpoint

        return LegacyCheckpoint(folder).args()
    path = folder / COMMON_FILE
    if not path.is_file():  # the common state saved inside the checkpoint itself
        from rollmesh.checkpoint.torch_dist_reader import TorchDistCheckpoint

        checkpoint = TorchDistCheckpoint(folder)
        return checkpoint.read_object("args") if "args" in checkpoint.objects else None
    try:
        common = torch.load(path, weights_only=False, map_location="cpu")  # noqa: S614 - a trusted local checkpoint
    except Exception as exc:  # a damaged file: the loader's errors vary
        raise CheckpointReadError(f"unreadable {COMMON_FILE}: {exc!r}", path=str(path)) from exc
    return common.get("args") if isinstance(common, dict) else None


@dataclass(frozen=True)
class ModelDescription:
    spec: ArchSpec
    norm_epsilon: float
    rope_theta: float
    max_position_embeddings: int
    moe_top_k: int
    dtype: torch.dtype


def describe_model(args: Any, *, family: Family | None = None, path: str = "") -> ModelDescription:
    """The architecture from the saved arguments; ``family`` overrides only the detection.

    An argument is read only where it applies (MoE options only with experts, query groups only
    with group query attention); other front ends save None for the rest. Where Megatron-LM gives
    None a meaning (no experts, ``kv_channels``, ``ffn_hidden_size``, ``moe_ffn_hidden_size``,
    ``params_dtype``), that meaning is taken; any other applicable argument that is None or not
    readable is a ``CheckpointArgumentError`` naming it."""
    if args is None:
        raise CheckpointReadError("the checkpoint saved no training arguments (args in common.pt)", path=path)
    saved = SavedArguments(args, path=path)
    experts = saved.optional_int("num_experts", minimum=0) or 0  # None or 0: dense, as Megatron-LM reads it
    if family is None:
        family = ("qwen3_moe" if saved.switch("qk_layernorm") else "mixtral") if experts else (
            "qwen2" if saved.switch("add_qkv_bias") else "llama")
    if family not in FAMILIES:
        raise ValueError(f"unknown architecture {family!r}: one of {', '.join(FAMILIES)}")
    unsupported = _unsupported_rope_options(saved) + (_unsupported_moe_options(saved) if experts else [])
    if unsupported:
        raise CheckpointReadError(f"options no Hugging Face {family} model reproduces: {', '.join(unsupported)}",
                                  path=path)
    hidden, heads = saved.required_int("hidden_size"), saved.required_int("num_attention_heads")
    groups = heads
    if saved.switch("group_query_attention"):  # without it Megatron-LM ignores num_query_groups
        groups = saved.required_int("num_query_groups")
        if heads % groups:
            raise saved.refuse("num_query_groups", f"does not divide num_attention_heads = {heads}")
    head_dim = saved.optional_int("kv_channels")
    if head_dim is None:  # Megatron-LM: hidden_size // num_attention_heads
        if hidden % heads:
            raise saved.refuse("kv_channels", f"hidden_size = {hidden} does not split into {heads} heads")
        head_dim = hidden // heads
    ffn = saved.optional_int("ffn_hidden_size")
    if ffn is None:  # Megatron-LM's default, smaller for SwiGLU's two input projections
        ffn = int((4 * hidden * 2 / 3) / 64) * 64 if saved.switch("swiglu") else 4 * hidden
    padded = saved.required_int("padded_vocab_size")
    vocab = saved.optional_int("vocab_size") or padded
    if vocab > padded:
        raise saved.refuse("vocab_size", f"above padded_vocab_size = {padded}")
    moe_ffn, top_k = 0, 0
    if experts:
        moe_ffn = saved.optional_int("moe_ffn_hidden_size") or ffn  # Megatron-LM: ffn_hidden_size
        top_k = saved.required_int("moe_router_topk", default=2)
        if top_k > experts:
            raise saved.refuse("moe_router_topk", f"more than the {experts} experts")
    spec = ArchSpec(
        family=family, num_layers=saved.required_int("num_layers"), hidden_size=hidden, num_heads=heads,
        num_query_groups=groups, head_dim=head_dim, ffn_hidden_size=ffn, vocab_size=vocab, padded_vocab_size=padded,
        tie_embeddings=not saved.switch("untie_embeddings_and_output_weights"), num_experts=experts,
        moe_ffn_hidden_size=moe_ffn)
    return ModelDescription(
        spec=spec, norm_epsilon=saved.required_float(_epsilon_name(saved), default=1e-5),
        rope_theta=saved.required_float("rotary_base", default=10000, minimum=1.0),
        max_position_embeddings=saved.required_int("max_position_embeddings", default=4096),
        moe_top_k=top_k, dtype=_params_dtype(saved))


def _epsilon_name(saved: SavedArguments) -> str:
    """Megatron-LM saves ``--norm-epsilon`` as ``norm_epsilon`` up to core 0.15 and, from 0.16 on
    (arguments built from TransformerConfig), as ``layernorm_epsilon``."""
    if saved.unset("norm_epsilon") and not saved.unset("layernorm_epsilon"):
        return "layernorm_epsilon"  # absent or None under the old name, present under the new
    return "norm_epsilon"


def _params_dtype(saved: SavedArguments) -> torch.dtype:
    """``params_dtype``; unset, Megatron-LM's own rule: bfloat16 with bf16, float16 with fp16,
    else float32. A torch dtype, or a string naming one ("bfloat16", "torch.bfloat16")."""
    if saved.unset("params_dtype"):
        return torch.bfloat16 if saved.switch("bf16") else torch.float16 if saved.switch("fp16") else torch.float32
    value = saved.value("params_dtype")
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), value)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise saved.refuse("params_dtype", "expected a floating-point torch dtype")
    return value


def _unsupported_rope_options(saved: SavedArguments) -> list[str]:
    """The saved position-embedding options the HF families do not compute: no rotary
    embedding, or a partial, interleaved, scaled or interpolated one."""
    found = []
    kind = saved.optional_str("position_embedding_type")
    if kind not in (None, "rope"):
        found.append(f"position_embedding_type={kind}")
    percent = saved.optional_float("rotary_percent")
    if percent is not None and percent != 1.0:
        found.append(f"rotary_percent={percent}")
    for name in ("rotary_interleaved", "use_rope_scaling", "rotary_seq_len_interpolation_factor"):
        if saved.is_set(name):
            found.append(name)
    return found


def _unsupported_moe_options(saved: SavedArguments) -> list[str]:
    """The saved MoE options (Megatron-LM argument names) that change routing or add parameters
    beyond Mixtral's and Qwen3-MoE's: softmax over all experts then top-k without renormalising
    (pre-softmax), sigmoid scores, scaled or grouped top-k, expert bias, shared experts, dense
    layers between MoE layers. Unset (None) is the feature off."""
    found = []
    if (saved.optional_str("moe_router_score_function") or "softmax") != "softmax":
        found.append(f"moe_router_score_function={saved.value('moe_router_score_function')}")
    for name in ("moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
                 "moe_shared_expert_intermediate_size", "moe_router_num_groups"):
        if saved.is_set(name):
            found.append(name)
    if not (saved.unset("moe_layer_freq") or _every_layer(saved.value("moe_layer_freq"))):
        found.append(f"moe_layer_freq={saved.value('moe_layer_freq')}")
    return found


def _every_layer(frequency: Any) -> bool:
    """``moe_layer_freq`` 1, or a list of 1s (an MoE layer in every layer)."""
    if isinstance(frequency, list):
        return bool(frequency) and all(type(step) is int and step == 1 for step in frequency)
    return type(frequency) is int and frequency == 1
