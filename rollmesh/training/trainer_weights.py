"""The trainer's weight publication: a step's new version written and announced, by file or from
shared memory (``trainer.weight_sync``, ``engine/weight_memory.py``).

Knows the engine's bucket format, the memory seam and the wire contract; not Ray, not nats-py. A
mixin of ``TrainerLogic``, whose state it uses: ``backend``, ``config``, ``publisher``, ``clock``,
``version``, ``weights_dir``, ``memory``, ``latest_weights``, ``_announced`` and
``_last_weights``. ``_commit_step`` (in ``trainer_logic``) orders it with the ledger line.
"""

from __future__ import annotations

import asyncio

import structlog
from opentelemetry import trace

from rollmesh.engine.weight_buckets import (
    MANIFEST_FILE,
    remove_published,
    serialize_buckets,
    version_directory,
    write_buckets,
    write_serialized,
)
from rollmesh.messages import WeightsPublished
from rollmesh.messages.subjects import WEIGHTS_PUBLISHED
from rollmesh.telemetry import conventions

_log = structlog.get_logger("rollmesh.trainer")
_tracer = trace.get_tracer("rollmesh.trainer")

# Weight files older than this many versions behind the newest are deleted.
KEEP_WEIGHT_FILES = 8


class WeightPublishing:
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
            serialized = await asyncio.to_thread(serialize_buckets, self.backend.state_dict(), version=version,
                                                 bucket_bytes=self.config.weight_bucket_bytes)
            location = await asyncio.to_thread(self.memory.put, serialized)
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
