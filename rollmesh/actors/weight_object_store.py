"""Weight buckets in the Ray object store: the trainer's holder and the inference workers' fetch.

Knows Ray and the engine's ``weight_memory`` seams; not NATS. The trainer ``ray.put``s each
bucket's parts (its header and a uint8 numpy view of each tensor: ``bucket_parts``) as one object,
which Ray copies once into the node's shared memory (plasma; numpy buffers travel out of band) and
hands to readers on that node zero-copy, as a list of read-only arrays. The refs stay in the
trainer (the newest ``keep`` versions): a reader asks the trainer actor for them by name
(``weight_bucket_refs``), so Ray counts the reader as a borrower for as long as it holds them, and
the memory is freed once the trainer lets go of a version and no reader still holds it. Refs are
never serialised into the NATS message: an out-of-band ref would pin its object for the owner's
whole life.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import ray

from rollmesh.engine.errors import WeightsUnavailableError
from rollmesh.engine.weight_buckets import SerializedWeights, map_threads
from rollmesh.engine.weight_memory import MemoryLocation
from rollmesh.messages import WeightsPublished

# Ray errors that mean "the memory copy is not there": the holder died or restarted, the object
# was lost or freed. The worker then reads the files.
_GONE = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError,
         ValueError)


def current_node() -> str:
    return ray.get_runtime_context().get_node_id()


class ObjectStoreWeightHolder:
    """The trainer's side: the newest ``keep`` versions' buckets, put in this node's object store."""

    def __init__(self, holder: str, *, keep: int = 2) -> None:
        self.holder = holder  # the Ray actor name readers ask (``weight_bucket_refs``)
        self.keep = keep
        self._held: OrderedDict[int, list[ray.ObjectRef]] = OrderedDict()
        self._buckets: dict[int, list[ray.ObjectRef]] = {}  # put ahead of their manifest

    def put_buckets(self, version: int, buckets: list[list[np.ndarray]]) -> None:
        # A few puts at once: each is a copy into plasma, and a busy machine gives more threads more.
        self._buckets[version] = map_threads(ray.put, buckets)  # lists of uint8 arrays

    def put(self, serialized: SerializedWeights) -> MemoryLocation:
        buckets = self._buckets.pop(serialized.version, None)
        if buckets is None:
            buckets = map_threads(ray.put, [parts for _, parts in serialized.buckets])
        self._buckets.clear()  # a version whose put_buckets was never completed is let go of
        self._held[serialized.version] = [ray.put(np.frombuffer(serialized.manifest, dtype=np.uint8)), *buckets]
        while len(self._held) > self.keep:
            self._held.popitem(last=False)  # readers that still borrow a ref keep its object alive
        return MemoryLocation(self.holder, current_node())

    def refs(self, version: int) -> list[ray.ObjectRef] | None:
        """The manifest's and the buckets' refs of ``version`` (None: not held)."""
        return self._held.get(version)


class ObjectStoreWeightFetcher:
    """An inference worker's side: fetches an announced version's buffers from its node's store."""

    def __init__(self, *, ray_namespace: str | None = None, timeout_s: float = 120.0) -> None:
        self.ray_namespace = ray_namespace
        self.timeout_s = timeout_s
        self._node: str | None = None
        self._holders: dict[str, object] = {}  # actor handles by name: a lookup is a GCS round trip

    def reachable(self, message: WeightsPublished) -> bool:
        if self._node is None:
            self._node = current_node()
        return bool(message.memory_holder) and message.memory_node == self._node

    def fetch(self, message: WeightsPublished) -> tuple[object, Sequence[object]]:
        try:
            holder = self._holders.get(message.memory_holder)
            if holder is None:
                holder = ray.get_actor(message.memory_holder, namespace=self.ray_namespace)
            try:
                refs = ray.get(holder.weight_bucket_refs.remote(message.version), timeout=self.timeout_s)
            except ray.exceptions.RayActorError:
                self._holders.pop(message.memory_holder, None)  # restarted: looked up again next time
                raise
            self._holders[message.memory_holder] = holder
            if refs is None:
                raise WeightsUnavailableError(message.version, f"{message.memory_holder} no longer holds it")
            # On this node: read-only numpy arrays over the shared memory, no copy.
            arrays = ray.get(list(refs), timeout=self.timeout_s)
        except _GONE as exc:
            raise WeightsUnavailableError(message.version, f"{type(exc).__name__}: {exc}") from exc
        return arrays[0], arrays[1:]
