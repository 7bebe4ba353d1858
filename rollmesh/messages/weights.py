"""Weight-version events. Knows msgspec only.

Events carry references (a bucket manifest's path; the Ray actor holding the same buckets in
its node's shared memory) and checksums, never tensors.
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
    # The same buckets in the Ray object store of node ``memory_node``, held for readers by the Ray
    # actor ``memory_holder`` ("": files only; ``trainer.weight_sync``). A reader on that node
    # fetches them from shared memory and checks them against ``sha256`` as it would the files;
    # any other reader, or one that finds them gone, reads ``path``.
    memory_holder: str = ""
    memory_node: str = ""


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
    # Where the worker read the version: "memory" (shared memory), "files", or "pushed" (the trainer
    # pushed it into the worker's SGLang servers by NCCL broadcast or CUDA IPC before announcing
    # it, trainer.weight_sync); "" from workers that predate the field.
    source: str = ""
    # How long the swap held the engine: the only time generation stopped for this version.
    # Publish -> activated is ``activated_at`` - ``WeightsPublished.published_at``.
    pause_s: float = 0.0
