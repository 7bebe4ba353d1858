"""Weight files: safetensors written atomically, read back with a sha256 check.

Knows torch, safetensors and the filesystem; not NATS (the trainer publishes path + sha256, the
inference workers load and stage). The file is hashed as written and as read, in memory, so the
checksum covers exactly the bytes a reader parses.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rollmesh.engine.errors import WeightsChecksumError, WeightsFileError


def save_weights(state_dict: Mapping[str, torch.Tensor], path: str | Path) -> tuple[str, int]:
    """Write ``state_dict`` to ``path`` (tmp file + fsync + rename); returns (sha256, num_bytes).

    Readers never see a partial file: the rename is atomic within one filesystem.
    """
    path = Path(path)
    tensors = {name: t.detach().cpu().contiguous() for name, t in state_dict.items()}
    try:
        data = save_safetensors(tensors)
    except (RuntimeError, ValueError, SafetensorError) as exc:  # e.g. tensors sharing storage
        raise WeightsFileError(str(path), f"cannot serialize: {exc}") from exc
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise WeightsFileError(str(path), f"cannot write: {exc}") from exc
        raise
    return hashlib.sha256(data).hexdigest(), len(data)


def load_weights(path: str | Path, expected_sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Read a safetensors file; raises WeightsChecksumError when the sha256 differs from
    ``expected_sha256`` and WeightsFileError when the file is missing or malformed."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise WeightsFileError(str(path), f"cannot read: {exc}") from exc
    if expected_sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected_sha256.lower():
            raise WeightsChecksumError(str(path), expected_sha256, actual)
    try:
        return load_safetensors(data)
    except (SafetensorError, RuntimeError, ValueError) as exc:
        raise WeightsFileError(str(path), f"not a safetensors file: {exc}") from exc
