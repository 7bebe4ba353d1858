"""Weight versions without files: the trainer's buckets handed over in shared memory.

Knows the bucket format (``weight_buckets``) and the wire contract; not Ray (the object store sits
behind the two small Protocols below, implemented in ``rollmesh/actors/weight_object_store.py``).
The trainer serialises a version once (``serialize_into_memory``: the bucket bytes are copied
into the store of its node while they are hashed, then the manifest follows), and announces
``WeightsPublished`` with ``memory_holder`` and ``memory_node`` set besides the usual ``path``. An
inference worker on that node reads the same bytes from shared memory: the manifest checked
against the message's sha256, each bucket against the manifest's (on a few threads), exactly as
on the file path, with no disk write, fsync or read in between. A version is staged only once
every bucket passed, so it activates whole or not at all.
Anywhere the memory copy cannot serve (another node, a restarted trainer whose objects are gone, a
worker catching up on an old version) the worker reads ``path``.

``trainer.weight_sync`` picks the method (``resolve_weight_sync``):

- ``"files"``: buckets on disk only (the durable path; what a restart reads);
- ``"memory"``: the object store for workers on the trainer's node, files for the rest;
- ``"nccl"``: with ``inference.backend = "sglang"``, each durable version is broadcast into the
  SGLang servers (``sglang_weight_sync.SGLangWeightPush``; over gloo on a machine without CUDA)
  before it is announced; its files are written first and stay the fallback;
- ``"ipc"``: the same for SGLang servers colocated with the trainer (on its GPUs): the tensors
  are shared by CUDA IPC handles (``/update_weights_from_tensor``), nothing is copied;
- ``"auto"``: ``"nccl"`` on CUDA with SGLang servers, ``"memory"`` on CUDA otherwise, else
  ``"files"``: on CPU a training step takes seconds, so the announcement-before-durability trade
  (below) is not worth making there by default, and the file path is what every other CPU test
  exercises. ``"ipc"`` is never chosen by ``"auto"``: only the operator knows the servers share
  the trainer's GPUs.

In ``"memory"`` mode the version is announced once it is in shared memory and before its files are
durable: the files, then the ledger line, follow. A trainer that dies in between leaves a version
announced that no ledger holds; the resumed trainer numbers its next version past the newest one
announced (``TrainerLogic.start``), so no version number ever names two different weights.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from rollmesh.engine.errors import WeightsUnavailableError
from rollmesh.engine.weight_buckets import (
    SerializedWeights,
    decode_bucket_parts,
    decode_manifest,
    map_threads,
    serialize_buckets,
)
from rollmesh.messages import WeightsPublished

if TYPE_CHECKING:  # tensors only pass through here; weight_buckets imports torch where it makes them
    import torch

WeightSync = Literal["auto", "files", "memory", "nccl", "ipc"]


def resolve_weight_sync(setting: WeightSync, *, cuda: bool,
                        sglang: bool = False) -> Literal["files", "memory", "nccl", "ipc"]:
    """What ``trainer.weight_sync`` means here (``sglang``: the mesh's engines are SGLang servers)."""
    if setting == "auto":
        return ("nccl" if sglang else "memory") if cuda else "files"
    return setting


@dataclass(frozen=True)
class MemoryLocation:
    holder: str  # who answers for the objects (a Ray actor name)
    node: str  # the node whose shared memory holds them


class HoldsWeightBuckets(Protocol):
    """The trainer's side: keeps the newest versions' bytes in shared memory."""

    def put_buckets(self, version: int, buckets: list[list[np.ndarray]]) -> None:
        """The buckets' parts (``bucket_parts``), before their hashes are known."""
        ...

    def put(self, serialized: SerializedWeights) -> MemoryLocation:
        """The version complete: its manifest, and whatever ``put_buckets`` did not put."""
        ...


def serialize_into_memory(state_dict: Mapping[str, torch.Tensor], holder: HoldsWeightBuckets, *, version: int,
                          bucket_bytes: int) -> tuple[SerializedWeights, MemoryLocation]:
    """Serialise a version into ``holder``: its buckets are copied into shared memory while they
    are hashed (the two take about as long), then the manifest follows."""
    serialized = serialize_buckets(state_dict, version=version, bucket_bytes=bucket_bytes,
                                   alongside=lambda buckets: holder.put_buckets(version, buckets))
    return serialized, holder.put(serialized)


class FetchesWeightBuckets(Protocol):
    """An inference worker's side: the manifest and bucket buffers of an announced version."""

    def reachable(self, message: WeightsPublished) -> bool:
        """Whether the message's memory copy is on this worker's node."""
        ...

    def fetch(self, message: WeightsPublished) -> tuple[object, Sequence[Sequence[object]]]:
        """(manifest buffer, each bucket's parts in manifest order, as ``SerializedWeights`` holds
        them); blocking. Raises ``WeightsUnavailableError``."""
        ...


@dataclass(frozen=True)
class MemoryLoad:
    state_dict: dict[str, torch.Tensor]  # views of shared memory: copy before writing
    fetch_s: float
    verify_s: float


def load_from_memory(message: WeightsPublished, source: FetchesWeightBuckets) -> MemoryLoad:
    """The announced version's state dict from shared memory, every byte sha256-checked (the
    buckets on a few threads at once)."""
    if not message.memory_holder:
        raise WeightsUnavailableError(message.version, "announced with files only")
    started = time.perf_counter()
    manifest_buffer, bucket_buffers = source.fetch(message)
    fetched = time.perf_counter()
    where = f"{message.memory_holder}:v{message.version}"
    manifest = decode_manifest(memoryview(manifest_buffer).cast("B"), message.sha256, where=where)
    if len(bucket_buffers) != len(manifest.buckets):
        raise WeightsUnavailableError(message.version, f"{len(bucket_buffers)} buckets held, "
                                                       f"the manifest names {len(manifest.buckets)}")
    state: dict[str, torch.Tensor] = {}
    for tensors in map_threads(lambda held: decode_bucket_parts(held[1], held[0], where=f"{where}/{held[0].file}"),
                               list(zip(manifest.buckets, bucket_buffers))):
        state.update(tensors)
    return MemoryLoad(state, fetched - started, time.perf_counter() - fetched)
