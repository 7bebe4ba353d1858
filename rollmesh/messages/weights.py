"""Weight-version events. Knows msgspec only.

Events carry a reference (a safetensors file) and its checksum, never tensors.
"""

from __future__ import annotations

from rollmesh.messages.base import WireMessage


class WeightsPublished(WireMessage, frozen=True, tag="weights.published"):
    version: int
    path: str
    sha256: str
    num_bytes: int
    trainer_step: int = 0
    published_at: float = 0.0
    # Where the publication's time went: copying the weights off the model, then writing them.
    gather_s: float = 0.0
    write_s: float = 0.0


class WeightsActivated(WireMessage, frozen=True, tag="weights.activated"):
    """An inference worker swapped to ``version`` at a step boundary, with requests in flight kept."""

    version: int
    worker: str
    role: str
    in_flight: int = 0
    # Reading, verifying and staging the version while generation went on (the swap itself is
    # the pause, at the next step boundary).
    load_s: float = 0.0
    activated_at: float = 0.0
