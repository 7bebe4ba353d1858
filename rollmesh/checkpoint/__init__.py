"""Checkpoints: the torch format (older runs' checkpoints), readers by format, the Hugging Face
writer and the resharder.

Knows torch, safetensors and the filesystem; never Ray or NATS (the resharder's actor shell owns
those). The Megatron <-> HF architecture maps (``arch_maps``, with their exact tensor transforms
in ``layout_transforms``) are in place; Megatron readers, the planner and parallel resharding plug
in behind ``read_checkpoint`` and ``ResharderLogic`` (the resharder role's logic) later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollmesh.moved_names import lazy_exports

# Imported from their modules on first use: the resharder role's process (and anything else that
# only names a checkpoint error or reads meta.json) starts without importing torch, which costs
# seconds of CPU on every mesh start; torch is imported when a checkpoint is first read or written.
if TYPE_CHECKING:
    from rollmesh.checkpoint.errors import (
        CheckpointArgumentError,
        CheckpointError,
        CheckpointReadError,
        CheckpointWriteError,
        TaskTooLargeError,
        UnsupportedCheckpointFormatError,
    )
    from rollmesh.checkpoint.hf_writer import (
        list_hf_files,
        plan_shards,
        read_hf_checkpoint,
        shard_file_name,
        write_hf_checkpoint,
    )
    from rollmesh.checkpoint.meta import CheckpointMeta
    from rollmesh.checkpoint.readers import CheckpointReader, read_checkpoint, supported_formats
    from rollmesh.checkpoint.resharder import ResharderLogic
    from rollmesh.checkpoint.torch_format import load_torch_checkpoint, save_torch_checkpoint

_PUBLIC_MODULES = {
    "CheckpointArgumentError": "rollmesh.checkpoint.errors",
    "CheckpointError": "rollmesh.checkpoint.errors",
    "CheckpointMeta": "rollmesh.checkpoint.meta",
    "CheckpointReadError": "rollmesh.checkpoint.errors",
    "CheckpointReader": "rollmesh.checkpoint.readers",
    "CheckpointWriteError": "rollmesh.checkpoint.errors",
    "ResharderLogic": "rollmesh.checkpoint.resharder",
    "TaskTooLargeError": "rollmesh.checkpoint.errors",
    "UnsupportedCheckpointFormatError": "rollmesh.checkpoint.errors",
    "list_hf_files": "rollmesh.checkpoint.hf_writer",
    "load_torch_checkpoint": "rollmesh.checkpoint.torch_format",
    "plan_shards": "rollmesh.checkpoint.hf_writer",
    "read_checkpoint": "rollmesh.checkpoint.readers",
    "read_hf_checkpoint": "rollmesh.checkpoint.hf_writer",
    "save_torch_checkpoint": "rollmesh.checkpoint.torch_format",
    "shard_file_name": "rollmesh.checkpoint.hf_writer",
    "supported_formats": "rollmesh.checkpoint.readers",
    "write_hf_checkpoint": "rollmesh.checkpoint.hf_writer",
}

__all__ = sorted(_PUBLIC_MODULES)

# Deprecated: renamed for its role.
__getattr__ = lazy_exports(__name__, _PUBLIC_MODULES, cache=globals(),
                           moved={"CheckpointResharder": "rollmesh.checkpoint.resharder:ResharderLogic"})


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
