"""The admin routes' handling: ``GET /v1/admin/weights``, SGLang's ``POST
/update_weights_from_disk`` and ``POST /flush_cache``, with what the workers raised answered as
its HTTP error (``api_error_from_ray``) and weight updates logged.

Knows ``weight_admin`` (what each endpoint asks of the workers), Ray's exceptions and the HTTP
shapes; not FastAPI, not the API key (the route checks it first).
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog
from ray.exceptions import RayActorError, RayTaskError

from rollmesh.engine.errors import EngineError
from rollmesh.serve_apps.http_shapes import (
    FlushCacheResponse,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
    WeightVersionsResponse,
)
from rollmesh.serve_apps.router_calls import api_error_from_ray
from rollmesh.serve_apps.weight_admin import (
    Worker,
    flush_cache,
    update_weights_from_disk,
    weight_versions,
)

_log = structlog.get_logger("rollmesh.serve")


async def answer_weight_versions(workers: Sequence[Worker]) -> WeightVersionsResponse:
    try:
        return await weight_versions(workers)
    except (RayTaskError, RayActorError, EngineError) as exc:
        raise api_error_from_ray(exc) from exc


async def answer_update_weights(
    workers: Sequence[Worker], body: UpdateWeightsFromDiskRequest
) -> UpdateWeightsFromDiskResponse:
    try:
        answer = await update_weights_from_disk(workers, body)
    except (RayTaskError, RayActorError, EngineError) as exc:
        error = api_error_from_ray(exc)
        _log.warning("update_weights_failed", path=body.model_path, error=str(exc))
        raise error from exc
    _log.info("weights_updated_from_disk", path=body.model_path,
              weight_version=answer.weight_version)
    return answer


async def answer_flush_cache(workers: Sequence[Worker]) -> FlushCacheResponse:
    try:
        return await flush_cache(workers)
    except (RayTaskError, RayActorError, EngineError) as exc:
        raise api_error_from_ray(exc) from exc
