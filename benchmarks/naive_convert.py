"""The naive single-process converter ``convert_throughput.py`` measures against.

What the public single-process converters do: load the whole torch_dist checkpoint into one
process with torch's own DCP loader (as ``torch.distributed.checkpoint.format_utils.
dcp_to_torch_save`` does), map every tensor to its HF names with the same architecture maps,
and save it all with ``write_hf_checkpoint`` (the same shards, sha256 manifest and fsyncs as
ours). Its memory is the whole model, plus the mapped copy.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from rollmesh.checkpoint.arch_maps import build_arch_map
from rollmesh.checkpoint.hf_writer import write_hf_checkpoint
from rollmesh.checkpoint.megatron_export import inspect_source
from rollmesh.checkpoint.megatron_to_hf import hf_config
from rollmesh.checkpoint.torch_dist_reader import TorchDistCheckpoint, layer_sources


def naive_convert(src: Path, dst: Path, max_shard_bytes: int = 5 << 30) -> None:
    source = inspect_source(src)
    model = source.model
    loaded: dict[str, object] = {}
    _load_state_dict(loaded, storage_reader=FileSystemReader(str(source.folder)),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    arch = build_arch_map(model.spec)
    state: dict[str, torch.Tensor] = {}
    for name, where in layer_sources(TorchDistCheckpoint(source.folder)).items():
        whole = loaded[where.stored]
        assert isinstance(whole, torch.Tensor)
        part = whole[tuple(slice(o, o + s) for o, s in zip(where.box.offsets, where.box.sizes))]
        state.update(arch.to_hf(name, part.reshape(part.shape[int(where.stacked):])))
    config = hf_config(model.spec, norm_epsilon=model.norm_epsilon, rope_theta=model.rope_theta,
                       max_position_embeddings=model.max_position_embeddings, dtype=model.dtype,
                       moe_top_k=model.moe_top_k)
    write_hf_checkpoint(state, dst, max_shard_bytes=max_shard_bytes, config=config)
