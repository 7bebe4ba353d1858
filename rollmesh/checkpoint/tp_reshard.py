"""Resharding a ``torch_dist`` checkpoint to another tensor-parallel degree, written in Megatron's
per-rank layout (``mp_rank_TT/model_optim_rng.pt``), one rank's shards at a time.

Knows the torch_dist reader (whose ``read_region`` is box intersection over the stored chunks),
how Megatron splits each parameter over ranks (the inverse of ``legacy_reader``'s merges) and the
atomic directory. Each rank's box of each tensor is read straight from the stored chunks, so no
global tensor is ever assembled: memory holds one rank's shards. Rank boxes, by parameter:
column-parallel rows (QKV: whole query groups; vocabulary tables), row-parallel columns
(``linear_proj``, ``linear_fc2``), SwiGLU ``linear_fc1`` as two boxes (rank r's rows of the gate
half and of the up half), and everything else replicated.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rollmesh.checkpoint.arch_maps import ArchSpec
from rollmesh.checkpoint.atomic_dir import staged_directory
from rollmesh.checkpoint.chunk_geometry import Box
from rollmesh.checkpoint.legacy_reader import RANK_FILE
from rollmesh.checkpoint.torch_dist_reader import TorchDistCheckpoint, layer_sources

_ROWS = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "word_embeddings.weight",
         "output_layer.weight")
_COLUMNS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def rank_boxes(name: str, whole: Box, rank: int, tp: int, *, stacked: bool = False) -> list[Box]:
    """The boxes of ``whole`` (one tensor, or with ``stacked`` one layer of a layer-stacked one,
    whose leading layer axis is kept) that rank ``rank`` of ``tp`` holds, in the order its shard
    concatenates them."""
    lead = 1 if stacked else 0

    def part(axis: int, start: int, size: int) -> Box:
        offsets, sizes = list(whole.offsets), list(whole.sizes)
        offsets[axis], sizes[axis] = whole.offsets[axis] + start, size
        return Box(tuple(offsets), tuple(sizes))

    if name.endswith("mlp.linear_fc1.weight"):
        half = whole.sizes[lead] // 2
        step = _step(name, half, tp)
        return [part(lead, rank * step, step), part(lead, half + rank * step, step)]
    if name.endswith(_ROWS):
        step = _step(name, whole.sizes[lead], tp)
        return [part(lead, rank * step, step)]
    if name.endswith(_COLUMNS):
        step = _step(name, whole.sizes[lead + 1], tp)
        return [part(lead + 1, rank * step, step)]
    return [whole]


def _step(name: str, size: int, tp: int) -> int:
    if size % tp:
        raise ValueError(f"{name}: {size} does not split over {tp} tensor-parallel ranks")
    return size // tp


def reshard_torch_dist(src: str | Path, dst: str | Path, spec: ArchSpec, *, tp: int, args: Any) -> list[str]:
    """Write ``dst`` as ``tp`` per-rank files; returns their relative paths."""
    if spec.num_query_groups % tp:
        raise ValueError(f"{spec.num_query_groups} query groups do not split over {tp} tensor-parallel ranks")
    if spec.num_experts:
        raise ValueError("resharding MoE checkpoints is not supported yet")
    checkpoint = TorchDistCheckpoint(src)
    checkpoint.check()
    sources = layer_sources(checkpoint)
    rank_args = _with_tp(args, tp)
    written = []
    with staged_directory(Path(dst)) as staging:
        for rank in range(tp):
            model: dict[str, torch.Tensor] = {}
            for name, source in sources.items():
                parts = [checkpoint.read_region(source.stored, part)
                         for part in rank_boxes(name, source.box, rank, tp, stacked=source.stacked)]
                shard = torch.cat(parts, dim=1 if source.stacked else 0) if len(parts) > 1 else parts[0]
                model[name] = (shard[0] if source.stacked else shard).contiguous()
            folder = staging / f"mp_rank_{rank:02d}"
            folder.mkdir()
            torch.save({"model": model, "args": rank_args, "iteration": 0}, folder / RANK_FILE)
            written.append(f"{folder.name}/{RANK_FILE}")
    return written


def _with_tp(args: Any, tp: int) -> Any:
    """The saved arguments, saying the new tensor-parallel degree (a copy; None stays None)."""
    if isinstance(args, Mapping):  # a front end that saves a plain dict
        return {**args, "tensor_model_parallel_size": tp}
    if args is None or not hasattr(args, "__dict__"):
        return args
    copied = copy.copy(args)
    copied.tensor_model_parallel_size = tp
    return copied
