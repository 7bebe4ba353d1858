"""Reads Megatron-LM's legacy per-rank checkpoints: ``mp_rank_TT[_PPP]/model_optim_rng.pt``.

Knows that layout and how Megatron splits each parameter over tensor-parallel ranks; nothing of
files beyond ``torch.load``. Each rank's file holds its local shards (``model``) and the training
``args``. Merging them into global tensors, by parameter:
- column-parallel (split on dim 0): QKV weight and bias (whole query groups per rank, so the
  per-group interleave survives concatenation), word embeddings and output layer (vocabulary);
- SwiGLU ``linear_fc1``: each rank holds its own ``[gate_r; up_r]``, so gates and ups are
  gathered separately and joined as ``[gate; up]``;
- row-parallel (split on dim 1): ``linear_proj`` and ``linear_fc2``;
- everything else (norms, the router) is replicated: rank 0's copy.
Pipeline stages hold consecutive layers; their local layer numbers are made global. Expert
parallelism (``mp_rank_TT_PPP_EEE``) is not read yet and is refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from rollmesh.checkpoint.arch_maps import canonical_megatron_name
from rollmesh.checkpoint.errors import CheckpointReadError, UnsupportedCheckpointFormatError
from rollmesh.checkpoint.layout_transforms import join_gate_up, split_gate_up

RANK_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_DIM0 = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "word_embeddings.weight",
         "output_layer.weight")
_DIM1 = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


class LegacyCheckpoint:
    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files: dict[tuple[int, int], Path] = {}
        for directory in sorted(self.folder.glob("mp_rank_*")):
            match = _RANK_DIR.match(directory.name)
            if match is None:
                continue
            if match.group(3) is not None:
                raise UnsupportedCheckpointFormatError(format="megatron_legacy with expert parallelism",
                                                       path=str(directory))
            self.files[(int(match.group(1)), int(match.group(2) or 0))] = directory / RANK_FILE
        if not self.files:
            raise CheckpointReadError("no mp_rank_* folders", path=str(self.folder))
        self.tp = 1 + max(tp for tp, _ in self.files)
        self.pp = 1 + max(pp for _, pp in self.files)
        missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else "")
                   for t in range(self.tp) for p in range(self.pp) if (t, p) not in self.files]
        if missing:
            raise CheckpointReadError(f"rank folders missing: {', '.join(missing)}", path=str(self.folder))

    def args(self) -> Any:
        return self._load(self.files[(0, 0)]).get("args")

    def global_state(self) -> dict[str, torch.Tensor]:
        """Every parameter as a global tensor, under its canonical per-layer Megatron name."""
        state: dict[str, torch.Tensor] = {}
        layers_before = 0
        for stage in range(self.pp):
            shards = [self._load(self.files[(tp, stage)])["model"] for tp in range(self.tp)]
            stage_layers = 0
            for name, first in shards[0].items():
                if not isinstance(first, torch.Tensor) or name.endswith("_extra_state"):
                    continue
                merged = _merge(name, [shard[name] for shard in shards])
                layer = _LAYER.match(name)
                if layer is not None:
                    stage_layers = max(stage_layers, int(layer.group(1)) + 1)
                    name = _LAYER.sub(f"decoder.layers.{int(layer.group(1)) + layers_before}.", name)
                state[canonical_megatron_name(name)] = merged
            layers_before += stage_layers
        return state

    def _load(self, path: Path) -> dict[str, Any]:
        try:
            loaded = torch.load(path, weights_only=False, map_location="cpu")  # noqa: S614 - a trusted local checkpoint
        except FileNotFoundError as exc:
            raise CheckpointReadError(f"shard file {path.parent.name}/{path.name} is missing", path=str(path)) from exc
        except Exception as exc:  # a damaged file: the loader's errors vary
            raise CheckpointReadError(f"shard file {path.parent.name}/{path.name} is corrupt: {exc!r}",
                                      path=str(path)) from exc
        if not isinstance(loaded, dict) or "model" not in loaded:
            raise CheckpointReadError(f"shard file {path.parent.name}/{path.name} holds no model", path=str(path))
        return loaded


def _merge(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    if len(shards) == 1:
        return shards[0]
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [split_gate_up(shard) for shard in shards]
        return join_gate_up(torch.cat([gate for gate, _ in halves]), torch.cat([up for _, up in halves]))
    if name.endswith(_DIM0):
        return torch.cat(shards, dim=0)
    if name.endswith(_DIM1):
        return torch.cat(shards, dim=1)
    return shards[0]
