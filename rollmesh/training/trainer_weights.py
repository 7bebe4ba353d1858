"""The trainer's weight publication: a step's new version written and announced, by file or from
shared memory, and pushed into SGLang servers without files (``trainer.weight_sync``,
``engine/weight_memory.py``).

Knows the engine's bucket format, the memory and push seams and the wire contract; not Ray, not
nats-py, not how the SGLang servers were found. A mixin of ``TrainerLogic``, whose state it uses:
``backend``, ``config``, ``publisher``, ``clock``, ``version``, ``weights_dir``, ``memory``,
``push``, ``latest_weights``, ``_announced`` and ``_last_weights``. ``_commit_step`` (in
``trainer_logic``) orders it with the ledger line: with ``push``, files -> ledger line -> push ->
announcement, so a pushed version is always durable, and a push that fails (a typed
``WeightSyncError``, logged) leaves the announced files as the way the servers get it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import structlog
from opentelemetry import trace

from rollmesh.engine.weight_buckets import (
    MANIFEST_FILE,
    remove_published,
    version_directory,
    write_buckets,
    write_serialized,
)
from rollmesh.engine.errors import WeightSyncError
from rollmesh.engine.weight_memory import serialize_into_memory
from rollmesh.messages import WeightsPublished
from rollmesh.messages.subjects import WEIGHTS_PUBLISHED
from rollmesh.telemetry import conventions

if TYPE_CHECKING:  # the push itself (httpx, torch.distributed) is the actor's to build
    import torch  # tensors pass through: the trainer's module imports without torch

    from rollmesh.engine.sglang_weight_sync import WeightSyncStats

_log = structlog.get_logger("rollmesh.trainer")
_tracer = trace.get_tracer("rollmesh.trainer")

# Weight files older than this many versions behind the newest are deleted.
KEEP_WEIGHT_FILES = 8


class PushesWeights(Protocol):
    """Sends a version into inference servers without files (``SGLangWeightPush``)."""

    method: str  # "nccl" or "ipc"

    async def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> WeightSyncStats:
        """Raises ``WeightSyncError``; the servers then still hold (and label) the previous version."""
        ...


class WeightPublishing:
    async def _push_weights(self, version: int) -> WeightSyncStats | None:
        """Push the durable ``version`` into the servers before it is announced: a worker that
        finds its servers labelled with it loads nothing. None when there is no push or it failed
        (the files announced next are the fallback)."""
        if self.push is None:
            return None
        method = self.push.method
        with _tracer.start_as_current_span("weights_push", attributes={
                "weight_version": version, conventions.RL_WEIGHT_VERSION: version, "method": method}) as span:
            try:
                state = await asyncio.to_thread(self.backend.state_dict)
                stats = await self.push.push(state, version)
            except Exception as exc:  # any failure: the files are there, announced next
                error = exc if isinstance(exc, WeightSyncError) else WeightSyncError(version, method, repr(exc))
                self.push_failures += 1
                span.set_attribute("failed", True)
                _log.warning("weights_push_failed", weight_version=version, method=method, reason=error.reason,
                             fallback="files")
                return None
            span.set_attributes({"pause_s": stats.pause_s, "total_s": stats.total_s, "buckets": stats.buckets})
        _log.info("weights_pushed", weight_version=version, method=method, buckets=stats.buckets,
                  pause_s=round(stats.pause_s, 4), total_s=round(stats.total_s, 4))
        return stats

    async def _number_past_announced(self) -> None:
        """With versions announced before they are durable, one may have been announced and lost
        (killed before its ledger line): the next version must not reuse its number, or two
        different weights would carry it (workers skip a version number they already run)."""
        if self.memory is None or self.latest_weights is None:
            return
        newest = await self.latest_weights()
        if newest is not None and newest.version > self.version:
            _log.warning("trainer_skips_lost_versions", ledger_version=self.version, announced=newest.version)
            self._announced = newest.version

    async def _write_weights(self, trainer_step: int) -> WeightsPublished:
        version = self.version + 1
        with _tracer.start_as_current_span("weights_save", attributes={
                "weight_version": version, conventions.RL_WEIGHT_VERSION: version}) as span:
            published = await asyncio.to_thread(write_buckets, self.backend.state_dict(), self.weights_dir,
                                                version=version, bucket_bytes=self.config.weight_bucket_bytes)
            span.set_attributes({"gather_s": published.gather_s, "write_s": published.write_s})
        return WeightsPublished(version=version, path=str(published.manifest_path), sha256=published.manifest_sha256,
                                num_bytes=published.total_bytes, trainer_step=trainer_step,
                                published_at=self.clock(), gather_s=published.gather_s, write_s=published.write_s)

    async def _publish_weights_in_memory(self, trainer_step: int) -> WeightsPublished:
        """Serialise once, put into shared memory, announce, then write the same bytes to disk."""
        assert self.memory is not None
        version = max(self.version, self._announced) + 1
        with _tracer.start_as_current_span("weights_save", attributes={
                "weight_version": version, conventions.RL_WEIGHT_VERSION: version, "memory": True}) as span:
            serialized, location = await asyncio.to_thread(
                serialize_into_memory, self.backend.state_dict(), self.memory, version=version,
                bucket_bytes=self.config.weight_bucket_bytes)
            span.set_attributes({"gather_s": serialized.gather_s, "write_s": serialized.serialize_s})
        weights = WeightsPublished(
            version=version, path=str(version_directory(self.weights_dir, version) / MANIFEST_FILE),
            sha256=serialized.manifest_sha256, num_bytes=serialized.total_bytes, trainer_step=trainer_step,
            published_at=self.clock(), gather_s=serialized.gather_s, write_s=serialized.serialize_s,
            memory_holder=location.holder, memory_node=location.node)
        with _tracer.start_as_current_span("weights_publish", attributes={
                "weight_version": version, conventions.RL_WEIGHT_VERSION: version}):
            await self.publisher.publish(WEIGHTS_PUBLISHED, weights)
        self._announced = version  # used, even if writing it fails below
        # Durable after the announcement: a worker elsewhere (or one that finds the memory copy
        # gone) reads these files, and a resumed trainer loads them.
        await asyncio.to_thread(write_serialized, serialized, self.weights_dir)
        return weights

    async def _announce(self, weights: WeightsPublished, *, publish: bool = True) -> None:
        if publish:
            with _tracer.start_as_current_span("weights_publish", attributes={
                    "weight_version": weights.version, conventions.RL_WEIGHT_VERSION: weights.version}):
                await self.publisher.publish(WEIGHTS_PUBLISHED, weights)
        self.version = weights.version
        self._last_weights = weights
        remove_published(version_directory(self.weights_dir, weights.version - KEEP_WEIGHT_FILES) / MANIFEST_FILE)
