"""Which of a run's full checkpoints to keep (``trainer.keep_checkpoints``).

Knows the checkpoint directory's layout (Megatron-LM's ``iter_NNNNNNN`` folders and the trainer's
``step_NNNNNNNN.trainer_state.pt`` files beside them); nothing of their contents.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

_ITERATION = re.compile(r"^iter_(\d+)$")
_STATE = re.compile(r"^step_(\d+)\.trainer_state\.pt$")


def prune_checkpoints(checkpoint_dir: Path, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` checkpoints (0: keep all); returns the steps removed.
    A step's weights folder and its training state go together; the newest is never removed, so
    ``latest_checkpointed_iteration.txt`` always names a folder that exists."""
    checkpoint_dir = Path(checkpoint_dir)
    if keep <= 0 or not checkpoint_dir.is_dir():
        return []
    found: dict[int, list[Path]] = {}
    for path in checkpoint_dir.iterdir():
        match = _ITERATION.match(path.name) or _STATE.match(path.name)
        if match:
            found.setdefault(int(match.group(1)), []).append(path)
    removed = sorted(found)[:-keep]
    for step in removed:
        for path in found[step]:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    return removed
