"""What a Megatron checkpoint says about its model: where it is, its format, and the arguments
saved with it (``args`` in ``common.pt``), turned into an ``ArchSpec`` and HF hyperparameters.

Knows Megatron-LM's save layout (a save root with ``latest_checkpointed_iteration.txt`` and
``iter_NNNNNNN`` folders), its argument names, and torch.load; nothing of tensors' contents.
MoE checkpoints are read only when their router computes what the HF families do (softmax score,
top-k then renormalised, every layer an MoE layer, no shared experts); the rest are refused by
name rather than converted into a model that routes differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollmesh.checkpoint.arch_maps import FAMILIES, ArchSpec, Family
from rollmesh.checkpoint.errors import CheckpointReadError

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


def describe_model(args: Any, *, family: Family | None = None) -> ModelDescription:
    """The architecture from the saved arguments; ``family`` overrides only the detection."""
    if args is None:
        raise CheckpointReadError("the checkpoint saved no training arguments (args in common.pt)", path="")
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    experts = get("num_experts") or 0
    if family is None:
        family = ("qwen3_moe" if get("qk_layernorm") else "mixtral") if experts else (
            "qwen2" if get("add_qkv_bias") else "llama")
    if family not in FAMILIES:
        raise ValueError(f"unknown architecture {family!r}: one of {', '.join(FAMILIES)}")
    if experts:
        unsupported = _unsupported_moe_options(get)
        if unsupported:
            raise CheckpointReadError(f"MoE options no Hugging Face {family} model reproduces: "
                                      f"{', '.join(unsupported)}", path="")
    heads = get("num_attention_heads")
    groups = get("num_query_groups") if get("group_query_attention") else heads
    padded = get("padded_vocab_size")
    spec = ArchSpec(
        family=family, num_layers=get("num_layers"), hidden_size=get("hidden_size"), num_heads=heads,
        num_query_groups=groups, head_dim=get("kv_channels") or get("hidden_size") // heads,
        ffn_hidden_size=get("ffn_hidden_size"), vocab_size=get("vocab_size") or padded, padded_vocab_size=padded,
        tie_embeddings=not get("untie_embeddings_and_output_weights", False), num_experts=experts,
        moe_ffn_hidden_size=get("moe_ffn_hidden_size") or 0)
    return ModelDescription(
        spec=spec, norm_epsilon=float(get("norm_epsilon", 1e-5)), rope_theta=float(get("rotary_base", 10000)),
        max_position_embeddings=int(get("max_position_embeddings", 4096)), moe_top_k=int(get("moe_router_topk", 2)),
        dtype=get("params_dtype") or torch.float32)


def _unsupported_moe_options(get: Any) -> list[str]:
    """The saved MoE options (Megatron-LM argument names) that change routing or add parameters
    beyond Mixtral's and Qwen3-MoE's: softmax over all experts then top-k without renormalising
    (pre-softmax), sigmoid scores, scaled or grouped top-k, expert bias, shared experts, dense
    layers between MoE layers."""
    found = []
    if get("moe_router_pre_softmax"):
        found.append("moe_router_pre_softmax")
    if (get("moe_router_score_function") or "softmax") != "softmax":
        found.append(f"moe_router_score_function={get('moe_router_score_function')}")
    for name in ("moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
                 "moe_shared_expert_intermediate_size", "moe_router_num_groups"):
        if get(name):
            found.append(name)
    frequency = get("moe_layer_freq", 1)
    if not (frequency in (1, None) or (isinstance(frequency, list) and set(frequency) == {1})):
        found.append(f"moe_layer_freq={get('moe_layer_freq')}")
    return found
