"""The plain torch checkpoint format: a directory with ``model.pt`` and ``meta.json``.

Knows torch, msgspec and the filesystem; not Megatron, not Hugging Face, not who saves or reads.
``model.pt`` is ``torch.save`` of the state dict; ``meta.json`` is a ``CheckpointMeta``. The
directory is published atomically, so a reader never sees half a checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import Tensor

from rollmesh.checkpoint.atomic_dir import staged_directory
from rollmesh.checkpoint.errors import CheckpointReadError, CheckpointWriteError
from rollmesh.checkpoint.meta import CheckpointMeta, read_json_struct

MODEL_FILE = "model.pt"
META_FILE = "meta.json"


def save_torch_checkpoint(
    path: Path,
    state_dict: dict[str, Tensor],
    *,
    model_config: dict[str, Any],
    step: int,
    weight_version: int,
) -> Path:
    """Write the checkpoint directory at ``path`` (replacing one already there); return ``path``."""
    path = Path(path)
    if not all(isinstance(tensor, Tensor) for tensor in state_dict.values()):
        raise CheckpointWriteError("state dict values must all be tensors", path=str(path))
    meta = CheckpointMeta(step=step, weight_version=weight_version, model_config=dict(model_config))
    try:
        meta_bytes = msgspec.json.encode(meta)
    except (TypeError, msgspec.EncodeError) as exc:
        raise CheckpointWriteError(f"model_config is not JSON: {exc}", path=str(path)) from exc
    with staged_directory(path) as staging:
        try:
            torch.save(dict(state_dict), staging / MODEL_FILE)
        except RuntimeError as exc:  # torch's stream writer reports a full disk this way
            raise CheckpointWriteError(f"torch.save failed: {exc}", path=str(path)) from exc
        (staging / META_FILE).write_bytes(meta_bytes)
    return path


def load_torch_checkpoint(path: Path) -> tuple[dict[str, Tensor], CheckpointMeta]:
    """Read a directory written by ``save_torch_checkpoint``; tensors land on the CPU."""
    path = Path(path)
    meta = read_json_struct(path / META_FILE, CheckpointMeta)
    try:
        # weights_only: a checkpoint path arrives in a wire message, and a full unpickle would
        # run whatever code the file names.
        loaded = torch.load(path / MODEL_FILE, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointReadError(f"no {MODEL_FILE}", path=str(path)) from exc
    except Exception as exc:  # torch raises several unrelated types for a corrupt file
        raise CheckpointReadError(f"bad {MODEL_FILE}: {exc}", path=str(path)) from exc
    if not isinstance(loaded, dict) or not all(
        isinstance(name, str) and isinstance(tensor, Tensor) for name, tensor in loaded.items()
    ):
        raise CheckpointReadError(f"{MODEL_FILE} is not a state dict of tensors", path=str(path))
    return loaded, meta
