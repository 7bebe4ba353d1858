"""Reads Megatron-LM's legacy per-rank checkpoints: ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``.

Knows that layout (Megatron-LM's ``checkpointing.get_checkpoint_name``: tensor rank, then the
pipeline rank when pipeline parallel, then the expert rank when expert parallel) and how Megatron
splits each parameter over ranks; nothing of files beyond ``torch.load``. Each rank's file holds
its local shards (``model``) and the training ``args``. Merging them into global tensors:
- column-parallel (split on dim 0): QKV weight and bias (whole query groups per rank, so the
  per-group interleave survives concatenation), word embeddings and output layer (vocabulary);
- SwiGLU ``linear_fc1``, dense or of an expert: each rank holds its own ``[gate_r; up_r]``, so
  gates and ups are gathered separately and joined as ``[gate; up]``;
- row-parallel (split on dim 1): ``linear_proj`` and every ``linear_fc2``;
- everything else (norms, the router) is replicated: rank 0's copy.
Experts are tensor-parallel like the dense MLP (expert tensor parallel = tensor parallel, the
default; another degree is refused). Expert rank r holds local experts 0..n-1, the global experts
r*n..r*n+n-1; every expert rank also holds a copy of the dense parameters (read from rank 0).
Pipeline stages hold consecutive layers; their local layer numbers are made global. A name
``mp_rank_TT_NNN`` is a pipeline rank unless the saved args say expert parallel without pipeline.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from rollmesh.checkpoint.arch_maps import canonical_megatron_name
from rollmesh.checkpoint.errors import CheckpointReadError, UnsupportedCheckpointFormatError
from rollmesh.checkpoint.layout_transforms import join_gate_up, split_gate_up
from rollmesh.checkpoint.saved_arguments import SavedArguments

RANK_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts)\.(\d+)\.")
_DIM0 = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "word_embeddings.weight",
         "output_layer.weight")
_DIM1 = ("self_attention.linear_proj.weight", "linear_fc2.weight")


class LegacyCheckpoint:
    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._args: Any = None
        self._args_read = False
        named: dict[tuple[int, ...], Path] = {}
        for directory in sorted(self.folder.glob("mp_rank_*")):
            match = _RANK_DIR.match(directory.name)
            if match is not None:
                named[tuple(int(n) for n in match.groups() if n is not None)] = directory / RANK_FILE
        if not named:
            raise CheckpointReadError("no mp_rank_* folders", path=str(self.folder))
        if len({len(numbers) for numbers in named}) > 1:
            raise CheckpointReadError("rank folders name different parallel layouts", path=str(self.folder))
        self.files = {self._ranks(numbers, named): path for numbers, path in named.items()}
        self.tp, self.pp, self.ep = (1 + max(ranks[axis] for ranks in self.files) for axis in range(3))
        missing = [self._folder_name(t, p, e) for t in range(self.tp) for p in range(self.pp)
                   for e in range(self.ep) if (t, p, e) not in self.files]
        if missing:
            raise CheckpointReadError(f"rank folders missing: {', '.join(missing)}", path=str(self.folder))
        saved = SavedArguments(self.args(), path=str(self.folder))
        expert_tp = saved.optional_int("expert_tensor_parallel_size") if self.ep > 1 else None
        if expert_tp not in (None, self.tp):
            raise UnsupportedCheckpointFormatError(
                format=f"megatron_legacy with expert tensor parallel {expert_tp} != tensor parallel {self.tp}",
                path=str(self.folder))

    def _ranks(self, numbers: tuple[int, ...], named: dict[tuple[int, ...], Path]) -> tuple[int, int, int]:
        """(tensor, pipeline, expert) rank of a folder's numbers."""
        if len(numbers) == 3:
            return numbers  # type: ignore[return-value]
        if len(numbers) == 1:
            return numbers[0], 0, 0
        # mp_rank_TT_NNN: pipeline or expert rank; only the saved args tell (Megatron-LM's own
        # loader asks its args too). A dense model's are pipeline ranks, whatever its (unused,
        # perhaps None) expert options say.
        saved = SavedArguments(self._first_args(named[min(named)]), path=str(self.folder))
        expert_only = (bool(saved.optional_int("num_experts", minimum=0))
                       and saved.required_int("expert_model_parallel_size", default=1) > 1
                       and (saved.optional_int("pipeline_model_parallel_size") or 1) == 1)
        return (numbers[0], 0, numbers[1]) if expert_only else (numbers[0], numbers[1], 0)

    def _folder_name(self, tp: int, pp: int, ep: int) -> str:
        return f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if self.pp > 1 else "") + (f"_{ep:03d}" if self.ep > 1 else "")

    def args(self) -> Any:
        return self._first_args(self.files[(0, 0, 0)])

    def _first_args(self, path: Path) -> Any:
        """The args of rank 0's file (every rank saves the same), loaded once: the file holds
        that rank's whole model too."""
        if not self._args_read:
            self._args, self._args_read = self._load(path).get("args"), True
        return self._args

    def global_state(self) -> dict[str, torch.Tensor]:
        """Every parameter as a global tensor, under its canonical per-layer Megatron name (experts
        under their global ids). Memory holds one stage's and expert rank's TP files at a time."""
        state: dict[str, torch.Tensor] = {}
        layers_before = 0
        for stage in range(self.pp):
            stage_layers = 0
            for expert_rank in range(self.ep):
                shards = [self._load(self.files[(tp, stage, expert_rank)])["model"] for tp in range(self.tp)]
                named = {canonical_megatron_name(name): name for name, first in shards[0].items()
                         if isinstance(first, torch.Tensor) and not name.endswith("_extra_state")}
                local_experts = {int(m.group(2)) for m in map(_LOCAL_EXPERT.match, named) if m is not None}
                for name, stored in named.items():
                    is_expert = _LOCAL_EXPERT.match(name) is not None
                    if expert_rank > 0 and not is_expert:
                        continue  # dense parameters: every expert rank holds the same copy
                    merged = _merge(name, [shard[stored] for shard in shards])
                    if is_expert:  # local expert i of expert rank r is global expert r * n + i
                        name = _LOCAL_EXPERT.sub(
                            lambda m: f"{m.group(1)}.{expert_rank * len(local_experts) + int(m.group(2))}.", name)
                    layer = _LAYER.match(name)
                    if layer is not None:
                        stage_layers = max(stage_layers, int(layer.group(1)) + 1)
                        name = _LAYER.sub(f"decoder.layers.{int(layer.group(1)) + layers_before}.", name)
                    state[name] = merged
                del shards
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
    """One global tensor from its TP shards; ``name`` is canonical (dense or expert)."""
    if len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [split_gate_up(shard) for shard in shards]
        return join_gate_up(torch.cat([gate for gate, _ in halves]), torch.cat([up for _, up in halves]))
    if name.endswith(_DIM0):
        return torch.cat(shards, dim=0)
    if name.endswith(_DIM1):
        return torch.cat(shards, dim=1)
    return shards[0]
