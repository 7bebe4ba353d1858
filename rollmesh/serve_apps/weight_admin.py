"""The admin endpoints' logic: every worker's weight versions, a weight update from one file on
every worker, and dropping the decode workers' parked sessions.

Knows the HTTP shapes and the worker actors' admin methods (``weight_versions``,
``update_weights_from_file``, ``drop_sessions``) through duck-typed handles, whose
``.method.remote()`` is awaitable; not Ray's errors (the caller maps them), not FastAPI.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rollmesh.serve_apps.errors import InvalidApiRequestError
from rollmesh.serve_apps.http_shapes import (
    FlushCacheResponse,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
    WeightVersionsResponse,
    WorkerWeights,
)


@dataclass(frozen=True, slots=True)
class Worker:
    """One inference worker actor as the admin endpoints see it."""

    name: str
    role: Literal["prefill", "decode"]
    actor: Any


async def weight_versions(workers: Sequence[Worker]) -> WeightVersionsResponse:
    """Each worker's active and staged version, and the oldest active one."""
    answers = await asyncio.gather(*(w.actor.weight_versions.remote() for w in workers))
    listed = [
        WorkerWeights(name=w.name, role=w.role, current_version=answer["current"],
                      staged_version=answer["staged"])
        for w, answer in zip(workers, answers, strict=True)
    ]
    return WeightVersionsResponse(
        weight_version=min(w.current_version for w in listed), workers=listed)


def requested_weight_version(raw: int | str | None, newest_active: int) -> int:
    """The version to update to: the request's (an int, or SGLang's string of one), else one past
    the newest version any worker has active."""
    if raw is None:
        return newest_active + 1
    if isinstance(raw, str):
        if not raw.strip().isdigit():
            raise InvalidApiRequestError(
                f"weight_version must be a non-negative integer (got {raw!r})",
                code="invalid_value", param="weight_version",
            )
        raw = int(raw)
    if raw < 0:
        raise InvalidApiRequestError(
            f"weight_version must be a non-negative integer (got {raw})",
            code="invalid_value", param="weight_version",
        )
    return raw


async def update_weights_from_disk(
    workers: Sequence[Worker], request: UpdateWeightsFromDiskRequest
) -> UpdateWeightsFromDiskResponse:
    """Stage the file on every worker at once and wait until each has the version active.

    A file that cannot be loaded fails on every worker alike, so no worker is left ahead."""
    if not request.model_path:
        raise InvalidApiRequestError("model_path is empty", code="invalid_value",
                                     param="model_path")
    current = await weight_versions(workers)
    version = requested_weight_version(
        request.weight_version, max(w.current_version for w in current.workers))
    active = await asyncio.gather(
        *(w.actor.update_weights_from_file.remote(request.model_path, version) for w in workers))
    reached = min(active)
    return UpdateWeightsFromDiskResponse(
        message=f"weight version {reached} is active on {len(workers)} workers",
        weight_version=reached,
    )


async def flush_cache(workers: Sequence[Worker]) -> FlushCacheResponse:
    """Free every parked session's KV on the decode workers (running requests keep theirs)."""
    decode = [w for w in workers if w.role == "decode"]
    freed = sum(await asyncio.gather(*(w.actor.drop_sessions.remote() for w in decode)))
    return FlushCacheResponse(
        message=f"dropped the parked sessions of {len(decode)} decode workers",
        kv_blocks_freed=freed,
    )
