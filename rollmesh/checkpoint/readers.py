"""Checkpoint readers by format: the one place that maps a ``CheckpointFormat`` to code.

Knows the reader functions, not what they read or who asks. Only ``"torch"`` (the format the
trainer saved the tiny model of older runs in; nothing writes it now) is read whole into a state
dict here. The Megatron formats (``torch_dist`` DCP and
legacy ``mp_rank_XX``) are converted by ``megatron_export``, which never holds a whole model;
asking this registry for them fails with a typed error instead of a KeyError.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import Tensor

from rollmesh.checkpoint.errors import UnsupportedCheckpointFormatError
from rollmesh.checkpoint.meta import CheckpointMeta
from rollmesh.checkpoint.torch_format import load_torch_checkpoint

CheckpointReader = Callable[[Path], tuple[dict[str, Tensor], CheckpointMeta]]

_READERS: dict[str, CheckpointReader] = {
    "torch": load_torch_checkpoint,
    # "megatron_torch_dist" and "megatron_legacy": see megatron_export (planned, bounded).
}


def supported_formats() -> list[str]:
    return sorted(_READERS)


def read_checkpoint(
    path: Path,
    format: str,  # noqa: A002 - the wire field's name
) -> tuple[dict[str, Tensor], CheckpointMeta]:
    """Read the checkpoint at ``path`` with the reader registered for ``format``."""
    reader = _READERS.get(format)
    if reader is None:
        raise UnsupportedCheckpointFormatError(format=format, path=str(path))
    return reader(Path(path))
