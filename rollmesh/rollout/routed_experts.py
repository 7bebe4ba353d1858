"""Routed-expert rows in memory: ``InMemoryRoutedExperts`` implements
``rollmesh.ports.RoutedExpertsStore`` for in-process runs and tests; the mesh uses the JetStream
object store (``rollmesh.bus.routed_experts_store``). Both keep one blob per turn in the format of
``rollmesh.routed_expert_rows``, which also holds how turns join.

Knows numpy; nothing of NATS. The blob format and ``RoutedExpertsError`` used to live here: the
old names warn (DeprecationWarning) for one release.
"""

from __future__ import annotations

import numpy as np

from rollmesh import routed_expert_rows
from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {
    name: "rollmesh.routed_expert_rows"
    for name in ("RoutedExpertsError", "encode_rows", "decode_rows", "join_turns", "rollout_ref")
})


class InMemoryRoutedExperts:
    """Routed-expert rows in a dict, lost with the process: in-process runs and tests only."""

    def __init__(self) -> None:
        self.blobs: dict[str, dict[int, bytes]] = {}

    async def save_turn(self, rollout_id: str, turn: int, start: int, rows: np.ndarray) -> str:
        self.blobs.setdefault(rollout_id, {})[turn] = routed_expert_rows.encode_rows(start, rows)
        return routed_expert_rows.rollout_ref("memory", rollout_id)

    async def load(self, ref: str) -> np.ndarray:
        _, _, rollout_id = ref.partition("/")
        blobs = self.blobs.get(rollout_id, {}).values()
        return routed_expert_rows.join_turns([routed_expert_rows.decode_rows(blob) for blob in blobs])
