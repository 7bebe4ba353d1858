"""Checkpoint events. Knows msgspec only."""

from __future__ import annotations

from typing import Literal

from rollmesh.messages.base import WireMessage

# How the checkpoint on disk is laid out, so the resharder knows which reader to use.
CheckpointFormat = Literal["torch", "megatron_torch_dist", "megatron_legacy"]


class CheckpointSaved(WireMessage, frozen=True, tag="ckpt.saved"):
    step: int
    weight_version: int
    path: str
    format: CheckpointFormat
    model_config: dict[str, int | float | str | bool] = {}


class CheckpointConverted(WireMessage, frozen=True, tag="ckpt.converted"):
    step: int
    weight_version: int
    source_path: str
    hf_path: str
    files: list[str]
    num_bytes: int


class CheckpointConversionFailed(WireMessage, frozen=True, tag="ckpt.failed"):
    """A saved checkpoint that cannot be converted as it is (missing, corrupt, not an
    architecture the maps know, or too large for the memory budget): retrying would fail the same
    way, so the resharder says why once and moves on."""

    step: int
    weight_version: int
    source_path: str
    format: CheckpointFormat
    error_type: str  # the exception's class, e.g. CheckpointReadError or TaskTooLargeError
    reason: str
