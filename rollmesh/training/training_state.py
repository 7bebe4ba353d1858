"""The training state saved beside a checkpoint, so a trainer restarted at that step is exact.

Knows torch, the backend's ``training_state`` (optimizer moments, RNG, the KL reference) and the
filesystem; not the bus. One file per checkpointed step, ``step_NNNNNNNN.trainer_state.pt`` in the
checkpoint directory, written atomically after the step's weights, so a state file always has its
step's weights beside it.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any, Protocol

from rollmesh.checkpoint.atomic_dir import write_file_atomically


class StatefulBackend(Protocol):
    def training_state(self) -> dict[str, Any]: ...

    def load_training_state(self, state: dict[str, Any]) -> None: ...


def training_state_path(checkpoint_dir: Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"step_{step:08d}.trainer_state.pt"


def save_training_state(checkpoint_dir: Path, backend: StatefulBackend, *, step: int, version: int) -> None:
    """The optimizer, RNG and position of this step (Python's RNG included)."""
    state = {"step": step, "weight_version": version, "backend": backend.training_state(),
             "python_rng": random.getstate()}
    import torch  # here, not at the top: the trainer's module is imported where no state is saved

    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_file_atomically(training_state_path(checkpoint_dir, step), buffer.getvalue())


def restore_training_state(checkpoint_dir: Path, backend: StatefulBackend, *, step: int, version: int) -> bool:
    """Load the state saved with ``step`` into ``backend`` (after its weights), if there is one
    for that step and version; False when there is none."""
    path = training_state_path(checkpoint_dir, step)
    if not path.is_file():
        return False
    import torch

    state = torch.load(path, weights_only=False)  # noqa: S614 - our own file in the run directory
    if (state["step"], state["weight_version"]) != (step, version):
        return False
    backend.load_training_state(state["backend"])
    random.setstate(state["python_rng"])
    return True
