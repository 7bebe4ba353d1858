"""Follows the trainer's weight versions for one inference worker: load, stage, acknowledge.

Knows the engine's weight files, the mesh ports (rollmesh.ports) and the wire contract; not Ray,
not nats-py. On ``WeightsPublished`` it loads the version off the event loop: from shared memory
when the message names a memory copy on this node (``memory``, see ``weight_memory``), else (or
when that copy is gone) from the bucket manifest or single file at ``path``. It stages it (the
engine swaps at its next step boundary, so no request is aborted) and publishes
``WeightsActivated``, with the load's duration and source, once the swap happened. On start it
catches up with the newest version already published (``latest``), so a worker restarted after a
crash serves the current weights, not its initial ones. A version announced from shared memory is
announced before its files are written (``trainer.weight_sync = "memory"``): a worker that reads
the files then waits for the manifest to appear (``files_timeout_s``). It polls, with backoff: the
trainer announces each version once (JetStream dedups by version), so no later event says the
files are there. An engine whose servers may already hold the version (the trainer pushed it
into SGLang servers before announcing it, ``trainer.weight_sync = "nccl"``/``"ipc"``) says so
through ``adopt_pushed``; nothing is then read, and the activation's source is ``"pushed"``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import structlog

from rollmesh.ports import MessageContext, Publisher, Subscription
from rollmesh.engine.errors import WeightsFileError, WeightsUnavailableError
from rollmesh.engine.weight_buckets import load_published
from rollmesh.engine.weight_memory import FetchesWeightBuckets, load_from_memory
from rollmesh.messages import WeightsActivated, WeightsPublished
from rollmesh.messages.subjects import WEIGHTS_ACTIVATED, WEIGHTS_PUBLISHED
from rollmesh.telemetry import metrics, metrics_catalog

if TYPE_CHECKING:  # the follower hands tensors on; the loaders import torch when they make them
    import torch

_log = structlog.get_logger("rollmesh.engine.weight_follower")


class StagesWeights(Protocol):
    """An engine that takes staged weights and says when they are live. One that also has a
    ``last_swap_seconds`` (how long its last swap held it) gets it reported as ``pause_s``, and
    one with ``async adopt_pushed(version) -> bool`` is asked first whether it already runs the
    version (pushed into it without files)."""

    @property
    def current_version(self) -> int: ...

    def stage_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> bool: ...

    async def wait_weights_activated(self, version: int) -> int: ...

    def num_active(self) -> int: ...


# The newest WeightsPublished in the weights stream (None: none yet).
LatestWeights = Callable[[], Awaitable[WeightsPublished | None]]


class WeightFollower:
    def __init__(
        self,
        engine: StagesWeights,
        publisher: Publisher,
        *,
        worker: str,
        role: str,
        clock: Callable[[], float] = time.time,
        latest: LatestWeights | None = None,
        memory: FetchesWeightBuckets | None = None,
        files_timeout_s: float = 600.0,
    ) -> None:
        self.engine = engine
        self.memory = memory
        self.files_timeout_s = files_timeout_s
        self.publisher = publisher
        self.worker = worker
        self.role = role
        self.clock = clock
        self.latest = latest
        self._lock = asyncio.Lock()
        metrics.observe(metrics_catalog.WEIGHT_VERSION_ACTIVE, self, lambda follower: [
            (follower.engine.current_version, {"role": follower.role, "worker": follower.worker})])

    async def start(self) -> None:
        if self.latest is None:
            return
        newest = await self.latest()
        if newest is not None:
            _log.info("weights_catch_up", weight_version=newest.version, role=self.role)
            await self.handle_weights_published(newest)

    def subscriptions(self) -> list[Subscription]:
        return [Subscription(WEIGHTS_PUBLISHED, self.handle_weights_published, "core")]

    async def handle_weights_published(self, message: WeightsPublished, ctx: MessageContext | None = None) -> None:
        # One load at a time: a burst of versions must not read several files concurrently.
        async with self._lock:
            if message.version <= self.engine.current_version:
                return
            # Read, verify and stage (a checked copy) off the event loop: decoding goes on, and
            # the only pause is the swap itself at the next step boundary.
            started = time.perf_counter()
            adopt_pushed = getattr(self.engine, "adopt_pushed", None)
            if adopt_pushed is not None and await adopt_pushed(message.version):
                version, source, load_s = self.engine.current_version, "pushed", time.perf_counter() - started
            else:
                staged, source = await asyncio.to_thread(self._load_and_stage, message)
                load_s = time.perf_counter() - started
                if not staged:
                    return
                version = await self.engine.wait_weights_activated(message.version)
        _log.info("weights_activated", weight_version=version, role=self.role)
        await self.publisher.publish(
            WEIGHTS_ACTIVATED,
            WeightsActivated(
                version=version,
                worker=self.worker,
                role=self.role,
                in_flight=self.engine.num_active(),
                load_s=load_s,
                activated_at=self.clock(),
                source=source,
                # Engines that time their swap say how long generation stopped (0: unknown).
                pause_s=getattr(self.engine, "last_swap_seconds", 0.0),
            ),
        )

    def _load_and_stage(self, message: WeightsPublished) -> tuple[bool, str]:
        """Stage the version (a checked copy); (staged, where it was read). Runs on a thread."""
        if self.memory is not None and self.memory.reachable(message):
            try:
                # The state dict is views of shared memory; staging copies it, so the memory can
                # be let go of as soon as this returns.
                state = load_from_memory(message, self.memory).state_dict
                return self.engine.stage_weights(state, message.version), "memory"
            except WeightsUnavailableError as exc:
                _log.warning("weights_memory_unavailable", weight_version=message.version, reason=exc.reason)
        if message.memory_holder:
            wait_for_file(Path(message.path), self.files_timeout_s)
        return self.engine.stage_weights(load_published(message.path, message.sha256), message.version), "files"


def wait_for_file(path: Path, timeout_s: float) -> None:
    """Block until ``path`` exists (a published version's manifest, written last); raises
    ``WeightsFileError`` after ``timeout_s``."""
    deadline, delay = time.monotonic() + timeout_s, 0.01
    while not path.exists():
        if time.monotonic() >= deadline:
            raise WeightsFileError(str(path), f"not written within {timeout_s:g} s of its announcement")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)

