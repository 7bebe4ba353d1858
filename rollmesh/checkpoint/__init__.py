"""Checkpoints: the torch format (older runs' checkpoints), readers by format, the Hugging Face
writer and the resharder.

Knows torch, safetensors and the filesystem; never Ray or NATS (the resharder's actor shell owns
those). The Megatron <-> HF architecture maps (``arch_maps``, with their exact tensor transforms
in ``layout_transforms``) are in place; Megatron readers, the planner and parallel resharding plug
in behind ``read_checkpoint`` and ``ResharderLogic`` (the resharder role's logic) later.
"""

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
from rollmesh.moved_names import forward_moved_names

# Deprecated: renamed for its role.
__getattr__ = forward_moved_names(__name__, {"CheckpointResharder": "rollmesh.checkpoint.resharder:ResharderLogic"})

__all__ = [
    "CheckpointArgumentError",
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointReadError",
    "CheckpointReader",
    "CheckpointWriteError",
    "ResharderLogic",
    "TaskTooLargeError",
    "UnsupportedCheckpointFormatError",
    "list_hf_files",
    "load_torch_checkpoint",
    "plan_shards",
    "read_checkpoint",
    "read_hf_checkpoint",
    "save_torch_checkpoint",
    "shard_file_name",
    "supported_formats",
    "write_hf_checkpoint",
]
