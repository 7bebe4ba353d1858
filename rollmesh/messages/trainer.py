"""Trainer events. Knows msgspec only."""

from __future__ import annotations

from rollmesh.messages.base import WireMessage


class TrainerStepped(WireMessage, frozen=True, tag="trainer.stepped"):
    step: int
    weight_version: int
    loss: float
    reward_mean: float
    num_samples: int
    num_groups: int
    # Version lag of the generated tokens that were trained on (max over the batch).
    max_version_lag: int = 0
    dropped_stale: int = 0
    duration_s: float = 0.0
