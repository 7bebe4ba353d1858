"""The trainer's published weights as a Hugging Face directory SGLang can load from disk.

Knows safetensors and the layout of a model directory; knows nothing of HTTP, SGLang's servers or
NATS. ``/update_weights_from_disk`` takes a directory like the one a server was launched from: the
original's config, tokenizer and generation files (linked, never copied) and the new tensors in
one ``model.safetensors``. The published state dict is the engine's, whose names are the
checkpoint's own (rollmesh's models load hub checkpoints without renaming). This is the file
path, the fallback; weight sync without files belongs to ``sglang_client``'s update methods.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rollmesh.engine.errors import WeightsError

# Tensors only pass through here (the SGLang servers hold the model); torch and safetensors' torch
# writer are imported where a version is written, so the worker's module imports without them.
if TYPE_CHECKING:
    import torch

# Files of the model directory that the new directory must not inherit: the old tensors.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
VERSION_PREFIX = "v"


def write_hf_weights(state_dict: Mapping[str, torch.Tensor], *, model_dir: str | Path,
                     out_root: str | Path, version: int, keep: int = 2) -> Path:
    """Write ``state_dict`` as ``<out_root>/v<version>`` and return it; older versions beyond the
    newest ``keep`` are removed (a server may still be reading the previous one)."""
    from safetensors.torch import save_file

    model_dir, out_root = Path(model_dir), Path(out_root)
    if not (model_dir / "config.json").is_file():
        raise WeightsError(f"{model_dir} has no config.json to serve the new weights with",
                           version=version, path=str(model_dir))
    final = out_root / f"{VERSION_PREFIX}{version}"
    staging = out_root / f".{VERSION_PREFIX}{version}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for entry in model_dir.iterdir():
        if entry.is_file() and not entry.name.endswith(_WEIGHT_SUFFIXES) and entry.name not in _WEIGHT_INDEXES:
            os.symlink(entry.resolve(), staging / entry.name)
    # safetensors refuses tensors that share memory (tied embeddings): give each its own copy.
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in state_dict.items()}
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)  # a directory SGLang is told about is always whole
    _prune(out_root, keep)
    return final


def _prune(out_root: Path, keep: int) -> None:
    versions = sorted((int(p.name[len(VERSION_PREFIX):]), p) for p in out_root.iterdir()
                      if p.is_dir() and p.name.startswith(VERSION_PREFIX) and p.name[1:].isdigit())
    for _, path in versions[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


class SGLangDiskWeights:
    """``WeightFollower``'s engine for SGLang servers: a published version is written as a model
    directory (``stage_weights``, in the follower's thread), then the servers are paused, load it
    without a cache flush and continue (``wait_weights_activated``; ``SGLangEngine.swap_weights_from_disk``).
    """

    def __init__(self, engine, *, model_dir: str | Path, out_root: str | Path,
                 pause_mode: str = "in_place", in_flight: Callable[[], int] = lambda: 0,
                 pushed_version: Callable[[], Awaitable[int]] | None = None) -> None:
        self.engine = engine  # an SGLangEngine (duck-typed: swap_weights_from_disk)
        # The servers' label asked afresh (``SGLangEngine.current_version``: the oldest of them).
        self.pushed_version = pushed_version
        self._in_flight = in_flight
        self.model_dir = Path(model_dir)
        self.out_root = Path(out_root)
        self.pause_mode = pause_mode
        self._current = 0
        self._staged: tuple[int, Path] | None = None

    @property
    def current_version(self) -> int:
        return self._current

    def set_current_version(self, version: int) -> None:
        """The servers' own label when attached to or launched (``SGLangEngine.current_version``)."""
        self._current = version

    async def adopt_pushed(self, version: int) -> bool:
        """Whether every server already runs ``version``, pushed by the trainer without files
        (``sglang_weight_sync``: the label is set with a push's last bucket, so a server labelled
        with it holds all of it); then it is this worker's current version, and nothing is loaded."""
        if self.pushed_version is None:
            return False
        labelled = await self.pushed_version()
        if labelled < version:
            return False
        self._current = max(self._current, labelled)
        return True

    def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool:
        if version <= self._current:
            return False
        path = write_hf_weights(state_dict, model_dir=self.model_dir, out_root=self.out_root,
                                version=version)
        self._staged = (version, path)
        return True

    async def wait_weights_activated(self, version: int) -> int:
        if self._staged is not None and self._staged[0] == version:
            _, path = self._staged
            await self.engine.swap_weights_from_disk(str(path), version, pause_mode=self.pause_mode)
            self._current, self._staged = version, None
        return self._current

    def num_active(self) -> int:
        return self._in_flight()  # requests this worker has in flight at SGLang
