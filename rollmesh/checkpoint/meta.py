"""What every checkpoint reader returns beside the tensors (step, weight version, model config),
and how the JSON files beside the tensors are read.

Knows msgspec only. Unknown fields are tolerated, so a newer writer's ``meta.json`` still reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import msgspec

from rollmesh.checkpoint.errors import CheckpointReadError

S = TypeVar("S")


def read_json_struct(path: Path, struct_type: type[S]) -> S:
    """Decode a checkpoint's JSON file; unreadable or malformed -> ``CheckpointReadError``."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=struct_type)
    except OSError as exc:
        raise CheckpointReadError(f"no readable {path.name}: {exc}", path=str(path.parent)) from exc
    except msgspec.DecodeError as exc:
        raise CheckpointReadError(f"bad {path.name}: {exc}", path=str(path.parent)) from exc


class CheckpointMeta(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    weight_version: int
    model_config: dict[str, Any] = {}
